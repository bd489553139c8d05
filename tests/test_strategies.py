"""funshard.testing.strategies: what each strategy draws, that it shrinks to the simplest case,
and that bad arguments are refused by name."""

import subprocess
import sys

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import funshard as fs
from funshard.testing import world_of
from funshard.testing.strategies import (dtypes, mesh_specs, meshes, policies, shapes, tensors,
                                         trees)

QUIET = settings(database=None, max_examples=2000)


def leaves(tree):
    return fs.pytree.leaves(tree)


def test_shapes_draw_scalars_empty_single_and_uneven_rows():
    assert find(shapes(), lambda s: True, settings=QUIET) == ()
    assert find(shapes(), lambda s: len(s) >= 1 and s[0] == 0, settings=QUIET) == (0,)
    assert find(shapes(), lambda s: len(s) == 2 and s[0] == 1, settings=QUIET) == (1, 0)
    assert find(shapes(), lambda s: len(s) >= 1 and s[0] % 4 == 3, settings=QUIET) == (3,)
    assert find(shapes(max_side=11), lambda s: len(s) >= 1 and s[0] > 10, settings=QUIET) == (11,)


@given(shapes(min_dims=1, max_dims=2, max_side=3))
def test_shapes_stay_in_bounds(shape):
    assert 1 <= len(shape) <= 2 and all(0 <= n <= 3 for n in shape)


def test_dtypes_shrink_to_float32_and_add_integers_on_request():
    assert find(dtypes(), lambda d: True, settings=QUIET) == torch.float32
    assert find(dtypes(integers=True), lambda d: not d.is_floating_point,
                settings=QUIET) == torch.int64
    with pytest.raises(ValueError, match="no dtype"):
        dtypes(floating=False)


def test_trees_shrink_to_one_float32_scalar():
    tree = find(trees(integers=True, none=True), lambda t: True, settings=QUIET)
    assert list(tree) == ["w"] and tree["w"].shape == () and tree["w"].dtype == torch.float32


def test_a_failing_tree_shrinks_to_the_leaf_that_fails():
    def has_three_row_matrix(tree):
        return any(x.ndim == 2 and x.shape[0] >= 3 for x in leaves(tree))

    tree = find(trees(), has_three_row_matrix, settings=QUIET)
    assert list(tree) == ["w"] and tuple(tree["w"].shape) == (3, 0)


@settings(max_examples=60)
@given(trees(integers=True, none=True, frozen=True))
def test_trees_are_parameter_like(tree):
    assert isinstance(tree, dict) and tree
    flat = fs.pytree.fqn_dict(tree)  # raises when two paths share a dotted name
    assert 1 <= len(flat) <= 4 and all(isinstance(x, torch.Tensor) for x in flat.values())
    for x in flat.values():
        assert not x.requires_grad or x.is_floating_point()
    assert torch.equal(fs.pytree.leaves(tree)[0], next(iter(flat.values())))


def test_trees_options_say_what_they_draw():
    dts = {x.dtype for x in leaves(find(trees(integers=True), lambda t: any(
        x.dtype == torch.bool for x in leaves(t)), settings=QUIET))}
    assert torch.bool in dts
    assert find(trees(none=True), lambda t: "None" in repr(t), settings=QUIET)
    frozen = find(trees(frozen=True), lambda t: any(x.is_floating_point() and not x.requires_grad
                                                    for x in leaves(t)), settings=QUIET)
    assert leaves(frozen)[0].dtype == torch.float32
    params = find(trees(requires_grad=True), lambda t: True, settings=QUIET)
    assert all(x.requires_grad for x in leaves(params))
    plain = find(trees(), lambda t: len(leaves(t)) == 4, settings=QUIET)
    assert not any(x.requires_grad for x in leaves(plain))
    with pytest.raises(ValueError, match="max_leaves=0"):
        trees(max_leaves=0)


@given(tensors(shapes(max_dims=2), dtypes(integers=True)))
def test_tensors_are_the_same_in_every_process(t):
    assert isinstance(t, torch.Tensor)


def test_tensor_values_come_from_the_seed():
    from funshard.testing.strategies import make

    a, b = make((5, 3), torch.bfloat16, 7), make((5, 3), torch.bfloat16, 7)
    assert torch.equal(a, b) and a.dtype == torch.bfloat16
    assert not torch.equal(a, make((5, 3), torch.bfloat16, 8))


def test_meshes_are_every_spec_that_fits_simplest_first():
    assert mesh_specs(4) == [1, "1x1", 2, "1x2", "2x1", 3, "1x3", "3x1", 4, "1x4", "2x2", "4x1"]
    assert mesh_specs(2, dims=(2,)) == ["1x1", "1x2", "2x1"]
    assert all(world_of(s) <= 3 for s in mesh_specs(3))
    assert find(meshes(), lambda s: True, settings=QUIET) == 1
    assert find(meshes(), lambda s: world_of(s) > 2, settings=QUIET) == 3
    assert find(meshes(), lambda s: isinstance(s, str) and world_of(s) == 4,
                settings=QUIET) == "1x4"
    with pytest.raises(ValueError, match="max_world=0"):
        meshes(max_world=0)
    with pytest.raises(ValueError, match="dims"):
        meshes(dims=(3,))


def test_policies_shrink_to_the_default_policy():
    assert find(policies(), lambda p: True, settings=QUIET) == fs.Policy()
    assert find(policies(), lambda p: p.accumulate == 2, settings=QUIET) == fs.Policy(accumulate=2)
    assert find(policies(), lambda p: not p.reshard_after_forward,
                settings=QUIET) == fs.Policy(reshard_after_forward=False)
    mixed = find(policies(mixed_precision=True), lambda p: p.param_dtype is not None,
                 settings=QUIET)
    assert mixed == fs.Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="at least one value"):
        policies(accumulate=())


@given(policies(clip_norms=(None, 0.5)))
def test_policies_draw_only_the_given_values(policy):
    assert policy.clip_norm in (None, 0.5) and policy.accumulate in (1, 2)
    assert policy.param_dtype is None


def test_import_funshard_needs_no_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None; import funshard, funshard.testing; "
            "print('imported', flush=True); import funshard.testing.strategies")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout == "imported\n", out.stderr  # funshard itself imports without it
    assert out.returncode == 1
    assert "funshard.testing.strategies needs hypothesis: pip install hypothesis" in out.stderr


def test_strategies_compose_with_hypothesis():
    got = find(st.tuples(trees(max_leaves=1), meshes(max_world=2)), lambda tm: True,
               settings=QUIET)
    assert got[1] == 1 and list(got[0]) == ["w"]

"""Hypothesis strategies for property tests of sharding: shapes, dtypes, tensors, trees,
meshes and policies, each shrinking toward the simplest case (a scalar, float32, one leaf,
one rank, the default policy).

    >>> from hypothesis import given
    >>> from funshard.testing.strategies import meshes, pool_settings, trees
    >>> @pool_settings
    ... @given(tree=trees(), spec=meshes(max_world=4))
    ... def test_roundtrip(funshard_pool, tree, spec):
    ...     funshard_pool.run(spec, laws.roundtrip, tree)   # laws.roundtrip asserts on ranks

Trees hold plain tensors made from a drawn seed (the same tensor wherever it is unpickled),
so they travel to the ranks as they are. Needs hypothesis (``pip install funshard[test]``);
``import funshard`` does not. Importing this module registers the hypothesis profile
``"funshard"`` (:data:`pool_settings`: no deadline, since an example's first call on a world
spawns its ranks).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - hypothesis is an optional dependency
    raise ImportError("funshard.testing.strategies needs hypothesis: pip install hypothesis "
                      "(or funshard[test])") from e

FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTEGERS = (torch.int64, torch.int32, torch.bool)
# fqn-like keys: plain module names and dotted ones whose prefix is never a key of its own
# (so no two paths of a tree share a dotted name)
NAMES = ("w", "b", "weight", "bias", "emb", "head", "layers", "attn", "mlp", "norm.weight",
         "ln_f.bias")

pool_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("funshard", pool_settings)


def _nonneg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return value


def shapes(*, min_dims: int = 0, max_dims: int = 4, max_side: int = 11) -> st.SearchStrategy:
    """Tensor shapes: scalars (``()``), 0 and 1 rows, dim 0 uneven over any world.

    Args:
        min_dims: the fewest dimensions drawn.
        max_dims: the most dimensions drawn.
        max_side: the largest size of a dimension (0 is always possible).
    Returns:
        A strategy of tuples, shrinking toward ``()`` then toward zeros: ``(7, 3)``, ``()``.
    """
    _nonneg("shapes: min_dims", min_dims)
    _nonneg("shapes: max_side", max_side)
    if _nonneg("shapes: max_dims", max_dims) < min_dims:
        raise ValueError(f"shapes: max_dims={max_dims} is below min_dims={min_dims}")
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


_shapes = shapes  # for the functions below, whose arguments of the same names shadow it


def dtypes(*, floating: bool = True, integers: bool = False) -> st.SearchStrategy:
    """torch dtypes: floating (float32 first, bfloat16, float16, float64) and, with
    ``integers``, int64, int32 and bool.

    Returns:
        A strategy of ``torch.dtype``, shrinking toward ``torch.float32``.
    """
    pool = (FLOATING if floating else ()) + (INTEGERS if integers else ())
    if not pool:
        raise ValueError("dtypes: floating=False and integers=False leave no dtype to draw")
    return st.sampled_from(pool)


_dtypes = dtypes


def make(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The tensor of ``(shape, dtype, seed)``: normal values for floating dtypes, integers in
    [-1000, 1000) for integer ones, coin flips for bool; the same in every process."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, tuple(shape), generator=g).to(dtype)
    return torch.randn(tuple(shape), generator=g).to(dtype)


@st.composite
def tensors(draw, shapes: st.SearchStrategy | None = None,
            dtypes: st.SearchStrategy | None = None, *, requires_grad: bool = False,
            frozen: bool = False) -> torch.Tensor:
    """One tensor leaf: a drawn shape, dtype and seed (see :func:`make`).

    Args:
        shapes: the leaves' shapes' strategy (default :func:`shapes`).
        dtypes: the leaves' dtypes' strategy (default :func:`dtypes`).
        requires_grad: floating leaves require grad (parameters).
        frozen: with ``requires_grad``, a floating leaf may be frozen instead.
    Returns:
        A strategy of ``torch.Tensor``, shrinking toward a float32 scalar.
    """
    shape = draw(_shapes() if shapes is None else shapes)
    dtype = draw(_dtypes() if dtypes is None else dtypes)
    t = make(shape, dtype, draw(st.integers(0, 2**16)))
    if requires_grad and dtype.is_floating_point and not (frozen and draw(st.booleans())):
        t.requires_grad_(True)
    return t


def trees(*, shapes: st.SearchStrategy | None = None, dtypes: st.SearchStrategy | None = None,
          max_leaves: int = 4, requires_grad: bool = False, frozen: bool = False,
          integers: bool = False, none: bool = False) -> st.SearchStrategy:
    """Parameter-like trees: a dict with fqn-like keys at the root, nested dicts, lists and
    tuples below, tensors at the leaves.

    Args:
        shapes: the strategy of the leaves' shapes (default :func:`shapes`).
        dtypes: the strategy of the leaves' dtypes (default ``dtypes(integers=integers)``).
        max_leaves: the most tensor leaves in a tree (at least one is always there).
        requires_grad: floating leaves require grad, as a model's parameters do.
        frozen: some floating leaves are frozen (``requires_grad=False``); implies
            ``requires_grad``.
        integers: integer and bool leaves too (they never require grad).
        none: ``None`` leaves among a container's children (an empty slot of the tree).
    Returns:
        A strategy of trees, shrinking toward ``{"w": <float32 scalar>}``, e.g.
        ``{"layers": [{"w": (7, 3) float32}, {"b": (), "bias": None}], "norm.weight": (3,)}``.
    """
    if isinstance(max_leaves, bool) or not isinstance(max_leaves, int) or max_leaves < 1:
        raise ValueError(f"trees: max_leaves={max_leaves!r} must be an int >= 1")
    if dtypes is None:
        dtypes = _dtypes(integers=integers)
    leaf = tensors(shapes, dtypes, requires_grad=requires_grad or frozen, frozen=frozen)
    keys = st.sampled_from(NAMES)

    def extend(kids):
        kid = kids | st.none() if none else kids
        return st.one_of(st.dictionaries(keys, kid, min_size=1, max_size=3),
                         st.lists(kid, min_size=1, max_size=3),
                         st.lists(kid, min_size=1, max_size=3).map(tuple))

    tree = st.recursive(leaf, extend, max_leaves=max_leaves)
    rooted = tree.map(lambda t: t if isinstance(t, dict) else {"w": t})
    return rooted.filter(_has_tensor) if none else rooted


def _has_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    items = tree.values() if isinstance(tree, dict) else tree if tree is not None else ()
    return any(_has_tensor(x) for x in items)


def mesh_specs(max_world: int = 4, dims: Sequence[int] = (1, 2)) -> list:
    """Every mesh spec of at most ``max_world`` ranks, simplest first: ``1, "1x1", 2, "1x2",
    "2x1", 3, ...`` (an int is 1-D, ``"RxS"`` is replicate x shard)."""
    if isinstance(max_world, bool) or not isinstance(max_world, int) or max_world < 1:
        raise ValueError(f"meshes: max_world={max_world!r} must be an int >= 1")
    if not dims or not set(dims) <= {1, 2}:
        raise ValueError(f"meshes: dims={tuple(dims)!r}: name 1 (1-D), 2 (2-D) or both")
    out: list = []
    for world in range(1, max_world + 1):
        if 1 in dims:
            out.append(world)
        if 2 in dims:
            out += [f"{r}x{world // r}" for r in range(1, world + 1) if world % r == 0]
    return out


def meshes(*, max_world: int = 4, dims: Sequence[int] = (1, 2)) -> st.SearchStrategy:
    """Mesh specs that fit a pool of ``max_world`` ranks, for ``funshard_pool.run(spec, ...)``
    and ``funshard.testing.mesh(spec)``.

    Args:
        max_world: the most ranks (the pool's size; the plugin's default is 4).
        dims: 1 for 1-D meshes ``("shard",)``, 2 for 2-D ``("replicate", "shard")``.
    Returns:
        A strategy of specs (``4``, ``"2x2"``), shrinking toward one rank.
    """
    return st.sampled_from(mesh_specs(max_world, dims))


def policies(*, accumulate: Sequence[int] = (1, 2), clip_norms: Sequence = (None, 0.1),
             mixed_precision: bool = False, transports: Sequence[str] = ()) -> st.SearchStrategy:
    """``fs.Policy`` objects over the options a step's numbers depend on: resharding after
    forward, prefetch, micro-batches, global-norm clipping, and (opt-in) mixed precision and
    the bucket transport.

    Args:
        accumulate: micro-batch counts to draw (a batch's rows per rank must divide by each).
        clip_norms: ``clip_norm`` values to draw (None: no clipping).
        mixed_precision: also draw ``param_dtype=torch.bfloat16`` with float32 or bfloat16
            reduction (parity then holds to bfloat16's tolerance, not float32's).
        transports: transport names to draw besides the default.
    Returns:
        A strategy of ``fs.Policy``, shrinking toward ``fs.Policy()``.
    """
    from ..step import Policy

    if not accumulate or not clip_norms:
        raise ValueError("policies: accumulate and clip_norms each need at least one value")
    precisions = [(None, None)]
    if mixed_precision:
        precisions += [(torch.bfloat16, torch.float32), (torch.bfloat16, None)]
    transport = st.sampled_from((Policy().transport,) + tuple(transports))
    return st.builds(
        lambda raf, prefetch, acc, clip, prec, tr: Policy(
            reshard_after_forward=raf, prefetch=prefetch, accumulate=acc, clip_norm=clip,
            param_dtype=prec[0], reduce_dtype=prec[1], transport=tr),
        st.sampled_from([True, False]), st.sampled_from([True, False]),
        st.sampled_from(list(accumulate)), st.sampled_from(list(clip_norms)),
        st.sampled_from(precisions), transport)

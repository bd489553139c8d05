"""step.group: a group's states, the one table of allowed moves, and each move's storage
effects, on a world of one in this process (nothing is communicated)."""

from types import SimpleNamespace

import pytest
import torch

from funshard.layout import Layout
from funshard.step.group import ALLOWED, RESIDENT, Group, GroupState, IllegalTransition

S = GroupState


def fake_params(shapes, cast=None):
    """What Group reads of a ParamGroups: one group of sharded leaves, world 1."""
    lays = [Layout(f"g.p{i}", torch.Size(s), torch.float32, True, 1, 0)
            for i, s in enumerate(shapes)]
    dtypes = [cast or torch.float32] * len(shapes)
    return SimpleNamespace(members=[list(range(len(shapes)))], layouts=lays, dtypes=dtypes,
                           world=1, data_world=1, names=["g"], mesh=None,
                           uncast=[cast in (None, torch.float32)])


def make_group(shapes=((4, 3), (5,)), cast=torch.float64):
    torch.manual_seed(0)
    shards = [torch.randn(s) for s in shapes]
    return Group(0, fake_params(shapes, cast), shards, {}, "c10d"), shards


def test_table_covers_every_state():
    assert set(ALLOWED) == set(S)
    assert ALLOWED[S.ALIASED] == frozenset()  # a world of one with no cast: never moves
    for state, targets in ALLOWED.items():
        assert state not in targets  # no move is a no-op
    assert RESIDENT == {S.GATHERED, S.PARTIAL, S.PARTIAL_GATHERING, S.ALIASED}


@pytest.mark.parametrize("start,to", [(s, t) for s in S for t in S if t not in ALLOWED[s]])
def test_illegal_move_names_group_and_states(start, to):
    g, _ = make_group()
    g.state = start
    with pytest.raises(IllegalTransition) as e:
        g.move(to)
    assert f"group 'g' cannot go from {start.name} to {to.name}" in str(e.value)
    assert g.state is start


def test_gather_free_refill():
    g, shards = make_group()
    assert g.state is S.SHARDED and not g.resident
    fulls = g.gather()
    assert g.state is S.GATHERED
    assert [f.dtype for f in fulls] == [torch.float64] * 2
    assert all(torch.equal(f, s.double()) for f, s in zip(fulls, shards))
    assert g.held == sum(f.numel() * 8 for f in fulls)
    assert len(g.storage) == 2  # every gathered storage is known to the saved-tensor hooks
    bases = list(g.bases)
    g.free()
    assert g.state is S.SHARDED and g.held == 0 and not g.storage
    assert all(b.untyped_storage().nbytes() == 0 for b in bases)
    g.gather()  # the second gather refills the same storages autograd may have saved
    assert g.state is S.GATHERED and all(a is b for a, b in zip(g.bases, bases))
    assert all(torch.equal(f, s.double()) for f, s in zip(g.fulls, shards))


def test_free_keeps_only_a_storage_held_beyond_autograds_saved_copies():
    """Freeing resizes a leaf whose storage only the group and autograd's pending saved
    copies hold (they are gathered again when unpacked), and keeps one something else holds
    through a tensor of its own on the storage (a checkpoint region's recompute keeps what
    backward handed it, its saved tensors unseen by the step's hooks): resizing that one
    would pull the bytes from under it."""
    g, shards = make_group()
    g.gather()
    pending = g.fulls[0].detach()  # what the saved-tensor hooks packed for autograd
    g.saved = [1, 0]
    kept = g.fulls[1].detach()[:2]  # another tensor on the storage, not the group's
    g.free()
    assert g.bases[0].untyped_storage().nbytes() == 0, "a pending saved copy is no holder"
    assert g.bases[1].untyped_storage().nbytes() > 0
    assert torch.equal(kept, shards[1][:2].double())
    del pending


def test_partial_then_gather_owed():
    g, shards = make_group()
    g.gather()
    g.saved = [1, 0]  # autograd saved leaf 0 only
    g.free_leaves([0, 1])
    assert g.state is S.PARTIAL and g.to_regather == [0, 1]
    assert g.bases[0].untyped_storage().nbytes() == 0
    g.prefetch_regather()
    assert g.state is S.PARTIAL_GATHERING
    g.regather()
    assert g.state is S.GATHERED and g.to_regather == []
    assert all(torch.equal(f, s.double()) for f, s in zip(g.fulls, shards))


def test_a_freed_leaf_nobody_saved_is_owed_too():
    """GATHERED means every leaf is full: a recompute reads leaves autograd never saved
    through the step's hooks (a checkpoint region's own saves bypass them)."""
    g, shards = make_group()
    g.gather()
    g.free_leaves([1])
    assert g.state is S.PARTIAL and g.to_regather == [1]
    assert g.bases[1].untyped_storage().nbytes() == 0
    g.regather()
    assert g.state is S.GATHERED and torch.equal(g.fulls[1], shards[1].double())


def test_prefetch_unused_is_dropped_and_used_is_gathered():
    g, _ = make_group()
    g.prefetch()
    assert g.state is S.GATHERING and g.pending is not None
    g.free()  # not resident: a gather in flight is left to finish
    assert g.state is S.GATHERING
    g.finish_gather()  # nobody used it: its fresh tensors are dropped
    assert g.state is S.SHARDED and g.bases is None
    g.prefetch()
    g.gather()
    assert g.state is S.GATHERED and g.pending is None


def test_partial_gathering_free_finishes_first():
    g, _ = make_group()
    g.gather()
    g.saved = [1, 1]
    g.free_leaves([0])
    g.prefetch_regather()
    g.free()
    assert g.state is S.SHARDED and g.pending is None and g.to_regather == []


def test_aliased_world_of_one_without_cast():
    g, shards = make_group(cast=None)
    shards[0].requires_grad_()
    assert g.aliases
    g.alias()
    fulls = g.fulls
    assert g.state is S.ALIASED
    assert all(f.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
               for f, s in zip(fulls, shards))
    # autograd leaves of their own: a trainable one requires grad, and its gradient stays
    # in its .grad for the run to hand over
    assert fulls[0].is_leaf and fulls[0].requires_grad and fulls[0] is not shards[0]
    assert not fulls[1].requires_grad
    (fulls[0] * 2).sum().backward()
    assert torch.equal(fulls[0].grad, torch.full_like(shards[0], 2.0)) and shards[0].grad is None
    g.free()
    g.release_leaf(0)
    assert g.state is S.ALIASED and g.bases[0] is not None  # the shards are never freed


def test_drop_lets_go_without_resizing():
    g, _ = make_group()
    g.gather()
    base = g.bases[0]
    g.release_leaf(0)
    assert g.bases[0] is None and g.fulls[0] is None
    assert base.untyped_storage().nbytes() > 0  # the node using it may still compute
    assert len(g.storage) == 1

"""Groups entered at their module ([Note: groups entered at their module] in
funshard.step.call): inside fs.call a group module's forward starts with its group gathered,
so a custom autograd Function that is the first to touch a parameter there receives a plain
gathered tensor and trains as one process; a Liger-style fused linear cross-entropy over
``lm_head.weight`` trains likewise; FULL_SHARD frees the group as the next one is gathered."""

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import funshard as fs
from funshard.collectives import force_collectives
from funshard.testing import assert_parity, capture, mesh
from funshard.testing.models import MatMulT


class FunctionBlock(nn.Module):
    """A block whose first op on its weight is a custom Function (as a quantized linear)."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.b = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x + torch.tanh(MatMulT.apply(x, self.w) + self.b)


class FunctionNet(nn.Module):
    def __init__(self, dim: int = 6, blocks: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(FunctionBlock(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _batches(rows=8, steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g))
            for _ in range(steps)]


class OwnCheckpoint(FunctionBlock):
    """The block checkpoints its own forward (non-reentrant), the Function inside."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def _reentrant() -> bool:
    """Reentrant regions on the ranks; the one-process reference (``torch.autograd.grad``,
    which reentrant regions refuse) checkpoints without: the same gradients."""
    return torch.distributed.is_initialized()


class CallCheckpointed(FunctionNet):
    """Each block's call checkpointed from outside, as Hugging Face models do."""

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=_reentrant())
        return self.out(h)


class ReentrantInside(FunctionBlock):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=_reentrant())


def _net(how: str) -> nn.Module:
    net = CallCheckpointed() if how == "call_checkpointed" else FunctionNet()
    if how in ("own_checkpoint", "reentrant_inside"):
        torch.manual_seed(0)
        kind = OwnCheckpoint if how == "own_checkpoint" else ReentrantInside
        net.blocks = nn.ModuleList(kind(6) for _ in range(3))
    return net


@pytest.mark.parametrize("how", ["plain", "policy_checkpoint", "own_checkpoint",
                                 "call_checkpointed", "reentrant_inside"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_custom_function_first_in_a_group_module_trains_as_one_process(pools, raf, how):
    assert fs.list_groups(fs.params(FunctionNet()))[1].name == "blocks.0"
    assert_parity(pools, _net(how), functools.partial(fs.optim.adamw, lr=1e-2),
                  _batches(), criterion=F.mse_loss, meshes=[2, "2x2"],
                  policy=fs.Policy(reshard_after_forward=raf,
                                   checkpoint=how == "policy_checkpoint"))


class FusedLinearCE(torch.autograd.Function):
    """Liger's fused linear cross-entropy in miniature: the logits are computed chunk by
    chunk in forward, with the gradients of the hidden states and of the head's weight,
    which backward only scales; the logits are never kept."""

    @staticmethod
    def forward(ctx, h, w, target, chunk: int = 5):
        gh, gw = torch.zeros_like(h), torch.zeros_like(w)
        loss = h.new_zeros(())
        n = h.shape[0]
        for s in range(0, n, chunk):
            logits = h[s:s + chunk] @ w.t()
            p = logits.softmax(-1)
            t = target[s:s + chunk]
            loss = loss - p.log().gather(1, t[:, None]).sum()
            p[torch.arange(len(t)), t] -= 1
            gh[s:s + chunk] = p @ w
            gw += p.t() @ h[s:s + chunk]
        ctx.save_for_backward(gh / n, gw / n)
        return loss / n

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return g * gh, g * gw, None, None


class FusedHead(nn.Module):
    """A Hugging Face Llama whose head runs through :class:`FusedLinearCE` on
    ``lm_head.weight``, as Liger patches the model's forward."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=36,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=32, tie_word_embeddings=False)
        torch.manual_seed(0)
        self.llama = LlamaForCausalLM(cfg)

    def forward(self, ids):
        h = self.llama.model(input_ids=ids).last_hidden_state[:, :-1]
        return FusedLinearCE.apply(h.reshape(-1, h.shape[-1]), self.llama.lm_head.weight,
                                   ids[:, 1:].reshape(-1))


def _model_loss(out, _target):
    return out


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_fused_linear_cross_entropy_over_lm_head_trains_as_one_process(pools, raf):
    g = torch.Generator().manual_seed(2)
    batches = [(ids, ids) for ids in (torch.randint(0, 64, (4, 8), generator=g)
                                      for _ in range(3))]
    assert_parity(pools, FusedHead(), functools.partial(fs.optim.adamw, lr=1e-2), batches,
                  criterion=_model_loss, meshes=[2, "2x2"],
                  policy=fs.Policy(reshard_after_forward=raf))


class Recording(FunctionBlock):
    """A block that records, at its forward's first line, its weight's type and the type
    of the block before's."""

    def __init__(self, dim, before, seen):
        super().__init__(dim)
        self.before, self.seen = before, seen  # plain attributes: not submodules

    def forward(self, x):
        prev = None if self.before is None else type(self.before[0].w).__name__
        self.seen.append((type(self.w).__name__, prev))
        return super().forward(x)


def seen_in_blocks(spec, raf):
    m = mesh(spec)
    model, seen = FunctionNet(), []
    blocks = [Recording(6, None, seen)]
    for _ in range(2):
        blocks.append(Recording(6, [blocks[-1]], seen))
    model.blocks = nn.ModuleList(blocks)
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.sgd(lr=0.1), policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    for x, y in _batches(rows=4, steps=2):
        state, _ = step(state, (x, y))
    return seen[-3:], [type(b.forward).__name__ for b in model.blocks]


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_a_group_module_starts_gathered_and_is_freed_by_the_next(pools, raf):
    for seen, left in pools.run(2, seen_in_blocks, raf):
        # each block's forward starts with its weight a plain gathered tensor; the block
        # before, whose module has returned, holds its stand-in again (its gathered tensors
        # are installed for the call only; FULL_SHARD frees them, SHARD_GRAD_OP keeps them)
        assert seen == [("Tensor", None)] + [("Tensor", "LazyParam")] * 2
        assert left == ["method"] * 3  # nothing stays on the module after the step


class FunctionInRootRegion(FunctionNet):
    """The rest group's ``inp.weight`` first touched by a custom Function inside a
    checkpoint region of the root's forward: no group module is entered around it."""

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda x: MatMulT.apply(x, self.inp.weight) + self.inp.bias, x,
            use_reentrant=False)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def refused(spec, how):
    """One step of ``_net(how)``, or of :class:`FunctionInRootRegion`: what it raised, and
    whether the parameters are unchanged."""
    m = mesh(spec)
    model = FunctionInRootRegion() if how == "function_in_root_region" else _net(how)
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), m))
    before = {k: v.to_local().clone() for k, v in state.params.items()}
    x, y = _batches(rows=4, steps=1)[0]
    t, msg = capture(lambda: step(state, (x, y)))
    return t, msg, all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())


def test_a_function_first_outside_group_modules_in_a_checkpoint_region_is_refused(pools):
    """It was trained wrong (the region's hooks hid the Function from the refusal)."""
    for t, msg, same in pools.run(2, refused, "function_in_root_region"):
        assert t == "NotImplementedError" and "given to a torch.autograd.Function" in msg, msg
        assert "'inp.weight'" in msg and same


class ClampsItself(FunctionBlock):
    """A block that clips its own weight in place in forward (under no_grad, as weight
    clipping is written): inside the step the write would go to a gathered copy."""

    def forward(self, x):
        with torch.no_grad():
            self.w.clamp_(-0.1, 0.1)
        return super().forward(x)


def clamped(spec):
    m = mesh(spec)
    model = FunctionNet()
    model.blocks[1] = ClampsItself(6)
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.sgd(lr=0.1), policy=fs.Policy(param_dtype=torch.float64))
    state = step.init(fs.shard(fs.params(model), m))
    before = {k: v.to_local().clone() for k, v in state.params.items()}
    x, y = _batches(rows=4, steps=1)[0]
    t, msg = capture(lambda: step(state, (x, y)))
    return t, msg, all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_module_writing_into_its_own_weight_is_refused(pools, spec):
    """The write goes to the gathered (on one rank: cast) copy and would be lost: refused
    by name as the module returns, nothing updated."""
    for t, msg, same in pools.run(spec, clamped):
        assert t == "RuntimeError" and "wrote into parameter 'blocks.1.w' in place" in msg, msg
        assert same


def gathers_in_step_two(spec, raf):
    """All-gathers of step 2 (the order learned) on a stack of blocks and nothing else (the
    benchmark's shapes A and B in miniature)."""
    from funshard.testing import CountCollectives

    m = mesh(spec)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
                            for _ in range(3)])
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.sgd(lr=0.1), policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    batch = (torch.randn(2, 6), torch.randn(2, 6))
    state, _ = step(state, batch)
    with CountCollectives() as cc:
        step(state, batch)
    return cc.counts.get("all_gather", 0), len(fs.list_groups(fs.params(model)))


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_the_last_block_stays_gathered_into_backward(pools, raf):
    """The block forward ends with is not freed as its module returns: backward starts with
    it (FULL_SHARD: 2 gathers per block but that one)."""
    for gathers, groups in pools.run(2, gathers_in_step_two, raf):
        assert groups == 3, groups
        assert gathers == (5 if raf else 3), gathers


def fused_head_local_and_forced(spec, param_dtype):
    """The fused head's parameters after 3 steps on a world of one, its collectives skipped
    (a gather is a cast, or nothing) and forced."""
    model = FusedHead()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (4, 8), generator=g) for _ in range(3)]
    out = []
    for forced in (False, True):
        step = fs.train_step(lambda p, ids: fs.call(model, p, ids), fs.optim.adamw(lr=1e-2),
                             policy=fs.Policy(param_dtype=param_dtype))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        with force_collectives(forced):
            for ids in batches:
                state, _ = step(state, ids)
        out.append(fs.unshard(state.params))
    local, forced = out
    return max((local[k] - forced[k]).abs().max().item() for k in local)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_cross_entropy_on_a_world_of_one_trains_as_with_its_collectives(
        pools, param_dtype):
    assert pools.run(1, fused_head_local_and_forced, param_dtype)[0] == 0.0

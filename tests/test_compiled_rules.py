"""The step's rules hold for ``train_step(..., compile=True)`` as for the eager step: a
non-finite loss refuses the step by name with the state unchanged (or skips it under
``Policy(skip_nonfinite=True)``, training on after it as the eager step does), and a
parameter no rank reached keeps its value and its optimizer state (no weight decay), at 2
and 2x2 ranks."""

import functools
import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import mesh
from test_compiled_step import LR, _batches, _gpt

AOT = {"backend": "aot_eager"}


def _scaled_loss(model):
    """The GPT's loss times the batch's third entry: a NaN there makes every gradient NaN,
    with the same input signature (the same program)."""
    def loss_fn(params, batch):
        x, y, scale = batch
        return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten()) * scale
    return loss_fn


def _scales(steps: int, bad: int) -> list:
    return [torch.tensor(math.nan if i == bad else 1.0) for i in range(steps)]


def scaled_step(spec, compile, skip=False):
    """A fresh dynamo; the GPT's scaled loss under AdamW (weight decay 0.1) and the Policy's
    clip at 1.0 (``skip``: skip_nonfinite): the step and its state on ``mesh(spec)``."""
    torch._dynamo.reset()
    model = _gpt()
    step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR, weight_decay=0.1),
                         policy=fs.Policy(skip_nonfinite=skip, clip_norm=1.0), compile=compile)
    return step, step.init(fs.shard(fs.params(model), mesh(spec)))


def _opt_locals(state) -> list:
    return [t.to_local().clone() if hasattr(t, "to_local") else t
            for t in fs.pytree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]


def nonfinite(spec, compile, skip, steps=4, bad=2):
    """Train on ``steps`` batches, the ``bad``-th with a NaN scale: per step (loss,
    skipped) or the refusal's (type, message, parameters and optimizer state unchanged);
    the full parameters at the end (at the refusal, under the default rule)."""
    from torch._dynamo.utils import counters

    step, state = scaled_step(spec, compile, skip)
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    seen, per = [], 2
    for (x, y), s in zip(_batches(steps, world, per), _scales(steps, bad)):
        rows = slice(rank * per, (rank + 1) * per)
        before = ({k: v.to_local().clone() for k, v in state.params.items()},
                  _opt_locals(state))
        new = None
        try:  # refused in the step or, compiled, at the metrics' read
            new, metrics = step(state, (x[rows], y[rows], s))
            seen.append((float(metrics["loss"]), int(metrics["skipped"])))
        except Exception as e:  # noqa: BLE001 - refused: what it said, and the state held?
            same = (all(torch.equal(before[0][k], v.to_local())
                        for k, v in state.params.items())
                    and all(torch.equal(a, b) for a, b in zip(before[1], _opt_locals(state))))
            seen.append((type(e).__name__, str(e), same, _refuses(new)))
            break
        state = new
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return seen, full, (state.step, state.skipped), counters["stats"]["unique_graphs"]


def _refuses(state) -> str | None:
    """What reading ``state`` (the state a refused step returned, if it returned) raised."""
    if state is None:
        return None
    try:
        state.params
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "nothing"


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_nonfinite_step_is_refused_by_name_with_the_state_unchanged(pools, spec):
    """Compiled, the step returns before it reads anything: the refusal comes at the
    metrics' read, the update skipped on the device; the state passed in is usable again,
    unchanged, and the one returned refuses to be read."""
    for seen, _, counts, graphs in pools.run(spec, nonfinite, AOT, False, timeout=600):
        assert graphs == 2, graphs  # the refused step ran the program
        assert len(seen) == 3 and all(math.isfinite(l) for l, _ in seen[:2]), seen
        kind, msg, same, returned = seen[2]
        assert kind == "FloatingPointError" and same, (kind, msg)
        assert "is not finite" in msg and "'" in msg and "unchanged" in msg, msg
        assert "skipped on the device" in msg and returned == "FloatingPointError", returned
        assert counts == (2, 0), counts


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_skipped_nonfinite_step_trains_on_as_the_eager_step(pools, spec):
    for (es, ep, ec, _), (cs, cp, cc, graphs) in zip(
            pools.run(spec, nonfinite, False, True, timeout=600),
            pools.run(spec, nonfinite, AOT, True, timeout=600)):
        assert graphs == 2, graphs
        assert [k for _, k in cs] == [k for _, k in es] == [0, 0, 1, 0], (cs, es)
        assert cc == ec == (4, 1), (cc, ec)
        assert all(abs(a - b) <= 1e-5 for (a, _), (b, _) in zip(cs, es) if math.isfinite(b))
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5


def unreached(spec, compile, steps=3):
    """A leaf no rank's loss reaches (a Linear loss_fn never calls): its value
    after AdamW with weight decay, and whether its moments stayed zero."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    model.spare = torch.nn.Linear(16, 4)  # a module loss_fn never calls
    step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR, weight_decay=0.1),
                         compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    per = 2
    for x, y in _batches(steps, world, per):
        rows = slice(rank * per, (rank + 1) * per)
        state, _ = step(state, (x[rows], y[rows], torch.tensor(1.0)))
    full = fs.unshard(state.params)
    paths, leaves, _ = fs.pytree.flatten_with_path(state.opt_state)
    spare = [float(t.to_local().abs().max()) for p, t in zip(paths, leaves)
             if "spare" in fs.pytree.fqn(p) and isinstance(t, torch.Tensor) and t.numel()]
    return (torch.equal(full["spare.weight"], model.spare.weight.detach()), spare,
            {k: v.detach().clone() for k, v in full.items()})


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_parameter_no_rank_reached_is_left_alone(pools, spec):
    for (e_same, e_m, e_full), (c_same, c_m, c_full) in zip(
            pools.run(spec, unreached, False, timeout=600),
            pools.run(spec, unreached, AOT, timeout=600)):
        assert e_same and c_same, (e_same, c_same)  # no weight decay: untouched
        assert e_m == c_m and c_m and not any(c_m), (e_m, c_m)  # moments still zero
        assert max((c_full[k] - e_full[k]).abs().max().item() for k in e_full) <= 1e-5


def with_mode(spec, mode, steps=3):
    """The eager step and the compiled one under ``torch.compile``'s ``mode`` (inductor):
    losses and full parameters; what the program's backend was given."""
    from funshard.step import backend
    from funshard.step.update_program import without_cuda_graphs

    out = {}
    for name, compile in (("eager", False), ("compiled", {"mode": mode})):
        torch._dynamo.reset()
        rank, world = dist.get_rank(), dist.get_world_size()
        model = _gpt()
        step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR), compile=compile)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        losses = []
        for x, y in _batches(steps, world, 2):
            state, metrics = step(state, (x[rank * 2:(rank + 1) * 2],
                                          y[rank * 2:(rank + 1) * 2], torch.tensor(1.0)))
            losses.append(float(metrics["loss"]))
        out[name] = losses, {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    inner = backend.compile_options({"mode": mode})["backend"].inner
    update = backend.compile_options(without_cuda_graphs({"mode": mode}))["backend"].inner
    torch._dynamo.reset()
    return out, dict(getattr(inner, "config", {})), dict(getattr(update, "config", {}))


def test_torch_compiles_mode_reaches_inductor_and_trains_as_the_eager_step(pools):
    """``compile={"mode": "reduce-overhead"}``: inductor gets the mode's options (CUDA graphs;
    on the CPU inductor compiles without them) and the step trains as the eager one. The
    update program is compiled without them: it writes its inputs in place (the CUDA lane's
    ``compiled_step_cudagraphs`` runs both on a GPU)."""
    (out, config, update), = pools.run(1, with_mode, "reduce-overhead", timeout=900)
    assert config.get("triton.cudagraphs") is True, config
    assert update.get("triton.cudagraphs") is False, update
    (el, ep), (cl, cp) = out["eager"], out["compiled"]
    assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-5, (cl, el)
    assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5


class _DropoutNet(torch.nn.Module):
    """Two residual blocks with dropout, and a head."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3)) for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def dropout_runs(spec, policy, steps=4):
    """The eager step and the compiled one (``aot_eager``: torch's own random ops) from the
    same random state: losses and full parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, compile in (("eager", False), ("compiled", AOT)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _DropoutNet()
        step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                             fs.optim.adamw(1e-2), compile=compile,
                             policy=fs.Policy(**policy))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(5 + rank)  # each rank draws its own masks
        losses = []
        for _ in range(steps):
            x, y = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 4, generator=g)
            state, metrics = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
            losses.append(float(metrics["loss"]))
        out[name] = losses, {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("policy", [{}, {"reshard_after_forward": False},
                                    {"checkpoint": True}],
                         ids=["full_shard", "shard_grad_op", "checkpoint"])
def test_dropout_draws_as_the_eager_step(pools, policy):
    """The first step's trial run of the program keeps the random state as it found it: the
    compiled step draws the eager step's dropout masks, step after step (bit for bit under a
    backend that runs torch's random ops; the step's regions keep the draws of forward, as
    the eager recompute draws them again from the same state)."""
    for r in pools.run(2, dropout_runs, policy, timeout=600):
        (el, ep), (cl, cp) = r["eager"], r["compiled"]
        # the draws are the eager step's; the update is the compiled step's own program (the
        # same ops, which aot_eager's vectorised loops may round apart)
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-6, (cl, el)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-6


_LOG = logging.getLogger("funshard.tests.model")  # as a library's module has its own


class _LoggingNet(torch.nn.Module):
    """Logs in its forward, as library models do (a warning, and a warning_once-style
    method a library put on ``logging.Logger``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        _LOG.warning("forward of a %s", type(self).__name__)
        _LOG.warning_once_funshard_test("said once")
        return self.head(torch.tanh(self.fc(x)))


def logging_runs(spec, steps=3):
    """The eager and the compiled step on a model that logs: losses, parameters, graphs and
    breaks, and how many records each run's steps emitted."""
    from torch._dynamo.utils import counters

    records: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.Logger.warning_once_funshard_test = functools.lru_cache(None)(
        lambda self, *a: self.warning(*a))
    _LOG.addHandler(Keep())
    _LOG.propagate = False
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    try:
        for name, compile in (("eager", False), ("compiled", AOT)):
            torch._dynamo.reset()
            counters.clear()
            records.clear()
            logging.Logger.warning_once_funshard_test.cache_clear()
            torch.manual_seed(0)
            model = _LoggingNet()
            step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                                 fs.optim.adamw(1e-2), compile=compile)
            state = step.init(fs.shard(fs.params(model), mesh(spec)))
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(steps):
                x, y = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 4,
                                                                         generator=g)
                rows = slice(rank * 2, (rank + 1) * 2)
                state, metrics = step(state, (x[rows], y[rows]))
                losses.append(float(metrics["loss"]))
            out[name] = (losses, {k: v.detach().clone()
                                  for k, v in fs.unshard(state.params).items()},
                         counters["stats"]["unique_graphs"],
                         sum(counters["graph_break"].values()), list(records))
    finally:
        del logging.Logger.warning_once_funshard_test
        torch._dynamo.reset()
    return out


def test_logging_in_the_model_runs_at_the_eager_step_and_not_in_the_program(pools):
    """Logging calls do not break the program's graph: they run at the first (eager) step
    and are no-ops in the program, as Python's side effects under ``jax.jit``."""
    for r in pools.run(2, logging_runs, timeout=600):
        (el, ep, _, _, erec), (cl, cp, graphs, breaks, crec) = r["eager"], r["compiled"]
        assert graphs == 2 and breaks == 0, (graphs, breaks)
        # (the update is the compiled step's own program: aot_eager may round it apart,
        # by the machine's vector width; the first loss comes before any update)
        assert cl[0] == el[0] and max(abs(a - b) for a, b in zip(cl, el)) <= 1e-6, (cl, el)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-6
        assert erec.count("forward of a _LoggingNet") == 3 and erec.count("said once") == 1
        assert crec == ["forward of a _LoggingNet", "said once"], crec  # the eager step's


def python_value_changed(spec):
    """loss_fn reads a Python number that changes after the program was traced: the step
    that would compile the program again is refused by name, the parameters unchanged."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, factor = _gpt(), [1.0]
    inner = _scaled_loss(model)
    step = fs.train_step(lambda p, b: inner(p, b) * factor[0], fs.optim.adamw(LR),
                         compile=AOT)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    batches = _batches(3, world, 2)
    for x, y in batches[:2]:
        state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2],
                                torch.tensor(1.0)))
    factor[0] = 2.0
    before = {k: v.to_local().clone() for k, v in state.params.items()}
    x, y = batches[2]
    try:
        step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2], torch.tensor(1.0)))
        got = (None, "no error")
    except Exception as e:  # noqa: BLE001 - what it was, for the test
        got = (type(e).__name__, str(e))
    same = all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())
    torch._dynamo.reset()
    return got, same


def test_a_python_value_that_changed_since_the_trace_is_refused_by_name(pools):
    for (kind, msg), same in pools.run(2, python_value_changed, timeout=600):
        assert kind == "RuntimeError" and "would be compiled again" in msg, (kind, msg)
        assert "read from Python changed" in msg and same, msg


def guards_dropped(spec):
    """Two compiled steps with dynamo's guard entries seen as the program's filter sees them:
    (how many, the names it dropped, the names it kept)."""
    from funshard.step import compiled

    if not fs._compat.GUARD_FILTER:
        return None
    seen: list = []
    own = compiled._own_guards

    def spy(entries):
        keep = own(entries)
        seen.append([(e.name, k) for e, k in zip(entries, keep)])
        return keep

    torch._dynamo.reset()
    compiled._own_guards = spy
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = _gpt()
        step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR), compile=AOT)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        for x, y in _batches(3, world, 2):
            state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2],
                                    torch.tensor(1.0)))
    finally:
        compiled._own_guards = own
        torch._dynamo.reset()
    (names,) = seen  # one program, compiled once
    return (len(names), sorted({n for n, k in names if not k}),
            sorted({n for n, k in names if k}))


def test_the_program_keeps_the_guards_on_what_the_caller_owns(pools):
    """dynamo's guards on the program's own constants (layouts, groups, buckets, template:
    fixed when it is made) are dropped; those on ``loss_fn`` and its closure (the model),
    the group modules, the globals and the inputs are kept (a Python value of the caller's
    that changes is still refused: the test above)."""
    for r in pools.run(2, guards_dropped, timeout=600):
        if r is None:
            pytest.skip(f"torch {torch.__version__} has no guard_filter_fn")
        total, dropped, kept = r
        assert 2 * len(dropped) > len(kept), (len(dropped), len(kept), total)
        assert all(n.startswith("program.") for n in dropped), dropped[:5]
        assert not any(n.startswith(("program.loss_fn", "program.blocks", "program.policy"))
                       for n in dropped), dropped[:5]
        assert any(n.startswith("program.loss_fn.__closure__") for n in kept), kept[:5]


def cycles_left(spec, compile, windows=3):
    """What Python's cyclic collector finds in each of ``windows`` windows of 2 steps (after
    2 to warm up): per window, the types of the objects made in it that only the collector
    could free. (Garbage an earlier test's compile left, which torch's weak caches let go of
    as the steps free tensors, was made before: not the step's.)"""
    import gc

    step, state = scaled_step(spec, compile)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(2 + 2 * windows, world, 2)
    rows = slice(rank * 2, (rank + 1) * 2)
    for x, y in batches[:2]:
        state, _ = step(state, (x[rows], y[rows], torch.tensor(1.0)))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = []
    try:
        for w in range(windows):
            before = {id(o) for o in gc.get_objects()}
            for x, y in batches[2 + 2 * w:4 + 2 * w]:
                state, metrics = step(state, (x[rows], y[rows], torch.tensor(1.0)))
            float(metrics["loss"])
            gc.collect()
            found.append({type(o).__qualname__ for o in gc.garbage if id(o) not in before})
            gc.garbage.clear()
            del before
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        torch._dynamo.reset()
    return found


@pytest.mark.parametrize("compile", [False, AOT], ids=["eager", "compiled"])
def test_a_step_leaves_no_reference_cycle(pools, compile):
    """A step's garbage is freed as it goes: a reference cycle made per step would be left
    to Python's cyclic collector, whose collections, step after step, end in a full one over
    every object torch.compile made (half a second on a small GPT)."""
    for windows in pools.run(2, cycles_left, compile):
        assert not any(windows), [sorted(w)[:12] for w in windows]


def reached_by_one(spec, compile, steps=3):
    """A leaf only the first rank's loss reaches (a term of its own): full parameters and
    the leaf's Adam moments' largest entry, after ``steps`` steps."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    model.spare = torch.nn.Linear(16, 4)

    def loss_fn(params, batch):
        x, y = batch
        loss = F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())
        if rank == 0:  # the other ranks give this leaf no gradient
            loss = loss + params["spare.weight"].square().sum()
        return loss

    step = fs.train_step(loss_fn, fs.optim.adamw(LR, weight_decay=0.1), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    for x, y in _batches(steps, world, 2):
        state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    torch._dynamo.reset()
    return full


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_leaf_one_rank_reached_trains_as_the_eager_step(pools, spec):
    """Every rank updates its shard of a leaf some rank reached (the mean over ranks, zeros
    from the others), compiled as eager."""
    for rank, (e, c) in enumerate(zip(pools.run(spec, reached_by_one, False, timeout=600),
                                      pools.run(spec, reached_by_one, AOT, timeout=600))):
        assert not torch.equal(e["spare.weight"], _gpt_spare()), rank  # it trained
        diff = max((c[k] - e[k]).abs().max().item() for k in e)
        assert diff <= 1e-5, (rank, diff)


def _gpt_spare():
    _gpt()
    return torch.nn.Linear(16, 4).weight.detach()

"""``train_step(..., compile=...)`` and ``eval_step(..., compile=...)`` across batch
signatures: sequence lengths that change from step to step (and come back), with and
without ``dynamic=True``; tensors of the same shapes in another memory layout; an epoch's
short last batch; a checkpoint saved mid-run and resumed by a fresh compiled step; a
compiled ``eval_step`` of a Hugging Face Llama on two input shapes and under
``torch.no_grad()``, and on inputs the eager one takes alike (a contiguous copy, a call
under ``torch.inference_mode()``); dict batches carrying Python ints and bools that change
which branch ``loss_fn`` runs. Each trains (or evaluates) as the eager step and as one
process on the whole batch; dynamo's graphs, graph breaks and recompiles are counted
(``aot_eager``: AOTAutograd's graphs run op by op)."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import mesh
from test_compiled_step import CFG, LR, _gpt, _llama, _loss, _max_diff

AOT = {"backend": "aot_eager"}
DYNAMIC = {"backend": "aot_eager", "dynamic": True}
TOL = 1e-5


def _ids(rows, length, g):
    """A (rows, length) token batch: inputs and next-token targets (views of one tensor)."""
    ids = torch.randint(0, CFG["vocab"], (rows, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _counts():
    from torch._dynamo.utils import counters

    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            dict(counters["recompiles"]) if "recompiles" in counters else {})


def _mine(batch, rank, world):
    """This rank's equal share of rows of every tensor leaf (other leaves as they are)."""
    def cut(x):
        if not isinstance(x, torch.Tensor):
            return x
        per = x.shape[0] // world
        return x[rank * per:(rank + 1) * per]
    return fs.pytree.tree_map(cut, batch)


def _run(spec, loss_of, compile, batches, policy=None, state_from=None):
    """AdamW (clip 1.0) on this rank's rows of each of ``batches`` (from the checkpoint at
    ``state_from``, if given): per step the loss and the graphs dynamo made so far; the
    full parameters, the graphs, breaks and recompiles; a step that raised
    ends the run with ("error", step, type, message)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    step = fs.train_step(loss_of(model), fs.optim.adamw(LR, weight_decay=0.1),
                         policy=policy or fs.Policy(clip_norm=1.0), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    if state_from is not None:
        state = fs.checkpoint.load(state_from, like=state)
    losses, graphs, error = [], [], None
    for i, b in enumerate(batches):
        try:
            state, metrics = step(state, _mine(b, rank, world))
        except Exception as e:  # noqa: BLE001 - reported by the test, with its step
            error = ("error", i, type(e).__name__, str(e)[:1500])
            break
        losses.append(float(metrics["loss"]))
        graphs.append(counters["stats"]["unique_graphs"])
    params = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    out = {"losses": losses, "params": params, "graphs": graphs, "error": error,
           "counts": _counts(), "step": state.step}
    torch._dynamo.reset()
    gc.collect()
    return out


def _one_process(loss_of, batches):
    """torch.optim.AdamW with torch's clip on each whole batch: the reference."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_of(model)(dict(model.named_parameters()), b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def _check(rank, got, ref, what):
    """``got`` (a _run's result) trained as ``ref`` (losses, params) within TOL."""
    assert got["error"] is None, (rank, what, got["error"])
    losses, params = ref
    assert len(got["losses"]) == len(losses), (rank, what, got["losses"], losses)
    dl = max(abs(a - b) for a, b in zip(got["losses"], losses))
    dp = _max_diff(got["params"], params)
    assert dl <= TOL and dp <= TOL, (rank, what, dl, dp, got["losses"], losses)


# 1. sequence lengths that change and come back ------------------------------------------

LENGTHS = (8, 6, 8, 6, 4)


def _length_batches(world, lengths=LENGTHS, per_rank=2):
    g = torch.Generator().manual_seed(1)
    return [_ids(world * per_rank, n, g) for n in lengths]


def varying_lengths(spec, compile, lengths):
    batches = _length_batches(dist.get_world_size(), lengths)
    return {"eager": _run(spec, _loss, False, batches),
            "compiled": _run(spec, _loss, compile, batches),
            "one": _one_process(_loss, batches)}


@pytest.mark.parametrize("compile, lengths, graphs", [
    (AOT, LENGTHS, [2, 3, 3, 3, 4]),
    (DYNAMIC, LENGTHS[:3], [2, 3, 3]),  # (dynamic=True compiles more slowly: fewer shapes)
    ({"dynamic": True}, LENGTHS[:3], [2, 3, 3]),  # inductor: the step's pass, symbolic sizes
], ids=["static", "dynamic", "dynamic-inductor"])
def test_lengths_that_change_and_come_back_reuse_their_programs(pools, compile, lengths,
                                                                 graphs):
    """One program per distinct length, made at that length's first (eager) step and
    reused when the length comes back: no recompile, no break, the eager numbers; the same
    under ``dynamic=True`` (each signature still its own program)."""
    for rank, r in enumerate(pools.run(2, varying_lengths, compile, lengths, timeout=600)):
        c = r["compiled"]
        _check(rank, c, (r["eager"]["losses"], r["eager"]["params"]), "eager")
        _check(rank, c, r["one"], "one process")
        made, breaks, recompiles = c["counts"]
        assert c["graphs"] == graphs, (rank, c["graphs"])  # cumulative
        # a program per length, and the update's (the shards' shapes do not change)
        assert made == len(set(lengths)) + 1 and breaks == 0, (rank, made, breaks)
        assert not recompiles, (rank, recompiles)


# 1b. the same shapes in another memory layout ----------------------------------------------

def _strided_batches(world, steps=4, per_rank=2):
    """Batches of one shape: views of a wider tensor (non-contiguous) at even steps,
    contiguous copies at odd ones (as a data loader that sometimes copies gives them)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x, y = _ids(world * per_rank, CFG["seq"], g)
        out.append((x, y) if i % 2 == 0 else (x.contiguous(), y.contiguous()))
    return out


def other_strides(spec):
    batches = _strided_batches(dist.get_world_size())
    return {"eager": _run(spec, _loss, False, batches),
            "compiled": _run(spec, _loss, AOT, batches),
            "one": _one_process(_loss, batches)}


def test_a_contiguous_copy_of_the_same_shapes_trains_as_the_eager_step(pools):
    """A contiguous copy of a batch that came as a view has the batch's shapes in another
    layout, which dynamo guards: it is a signature of its own (its own program, made at its
    first step), and trains as the eager step does, not refused as a recompile."""
    for rank, r in enumerate(pools.run(2, other_strides, timeout=600)):
        c = r["compiled"]
        _check(rank, c, (r["eager"]["losses"], r["eager"]["params"]), "eager")
        _check(rank, c, r["one"], "one process")
        assert c["counts"][1] == 0, (rank, c["counts"])


# 2. an epoch's short last batch -----------------------------------------------------------

def short_last_batch(spec):
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    # three full batches of 4 rows per rank, then the epoch's remainder: 1 row per rank
    batches = [_ids(world * 4, CFG["seq"], g) for _ in range(3)] + [_ids(world, CFG["seq"], g)]
    return {"eager": _run(spec, _loss, False, batches),
            "compiled": _run(spec, _loss, AOT, batches),
            "one": _one_process(_loss, batches)}


def test_an_epochs_short_last_batch_trains_as_the_eager_step(pools):
    for rank, r in enumerate(pools.run(2, short_last_batch, timeout=600)):
        c = r["compiled"]
        _check(rank, c, (r["eager"]["losses"], r["eager"]["params"]), "eager")
        _check(rank, c, r["one"], "one process")
        _, breaks, recompiles = c["counts"]
        assert c["graphs"] == [2, 2, 2, 3] and breaks == 0 and not recompiles, (rank, c)


# 3. a checkpoint mid-run, resumed by a fresh compiled step --------------------------------

def resumed(spec, path, steps=4, at=2):
    world = dist.get_world_size()
    batches = _length_batches(world, (CFG["seq"],) * steps)
    whole = _run(spec, _loss, AOT, batches)
    eager = _run(spec, _loss, False, batches)
    # the first ``at`` steps, then a checkpoint
    rank = dist.get_rank()
    torch._dynamo.reset()
    model = _gpt()
    step = fs.train_step(_loss(model), fs.optim.adamw(LR, weight_decay=0.1),
                         policy=fs.Policy(clip_norm=1.0), compile=AOT)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    first = []
    for b in batches[:at]:
        state, metrics = step(state, _mine(b, rank, world))
        first.append(float(metrics["loss"]))
    fs.checkpoint.save(path, state)
    # a fresh compiled step (a new process would have one) from the checkpoint
    rest = _run(spec, _loss, AOT, batches[at:], state_from=path)
    return {"whole": whole, "eager": eager, "first": first, "rest": rest}


def test_a_checkpoint_resumed_by_a_fresh_compiled_step_trains_as_one_run(pools, tmp_path):
    """Saved after 2 compiled steps, loaded into a fresh compiled step (its first step on
    the batch signature eager again) and trained 2 more: the run that never stopped, bit
    for bit (``aot_eager`` runs torch's ops as the eager step does)."""
    for rank, r in enumerate(pools.run(2, resumed, str(tmp_path / "ckpt"), timeout=600)):
        whole, rest = r["whole"], r["rest"]
        assert whole["error"] is None and rest["error"] is None, (rank, whole, rest)
        assert rest["step"] == whole["step"] == 4, (rank, rest["step"], whole["step"])
        losses = r["first"] + rest["losses"]
        assert losses == whole["losses"], (rank, losses, whole["losses"])
        diff = _max_diff(rest["params"], whole["params"])
        same = all(torch.equal(rest["params"][k], whole["params"][k]) for k in whole["params"])
        assert same, (rank, "not bit-identical", diff)
        _check(rank, rest, (r["eager"]["losses"][2:], r["eager"]["params"]), "eager")


# 4. a compiled eval_step of a Hugging Face Llama ------------------------------------------

def llama_eval(spec):
    """fs.eval_step(compile=) of a Llama's logits and loss on inputs of 8 and 5 tokens, in
    the order 8, 8, 5, 5, 8 and then 8 and 5 again under torch.no_grad(): each against the
    eager eval_step and the model with its full parameters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _llama()
    sp = fs.shard(fs.params(model), mesh(spec))
    g = torch.Generator().manual_seed(3)
    ids = {n: torch.randint(0, CFG["vocab"], (world * 2, n), generator=g) for n in (8, 5)}
    mine = {n: x[rank * 2:(rank + 1) * 2] for n, x in ids.items()}

    def fn(p, x):
        out = fs.call(model, p, input_ids=x, labels=x, use_cache=False)
        return out.logits, out.loss

    compiled, eager = fs.eval_step(fn, compile=AOT), fs.eval_step(fn)
    order = (8, 8, 5, 5, 8)
    outs = [(n, compiled(sp, mine[n])) for n in order]
    with torch.no_grad():
        outs += [(n, compiled(sp, mine[n])) for n in (8, 5)]
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    recompiles = dict(counters["recompiles"]) if "recompiles" in counters else {}
    ref = {n: eager(sp, mine[n]) for n in (8, 5)}
    full, one = _llama(), {}
    with torch.no_grad():
        for n in (8, 5):
            o = full(input_ids=mine[n], labels=mine[n], use_cache=False)
            one[n] = o.logits, o.loss
    diff = lambda a, b: max((a[0] - b[0]).abs().max().item(),  # noqa: E731
                            (a[1] - b[1]).abs().max().item())
    out = {"eager": [diff(o, ref[n]) for n, o in outs],
           "one": [diff(o, one[n]) for n, o in outs],
           "grad": any(t.requires_grad for _, o in outs for t in o),
           "graphs": graphs, "breaks": breaks, "recompiles": recompiles}
    torch._dynamo.reset()
    gc.collect()
    return out


def test_a_compiled_llama_eval_step_on_two_shapes_equals_the_eager_one(pools):
    pytest.importorskip("transformers")
    for rank, r in enumerate(pools.run(2, llama_eval, timeout=600)):
        assert max(r["eager"]) <= 1e-6 and max(r["one"]) <= TOL, (rank, r)
        assert not r["grad"], (rank, r)
        assert r["graphs"] == 2 and r["breaks"] == 0 and not r["recompiles"], (rank, r)


def eval_inputs(spec):
    """A compiled eval_step of the GPT, its program made on a view (strides (9, 1)), then
    given inputs the eager eval_step takes alike: a contiguous copy (the same shapes), and
    the same view under torch.inference_mode(). Per case the largest difference from the
    eager eval_step, or the error."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    sp = fs.shard(fs.params(model), mesh(spec))
    x = _ids(world * 2, CFG["seq"], torch.Generator().manual_seed(5))[0]
    x = x[rank * 2:(rank + 1) * 2]
    fn = lambda p, x: fs.call(model, p, x)  # noqa: E731
    compiled, eager = fs.eval_step(fn, compile=AOT), fs.eval_step(fn)
    ref = eager(sp, x)
    out = {"view": [(compiled(sp, x) - ref).abs().max().item() for _ in range(2)]}
    for name in ("contiguous", "inference_mode"):
        arg = x.contiguous() if name == "contiguous" else x
        for kind, evaluate in (("eager", eager), ("compiled", compiled)):
            try:
                with torch.inference_mode(name == "inference_mode"):
                    out[f"{kind} {name}"] = (evaluate(sp, arg) - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - reported by the test
                out[f"{kind} {name}"] = (type(e).__name__, str(e)[:600])
    torch._dynamo.reset()
    return out


def test_a_compiled_eval_step_takes_what_the_eager_one_takes(pools):
    """Inputs of the program's shapes in another layout, and a call under
    torch.inference_mode() (eval_step computes without gradients anyway), evaluate as the
    eager eval_step does rather than being refused as a recompile."""
    for rank, r in enumerate(pools.run(2, eval_inputs, timeout=600)):
        assert max(r["view"]) <= 1e-6, (rank, r)
        bad = {name: got for name, got in r.items()
               if name != "view" and (not isinstance(got, float) or got > 1e-6)}
        assert not bad, (rank, bad)


# 5. dict batches with Python ints and bools -----------------------------------------------

def _dict_loss(model):
    """A dict batch: ``smooth`` (a bool) picks label smoothing, ``k`` (an int) scales the
    loss, ``shift`` (an int) drops the first ``shift`` positions."""
    def loss_fn(params, batch):
        s = batch["shift"]
        logits = fs.call(model, params, batch["input_ids"])[:, s:].flatten(0, 1)
        labels = batch["labels"][:, s:].flatten()
        if batch["smooth"]:
            loss = F.cross_entropy(logits, labels, label_smoothing=0.2)
        else:
            loss = F.cross_entropy(logits, labels)
        return loss * batch["k"]
    return loss_fn


FLAGS = ((False, 1, 0), (True, 1, 0), (False, 1, 0), (True, 2, 0), (True, 2, 3),
         (False, 1, 0), (True, 2, 3))


def flagged(spec):
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(4)
    batches = []
    for smooth, k, shift in FLAGS:
        x, y = _ids(world * 2, CFG["seq"], g)
        batches.append({"input_ids": x, "labels": y, "smooth": smooth, "k": k, "shift": shift})
    return {"eager": _run(spec, _dict_loss, False, batches),
            "compiled": _run(spec, _dict_loss, AOT, batches),
            "one": _one_process(_dict_loss, batches)}


def test_a_flag_in_a_dict_batch_that_changes_gives_its_own_program(pools):
    """The signature holds the batch's Python leaves: each (smooth, k, shift) has its own
    program (made at its first, eager step), never another's reused."""
    distinct = len(set(FLAGS))
    for rank, r in enumerate(pools.run(2, flagged, timeout=600)):
        c = r["compiled"]
        _check(rank, c, (r["eager"]["losses"], r["eager"]["params"]), "eager")
        _check(rank, c, r["one"], "one process")
        graphs, breaks, recompiles = c["counts"]
        assert graphs == distinct + 1 and breaks == 0 and not recompiles, (rank, c["counts"])

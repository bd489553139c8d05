"""The demo training run: ``bash scripts/demo.sh`` (or ``python examples/gpt/train.py``).

Trains a small byte-level GPT (:class:`funshard.testing.models.GPT`: token embedding,
pre-norm blocks, tied head) on the text corpus in ``data/`` beside this file. Without a
launcher it starts ``--nproc`` local processes itself with torch's elastic launcher (gloo on
CPU) on a ``--mesh`` replicate x shard mesh (default 4 processes, 2x2). Under ``torchrun`` it
uses the environment (NCCL on GPUs) and the mesh given by ``--mesh``. Rank 0 shows progress,
writes metrics (JSON lines), a plot (train and validation loss, learning rate, gradient norm,
tokens/s), checkpoints and a text sample under ``--out``. A used ``--out`` needs ``--resume``
(continue from its latest checkpoint; the metrics after it are logged again, once) or
``--force`` (delete it and start over).

    bash scripts/demo.sh                                    # 4 local CPU processes, 2x2 mesh
    python examples/gpt/train.py --nproc 2 --mesh 1x2 --steps 50
    torchrun --nproc-per-node 8 examples/gpt/train.py --mesh 2x4 --dim 512 --layers 12

The flags are in ``flags.py``, the data in ``corpus.py``, what rank 0 shows and writes in
``report.py`` (siblings of this file, imported by name: the script's folder is on sys.path).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import CountCollectives, free_port, under_torchrun
from funshard.testing.models import GPT, gpt_loss

from corpus import get_batch, load_corpus
from flags import (OUTPUTS, UsageError, build_parser, ckpt_dir_of, device_of, parse_mesh,
                   restarted, validate)
from report import peak_rss_mb, plot, print_summary, progress


class Run(NamedTuple):
    """One rank's training run, as :func:`setup` builds it."""

    args: argparse.Namespace
    world: int
    rank: int
    mesh: str  # "RxS": replicate x shard
    device: torch.device
    model: torch.nn.Module
    step_fn: fs.TrainStep
    forward: fs.EvalStep  # EVALUATION: (params, idx) -> logits, one group at a time
    lr: Callable[[int], float]
    out: Path
    ckpt_dir: Path
    restarted: bool  # a torch elastic restart after a failure


def train(args: argparse.Namespace) -> dict:
    """One rank's training run (the process group comes from the environment)."""
    run, state, resumed_from = setup(args)
    data = load_corpus(args.corpus)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    state, log = run_steps(run, state, train_data, val_data)
    return finish(run, state, log, val_data, resumed_from)


def setup(args: argparse.Namespace) -> tuple[Run, fs.TrainState, tuple | None]:
    """The mesh, the model, the step and its state (from the latest checkpoint on --resume or
    after a restart); ``resumed_from`` is ``(path, step)`` or None."""
    device_type = device_of(args)
    if device_type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    world = int(os.environ["WORLD_SIZE"])
    rep, sh = parse_mesh(args.mesh, world, args.policy)
    mesh = fs.make_mesh(shard=sh, replicate=rep, device_type=device_type)
    rank = dist.get_rank()
    if rank == 0 and args.force and not restarted():
        _clear(args)  # before the step's first collective: no rank has written yet
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    torch.manual_seed(args.seed)
    model = GPT(vocab=256, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
    model.to(device)
    lr = schedule(args)
    step_fn = fs.train_step(gpt_loss(model), fs.optim.adamw(lr, weight_decay=0.1),
                            policy=policy_of(args))
    state = step_fn.init(fs.shard(fs.params(model), mesh))
    forward = fs.eval_step(lambda p, idx: torch.func.functional_call(model, p, (idx,)),
                           policy=policy_of(args))
    run = Run(args, world, rank, f"{rep}x{sh}", device, model, step_fn, forward, lr,
              Path(args.out), ckpt_dir_of(args), restarted())
    if rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
    resumed_from = None
    if args.resume or (run.restarted and fs.checkpoint.latest(run.ckpt_dir) is not None):
        path = fs.checkpoint.latest(run.ckpt_dir)
        state = fs.checkpoint.load(path, like=state)
        resumed_from = (str(path), state.step)
    if rank == 0:
        _trim_metrics(run.out / "metrics.jsonl", state.step)
    return run, state, resumed_from


def _clear(args: argparse.Namespace) -> None:
    """``--force``: delete what an earlier run wrote (only the files a run writes)."""
    for name in OUTPUTS:
        (Path(args.out) / name).unlink(missing_ok=True)
    shutil.rmtree(ckpt_dir_of(args), ignore_errors=True)


def _trim_metrics(path: Path, step: int) -> None:
    """Keep the records up to ``step`` (where this run starts): steps after the checkpoint
    that a resumed or restarted run computes again are logged once, by this run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def policy_of(args: argparse.Namespace) -> fs.Policy:
    """``--policy``, ``--mixed-precision`` (bf16 compute, fp32 reduce), ``--accumulate``,
    ``--clip`` as a :class:`funshard.Policy`."""
    return fs.Policy(
        reshard_after_forward=args.policy == "full",
        param_dtype=torch.bfloat16 if args.mixed_precision else None,
        reduce_dtype=torch.float32 if args.mixed_precision else None,
        accumulate=args.accumulate,
        clip_norm=args.clip or None,
    )


def schedule(args: argparse.Namespace) -> Callable[[int], float]:
    """Learning rate by step: linear warm-up over ``--warmup`` steps (at most half of
    ``--steps``), then cosine decay from ``--lr`` to a tenth of it."""
    warmup = max(1, min(args.warmup, args.steps // 2))

    def lr(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    return lr


def run_steps(run: Run, state: fs.TrainState, data: torch.Tensor,
              val_data: torch.Tensor) -> tuple[fs.TrainState, dict]:
    """Train up to ``--steps``: rank 0 logs every step, one steady-state step's collectives are
    counted, a validation loss every ``--eval-every`` steps, a checkpoint every
    ``--ckpt-every`` steps. ``--fail-at-step`` kills the last rank (first attempt only)."""
    args, rank = run.args, run.rank
    dp_rank = rank  # every rank is a data-parallel rank (HSDP: replicate x shard)
    tokens_per_step = args.batch * args.seq * run.world
    metrics_file = open(run.out / "metrics.jsonl", "a") if rank == 0 else None
    bar = progress(args.steps, state.step) if rank == 0 and not args.no_progress else None
    log = {"losses": [], "collectives": None, "first_step": state.step,
           "tokens_per_step": tokens_per_step}
    t_start = time.perf_counter()
    while state.step < args.steps:
        if args.fail_at_step == state.step and not run.restarted and rank == run.world - 1:
            os.kill(os.getpid(), 9)  # a crash: no clean-up, no exception
        x, y = get_batch(data, state.step, dp_rank, args.batch, args.seq, args.seed)
        t0 = time.perf_counter()
        # count one steady-state step's collectives
        if log["collectives"] is None and state.step > log["first_step"]:
            with CountCollectives() as cc:
                state, m = run.step_fn(state, (x.to(run.device), y.to(run.device)))
            log["collectives"] = dict(cc.counts)
        else:
            state, m = run.step_fn(state, (x.to(run.device), y.to(run.device)))
        dt = time.perf_counter() - t0
        log["losses"].append(m["loss"])
        if args.eval_every and state.step % args.eval_every == 0:
            m = {**m, "val_loss": evaluate(run, state, val_data)}
        if rank == 0:
            _record(run, state.step, m, dt, tokens_per_step, metrics_file, bar)
        if args.ckpt_every and (state.step % args.ckpt_every == 0 or state.step == args.steps):
            fs.checkpoint.save(run.ckpt_dir / f"step_{state.step:06d}", state)
            if rank == 0:
                fs.checkpoint.prune(run.ckpt_dir, keep=args.keep)
    if bar is not None:
        bar.close()
    log["wall"] = time.perf_counter() - t_start
    if metrics_file is not None:
        metrics_file.close()
    return state, log


def _record(run: Run, step: int, m: dict, dt: float, tokens_per_step: int, metrics_file,
            bar) -> None:
    """Rank 0: one JSON line of the step's metrics, and the progress bar."""
    rec = {"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"],
           "lr": run.lr(step - 1), "step_s": dt, "tokens_per_s": tokens_per_step / dt,
           "peak_mem_mb": peak_rss_mb(run.device), "world": run.world, "mesh": run.mesh}
    if "val_loss" in m:
        rec["val_loss"] = m["val_loss"]
    metrics_file.write(json.dumps(rec) + "\n")
    metrics_file.flush()
    if bar is not None:
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                        mem=f"{rec['peak_mem_mb']:.0f}MB")
        bar.update(1)


def finish(run: Run, state: fs.TrainState, log: dict, val_data: torch.Tensor,
           resumed_from: tuple | None) -> dict:
    """Validation loss, a text sample, every rank's peak memory; rank 0 writes and prints."""
    args = run.args
    steps_run = state.step - log["first_step"]
    val = evaluate(run, state, val_data)
    sample = _sample(run, state)
    peaks = [None] * run.world
    dist.all_gather_object(peaks, peak_rss_mb(run.device))
    losses = log["losses"]
    summary = {
        "final_loss": losses[-1] if losses else None,
        "val_loss": val,
        "steps": state.step,
        "steps_this_run": steps_run,
        "tokens_per_s": log["tokens_per_step"] * steps_run / log["wall"] if steps_run else None,
        "wall_s": log["wall"],
        "peak_mem_mb_per_rank": [round(p, 1) for p in peaks],
        "collectives_per_step": log["collectives"],
        "world": run.world,
        "mesh": run.mesh,
        "policy": args.policy,
        "resumed_from": resumed_from,
    }
    if run.rank == 0:
        (run.out / "sample.txt").write_text(sample)
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(run.out / "metrics.jsonl", run.out / "loss.png")
        print_summary(summary, sample, run.out)
    return summary


VAL_SEQS = 32  # validation sequences, the same set on every world size


def evaluate(run: Run, state: fs.TrainState, data: torch.Tensor) -> float:
    """EVALUATION: mean next-byte loss over ``VAL_SEQS`` fixed sequences of the held-out text,
    through ``fs.eval_step`` (one group gathered at a time, no gradients); each rank computes
    its share and one all-reduce sums them (the same number on every world size)."""
    args = run.args
    x, y = get_batch(data, 0, 0, VAL_SEQS, args.seq, args.seed + 1)  # (VAL_SEQS, seq) each
    x, y = x.tensor_split(run.world)[run.rank], y.tensor_split(run.world)[run.rank]
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    logits = run.forward(state.params, x.to(run.device))  # every rank gathers, even with no rows
    if len(x):
        total[0] = F.cross_entropy(logits.flatten(0, 1).float(), y.to(run.device).flatten(),
                                   reduction="sum")
        total[1] = y.numel()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _sample(run: Run, state: fs.TrainState) -> str:
    """EVALUATION: sampling (temperature 0.8) from the trained model, the same on every rank:
    one ``fs.eval_step`` call runs the whole loop, each forward gathering one group at a
    time."""
    args, model, device = run.args, run.model, run.device

    def generate(params, idx):
        g = torch.Generator().manual_seed(args.seed)
        for _ in range(args.sample):
            logits = torch.func.functional_call(model, params, (idx[:, -args.seq:],))
            probs = torch.softmax(logits[0, -1].float().cpu() / 0.8, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=g).to(device)
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
        return idx

    start = torch.tensor([list(b"And ")], device=device)
    idx = fs.eval_step(generate, policy=policy_of(args))(state.params, start)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- launching ---------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> dict:
    """Entry point of each launched process. An exception ends it with exit code 1 and no
    traceback: it is written for the launching process (``FUNSHARD_ERRORS``), or, under
    torchrun, printed once by the rank that caused it (not by the ranks it stopped)."""
    try:
        out = train(args)
    except Exception as e:  # noqa: BLE001 - reported once, below
        _report(e)
        raise SystemExit(1) from None
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


# Errors that only say another rank failed or left: the cause is elsewhere.
_CONSEQUENCES = ("RankFailed", "PeerLost", "CollectiveTimeout")


def _report(e: BaseException) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    rec = {"rank": rank, "at": time.time(), "type": type(e).__name__, "message": str(e),
           "cause": (f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else None)}
    where = os.environ.get("FUNSHARD_ERRORS")
    if where:
        with open(os.path.join(where, f"rank_{rank}.json"), "w") as f:
            json.dump(rec, f)
    elif rec["type"] not in _CONSEQUENCES:
        print(_one_error(rec), file=sys.stderr, flush=True)


def _one_error(rec: dict) -> str:
    text = f"funshard train: rank {rec['rank']} failed: {rec['type']}: {rec['message']}"
    return text + (f"\n  caused by {rec['cause']}" if rec.get("cause") else "")


def _first_failure(where: str, failures: dict) -> str:
    """The launched run's cause, in one message: the earliest error that is not another
    rank's consequence; else a rank killed by a signal; else the earliest error."""
    recs = []
    for name in os.listdir(where):
        with open(os.path.join(where, name)) as f:
            recs.append(json.load(f))
    recs.sort(key=lambda r: r["at"])
    roots = [r for r in recs if r["type"] not in _CONSEQUENCES]
    if roots:
        return _one_error(roots[0])
    killed = sorted((r, f.exitcode) for r, f in failures.items() if f.exitcode < 0)
    if killed:
        r, code = killed[0]
        return (f"funshard train: rank {r} died: killed by signal {-code} "
                f"({signal.Signals(-code).name}); the other ranks stopped because of it")
    if recs:
        return _one_error(recs[0])
    r, f = min(failures.items())
    return f"funshard train: rank {r} failed with exit code {f.exitcode}"


def launch_local(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` processes with torch's elastic launcher (gloo on CPU). A failed
    run prints its first failing rank's error once (not the launcher's report) and returns 1."""
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc,
        run_id=f"funshard-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=args.max_restarts,
        monitor_interval=0.5, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    where = tempfile.mkdtemp(prefix="funshard-errors-")
    os.environ["FUNSHARD_ERRORS"] = where  # the spawned ranks inherit it
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [q.level for q in quiet]
    for q in quiet:  # their report of a failure is replaced by ours
        q.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, _worker)(args)
    except ChildFailedError as e:
        print(_first_failure(where, e.failures), file=sys.stderr, flush=True)
        return 1
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
        os.environ.pop("FUNSHARD_ERRORS", None)
        shutil.rmtree(where, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    under_launcher = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else args.nproc
    try:
        validate(args, world)
        if under_launcher:
            try:
                _worker(args)
            except SystemExit as e:  # the error was printed once, by the rank that caused it
                return int(e.code or 0)
            return 0
        return launch_local(args)
    except UsageError as e:
        print(f"funshard train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

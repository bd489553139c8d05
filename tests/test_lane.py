"""The device lane: the step under every Policy option, mixed precision against FSDP2, the
functions, checkpoints across devices, the demo and the benchmark, on the lane's device.

CI runs it on the CPU; ``bash scripts/test.sh --device cuda`` runs it on GPUs (NCCL). A world
of one runs every collective it would skip (``collectives.force_collectives``), so one GPU goes
through the all-gathers, reduce-scatters and all-reduces that many GPUs do; a spec needing
more devices than the machine has skips, saying so.
"""

import contextlib
import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard import collectives
from funshard.testing import DEVICE, CountCollectives, device, devices_for, mesh
from funshard.testing.models import GPT, gpt_loss
from conftest import fsdp2_twin, torch_step

pytestmark = pytest.mark.lane
ROOT = Path(__file__).resolve().parent.parent
SPECS = [1, 2]
# float32 on the CPU repeats one process's ops; CUDA kernels may sum in another order
TOL = 1e-5 if DEVICE == "cpu" else 1e-4

POLICIES = {
    "full": {},
    "grad_op": {"reshard_after_forward": False},
    "accumulate_clip": {"accumulate": 2, "clip_norm": 0.5},
    "no_prefetch": {"prefetch": False},
    "c10d": {"transport": "c10d"},
    "checkpoint": {"checkpoint": True},
    "skip_nonfinite": {"skip_nonfinite": True},
    "fused_adamw": {"_fused": True},  # fs.optim.adamw(fused=True) vs torch's, same device
    # torch.compile(loss_fn): inductor (Triton kernels) on GPUs; aot_eager on the CPU, where
    # inductor would compile C++ for minutes (tests/test_compile.py covers the CPU)
    "compile": {"_compile": True},
    # train_step(compile=...): the whole step as one program (the same backends)
    "compiled_step": {"_program": True},
    # its update under skip_nonfinite: scalars both ways, the device picks (none skipped)
    "compiled_step_skip": {"_program": True, "skip_nonfinite": True},
    # and with CUDA graphs: recorded at its third step, replayed from the fourth
    "compiled_step_cudagraphs": {"_program": "reduce-overhead"},
    # a replay per micro-batch: the first's outputs are summed after the second's
    "compiled_step_cudagraphs_accumulate": {"_program": "reduce-overhead", "accumulate": 2,
                                            "clip_norm": 0.5},
}
COMPILE_BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def forced(world: int, on: bool = True):
    """A world of one runs its collectives (``on``) or skips them, whatever the lane's
    FUNSHARD_FORCE_COLLECTIVES says; a bigger one has them anyway."""
    return collectives.force_collectives(on) if world == 1 else contextlib.nullcontext()


def _gpt(dev):
    torch.manual_seed(0)
    return GPT(vocab=37, dim=16, heads=2, layers=2, seq=8).to(dev)


def _batch(g, world, dev):
    return tuple(torch.randint(0, 37, (world * 2, 8), generator=g).to(dev) for _ in range(2))


def _local(b, rank):
    return tuple(x[rank * 2:(rank + 1) * 2] for x in b)


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")


def step_equals_one_process(spec, policy, force=True):
    """Two AdamW steps on the mesh against torch's AdamW on one process over the whole batch
    (same device); the collectives of the last step; where the results live. ``force``:
    a world of one runs its collectives (else it gathers nothing, as one device does)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    policy = dict(policy)
    fused = policy.pop("_fused", False)
    compiled = policy.pop("_compile", False)
    program = policy.pop("_program", False)
    with forced(world, force):
        model = _gpt(dev)
        ref = copy.deepcopy(model)
        loss_fn = _with_aux(gpt_loss(model))
        if compiled:
            torch._dynamo.reset()
            loss_fn = torch.compile(loss_fn, backend=COMPILE_BACKEND)
        if program:
            torch._dynamo.reset()
        mode = {"mode": program} if isinstance(program, str) else {}
        step = fs.train_step(loss_fn, fs.optim.adamw(1e-2, weight_decay=0.1, fused=fused),
                             policy=fs.Policy(**policy),
                             compile={"backend": COMPILE_BACKEND, **mode} if program else False)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1,
                                **({"fused": True} if fused else {"foreach": True}))
        g = torch.Generator().manual_seed(1)
        errors = _Errors()  # what torch logs as an error while it compiles the program
        logging.getLogger("torch._dynamo").addHandler(errors)
        first = None
        for _ in range(5 if mode else 2):
            b = _batch(g, world, dev)
            # a dispatch mode (the counter) would make dynamo run loss_fn eagerly
            quiet = compiled or program
            with contextlib.nullcontext(None) if quiet else CountCollectives() as cc:
                state, metrics = step(state, _local(b, rank))
            loss = F.cross_entropy(ref(b[0]).flatten(0, 1), b[1].flatten())
            # read after the last step
            first = first or (metrics, loss.item(), _local(b, rank)[0].double().sum().item())
            opt.zero_grad()
            loss.backward()
            if "clip_norm" in policy:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), policy["clip_norm"])
            opt.step()
        logging.getLogger("torch._dynamo").removeHandler(errors)
        assert not errors.records, errors.records[:2]
        full = fs.unshard(state.params)
        err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        where = {t.device.type for t in fs.pytree.leaves(state) if isinstance(t, torch.Tensor)}
        if compiled or program:  # dynamo captured graphs: the compute ran compiled
            from torch._dynamo.utils import counters
            assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
        # the first step's metrics read last: its loss, and its aux as loss_fn returned it
        aux = first[0]["aux"]  # a list of the micro-batches' under accumulate
        tokens = sum(float(a["tokens"]) for a in (aux if isinstance(aux, list) else [aux]))
        late = abs(first[0]["loss"] - first[1]) + abs(tokens - first[2])
        return err, max(abs(metrics["loss"] - loss.item()), late), cc and dict(cc.counts), where


def _with_aux(loss_fn):
    """``loss_fn`` that also returns an aux tensor (the sum of this rank's token ids)."""

    def fn(params, batch):
        return loss_fn(params, batch), {"tokens": batch[0].double().sum()}

    return fn


def _cuda_graphs_on_a_gpu(policy):
    if policy.startswith("compiled_step_cudagraphs") and DEVICE != "cuda":
        pytest.skip("CUDA graphs are a GPU's; tests/test_compiled_rules.py runs the mode on "
                    "the CPU")


@pytest.mark.parametrize("policy", list(POLICIES), ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_step_equals_one_process(pools, spec, policy):
    _cuda_graphs_on_a_gpu(policy)
    for rank, (err, loss_err, counts, where) in enumerate(
            pools.run(spec, step_equals_one_process, POLICIES[policy])):
        assert err < TOL and loss_err < TOL, (rank, err, loss_err)
        assert where == {DEVICE}, where
        if counts is None:  # compiled: not counted (see step_equals_one_process)
            continue
        # the collective paths ran, on one rank too
        assert counts.get("all_gather", 0) > 0 and counts.get("reduce_scatter", 0) > 0, counts
        assert counts.get("all_reduce", 0) >= 1, counts  # the step's metrics


@pytest.mark.parametrize("policy", ["full", "accumulate_clip", "checkpoint", "fused_adamw",
                                    "compile", "compiled_step", "compiled_step_cudagraphs"])
def test_one_device_as_a_user_runs_it(pools, policy):
    """A world of one with its collectives not forced, as on a single GPU: nothing to gather,
    the parameters are autograd leaves on the shards (Group.alias), no collective runs."""
    _cuda_graphs_on_a_gpu(policy)
    err, loss_err, counts, where = pools.run(1, step_equals_one_process, POLICIES[policy],
                                             False)[0]
    assert err < TOL and loss_err < TOL, (err, loss_err)
    assert where == {DEVICE}, where
    assert counts == {} or (counts is None and policy.startswith("compile")), counts


def function_module_on_device(spec, raf):
    """A custom autograd Function first to touch its block's weight, the block entered
    through fs.call (its group gathered on entry), against one process on the lane's
    device: two AdamW steps; a world of one runs its collectives."""
    from test_module_entry import FunctionNet

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    with forced(world):
        model = FunctionNet().to(dev)
        ref = copy.deepcopy(model)
        step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                             fs.optim.adamw(1e-2), policy=fs.Policy(reshard_after_forward=raf))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = (torch.randn(world * 2, n, generator=g).to(dev) for n in (4, 3))
            state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            opt.step()
        full = fs.unshard(state.params)
        return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_custom_function_in_a_group_module_on_device(pools, spec, raf):
    for err in pools.run(spec, function_module_on_device, raf):
        assert err < TOL, err


# the optimizers whose update the device gates: fs.optim's AdamW, and torch's AdamW through
# from_torch (fused: its kernel takes the step's verdict as found_inf; foreach: its step as
# funshard's gated ops, its bias corrections from the counts the host keeps; RMSprop with
# select=True: torch's own step, selected on the device)
GATED = {"adamw": lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
         "torch_fused": lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-2,
                                                    weight_decay=0.1, fused=True),
         "torch_foreach": lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-2,
                                                      weight_decay=0.1),
         "torch_rmsprop": lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=1e-2,
                                                      momentum=0.5, select=True)}


def syncs_in_a_step(spec, policy, optimizer="adamw"):
    """An eager AdamW step on the lane's device after three (the schedule learned, the
    metrics read), under ``torch.cuda.set_sync_debug_mode("error")``: a host wait for the
    device raises there. Then the caller's read of its loss."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    with forced(world):
        model = _gpt(dev)
        step = fs.train_step(gpt_loss(model), GATED[optimizer](), policy=fs.Policy(**policy))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            state, metrics = step(state, _local(_batch(g, world, dev), rank))
            float(metrics["loss"])
        batch = _local(_batch(g, world, dev), rank)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            state, metrics = step(state, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return float(metrics["loss"])


@pytest.mark.parametrize("optimizer", list(GATED))
@pytest.mark.parametrize("policy", [{}, {"clip_norm": 0.5, "accumulate": 2},
                                    {"skip_nonfinite": True}], ids=["full", "clip", "skip"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_an_eager_step_never_waits_for_the_device(pools, spec, policy, optimizer):
    """The eager step with adamw (fs.optim's, or torch's through from_torch) makes
    no host wait for the GPU (its metrics and checks stay on the device, the update is
    gated there), with a clip, accumulation and the non-finite skip."""
    if DEVICE != "cuda":
        pytest.skip("a CPU has no device to wait for: tests/test_device.py counts the host "
                    "reads the step makes on the CPU")
    for loss in pools.run(spec, syncs_in_a_step, policy, optimizer):
        assert loss == loss, loss


def overlap_on_device(spec):
    """The compiled step's program (inductor) on the lane's device, a world of one with
    every collective forced: per collective, the compute kernels between its issue and its
    wait; and the number of groups."""
    from torch._inductor.utils import run_and_get_code

    from test_compiled_step import windows

    dev = device()
    with forced(1):
        torch._dynamo.reset()
        model = _gpt(dev)
        step = fs.train_step(gpt_loss(model), fs.optim.adamw(1e-2), compile=True)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        batch = _local(_batch(torch.Generator().manual_seed(1), 1, dev), 0)
        (state, _), codes = run_and_get_code(step, state, batch)
        torch._dynamo.reset()
    return windows(codes[0]), len(fs.list_groups(fs.params(model)))


def test_compiled_collectives_overlap_compute_on_device(pools):
    """On the lane's device too (Triton kernels, NCCL), the program issues each forward
    gather while the group before it computes and waits on each reduce-scatter after the
    next group's backward."""
    if DEVICE != "cuda":
        pytest.skip("inductor's C++ kernels on the CPU: tests/test_compiled_features.py "
                    "checks the same order there (the reductions' asked for on the CPU)")
    runs, groups = pools.run(1, overlap_on_device, timeout=900)[0]
    ahead = [n > 0 for k, n in runs if k == "all_gather_into_tensor"]
    later = [n > 0 for k, n in runs if k == "reduce_scatter_tensor"]
    assert sum(ahead) >= groups - 2 and sum(later) >= groups - 2, runs


def mixed_precision_vs_fsdp2(spec):
    """bf16 compute, fp32 reduce and masters: funshard against FSDP2 ``fully_shard`` with
    ``MixedPrecisionPolicy`` (per block and the root), the same batches: losses and params."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    with forced(world):
        m = mesh(spec)
        model = _gpt(dev)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        theirs = fsdp2_twin(model, m, mp_policy=mp)
        topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=True)
        step = fs.train_step(gpt_loss(model), fs.optim.adamw(1e-2),
                             policy=fs.Policy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32))
        state = step.init(fs.shard(fs.params(model), m))
        g = torch.Generator().manual_seed(1)
        ours, fsdp = [], []
        for _ in range(3):
            x, y = _local(_batch(g, world, dev), rank)
            with CountCollectives() as cc:
                state, metrics = step(state, (x, y))
            ours.append(metrics["loss"])
            loss = F.cross_entropy(theirs(x).flatten(0, 1).float(), y.flatten())
            fsdp.append(torch_step(topt, loss))
        full = fs.unshard(state.params)
        sd = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        err = max((full[k] - sd[k]).abs().max().item() for k in full)
        dtypes = {str(v.dtype) for v in fs.pytree.leaves(state) if isinstance(v, torch.Tensor)}
        return ours, fsdp, err, dtypes, cc.bytes.get("all_gather", 0)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_mixed_precision_matches_fsdp2(pools, spec):
    for ours, fsdp, err, dtypes, gathered in pools.run(spec, mixed_precision_vs_fsdp2):
        assert max(abs(a - b) / abs(b) for a, b in zip(ours, fsdp)) < 1e-3, (ours, fsdp)
        assert err < 1e-3, err
        assert dtypes == {"torch.float32"}, dtypes  # masters and optimizer state
        assert gathered > 0


def functions_on_device(spec):
    """shard / unshard / reshard / reduce_grads / state_dict round trips on the device."""
    world, dev = dist.get_world_size(), device()
    with forced(world):
        m = mesh(spec)
        g = torch.Generator().manual_seed(3)
        params = {"w": torch.randn(7, 3, generator=g).to(dev),
                  "b": torch.randn(5, generator=g).to(dev),
                  "e": torch.randn(2, 4, 3, generator=g).to(dev)}
        sp = fs.shard(params, m)
        full = fs.unshard(sp)
        back = fs.reshard(full, like=sp)
        grads = fs.reduce_grads({k: torch.full_like(v, 2.0) for k, v in params.items()},
                                like=sp)
        sd = fs.load_state_dict(fs.state_dict(sp, kind="sharded"), like=sp)
        same = (all(torch.equal(full[k], params[k]) for k in params)
                and all(torch.equal(fs.unshard(t)[k], params[k]) for t in (back, sd)
                        for k in params)
                and all(bool((fs.unshard(grads)[k] == 2.0).all()) for k in params))
        where = {t.device.type for tree in (sp, full, back, grads, sd)
                 for t in fs.pytree.leaves(tree)}
        return same, where


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_functions_on_device(pools, spec):
    for same, where in pools.run(spec, functions_on_device):
        assert same and where == {DEVICE}, (same, where)


def checkpoint_across_devices(spec, path):
    """A checkpoint saved from the lane's device (synchronously and asynchronously) loads on
    the CPU, and one saved there loads back on the device: the same values every way."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    with forced(world):
        states = {}
        for where, d, m in (("device", dev, mesh(spec)),
                            ("cpu", torch.device("cpu"), fs.make_mesh(device_type="cpu"))):
            model = _gpt(d)
            step = fs.train_step(gpt_loss(model), fs.optim.adamw(1e-2))
            state = step.init(fs.shard(fs.params(model), m))
            if where == "device":
                g = torch.Generator().manual_seed(1)
                state, _ = step(state, _local(_batch(g, world, d), rank))
            states[where] = state
        fs.checkpoint.save(path + "/a", states["device"])
        on_cpu = fs.checkpoint.load(path + "/a", like=states["cpu"])
        # an asynchronous save stages the device's tensors on the host first (pinned, from
        # a GPU), and leaves them there: no second copy of the state on the device
        from funshard.checkpoint import saving
        stage, snaps = saving._stage, []
        saving._stage = lambda v, devices: snaps.append(stage(v, devices)) or snaps[-1]
        try:
            fs.checkpoint.save(path + "/c", states["device"], async_save=True).result()
        finally:
            saving._stage = stage
        snaps = [getattr(t, "_local_tensor", t) for t in snaps if isinstance(t, torch.Tensor)]
        host = {(t.device.type, t.is_pinned() or dev.type == "cpu") for t in snaps}
        staged = fs.checkpoint.load(path + "/c", like=states["cpu"])
        fs.checkpoint.save(path + "/b", on_cpu)
        again = fs.checkpoint.load(path + "/b", like=states["device"])

        def local(tree):
            return [t.to_local().cpu() for t in fs.pytree.leaves(tree)
                    if isinstance(t, torch.Tensor)]

        same = all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d) for a, b, c, d
                   in zip(local(states["device"]), local(on_cpu), local(again), local(staged)))
        kinds = tuple({t.device.type for t in fs.pytree.leaves(tree) if isinstance(t, torch.Tensor)}
                      for tree in (on_cpu, again))
        return same, kinds, host


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_checkpoint_across_devices(pools, spec, tmp_path):
    for same, kinds, host in pools.run(spec, checkpoint_across_devices, str(tmp_path)):
        assert same and kinds == ({"cpu"}, {DEVICE}), (same, kinds)
        assert host == {("cpu", True)}, host


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", FUNSHARD_FORCE_COLLECTIVES="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


NO_DEVICE = pytest.mark.skipif(bool(devices_for(1)), reason=f"{DEVICE} lane: {devices_for(1)}")


@NO_DEVICE
def test_demo_on_device(tmp_path):
    """The demo, one process on the lane's device, every collective forced: it trains."""
    proc = _run(["examples/gpt/train.py", "--device", DEVICE, "--nproc", "1", "--mesh", "1x1",
                 "--steps", "6", "--dim", "32", "--layers", "2", "--heads", "2", "--seq", "32",
                 "--batch", "2", "--eval-every", "3", "--ckpt-every", "3", "--sample", "20",
                 "--no-progress", "--out", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "loss" in m]) >= 6, metrics


@NO_DEVICE
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_benchmark_short_on_device(tmp_path, precision):
    """The benchmark's short mode on one device: funshard, FSDP2 and the floor, with ratios;
    in bfloat16 too (funshard's Policy, FSDP2's MixedPrecisionPolicy, the floor's autocast)."""
    out = tmp_path / "bench.json"
    proc = _run(["-m", "benchmarks.bench", "--device", DEVICE, "--world", "1", "--blocks", "2",
                 "--dim", "32", "--seq", "16", "--batch", "2", "--rounds", "1", "--warmup", "1",
                 "--steps", "1", "--no-memory", "--no-overhead", "--precision", precision,
                 "--modes", "funshard_full,fsdp2_full,floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["modes"]["funshard_full"]["x_twin"] > 0
            and res["modes"]["funshard_full"]["x_floor"] > 0)
    assert res["config"]["precision"] == precision


def test_the_cuda_lane_without_a_gpu_skips_saying_why():
    """``scripts/test.sh --device cuda`` on a machine with no GPU fails, saying so; with
    FUNSHARD_LANE_NO_GPU_OK=1 the lane's tests are collected, none runs, and each skip names
    the missing GPUs; the CPU tests are left out."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the lane runs for real there")
    env = dict(os.environ, FUNSHARD_PY=sys.executable)
    env.pop("FUNSHARD_TEST_DEVICE", None)
    env.pop("FUNSHARD_LANE_NO_GPU_OK", None)
    # with no GPU the lane refuses to run at all: a run of skips is no CUDA run
    none = subprocess.run(["bash", "scripts/test.sh", "--device", "cuda", "tests/test_lane.py"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert none.returncode == 3 and "sees no CUDA GPU" in none.stderr, none.stderr[-2000:]
    env["FUNSHARD_LANE_NO_GPU_OK"] = "1"  # list the skips: each names what is missing
    proc = subprocess.run(["bash", "scripts/test.sh", "--device", "cuda", "tests/test_lane.py",
                           "-q", "-k", "not without_a_gpu"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert " passed" not in proc.stdout and "skipped" in proc.stdout, proc.stdout[-2000:]
    assert "cuda lane: needs 1 GPU (one per rank" in proc.stdout, proc.stdout[-2000:]
    bad = subprocess.run(["bash", "scripts/test.sh", "--device", "tpu"], capture_output=True,
                         text=True, env=env, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "cpu or cuda" in bad.stderr


def test_the_gpu_script_without_a_gpu_refuses(tmp_path):
    """``scripts/gpu.sh``, the GPU session's checks: each stage logs to $OUT/gpu.log with its
    exit status, and where torch sees no GPU the lane stage fails saying so (exit 3); stages
    named with commas run in turn, each under $FUNSHARD_STAGE_CAP; an unknown stage or no
    FUNSHARD_PY is refused."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: gpu.sh runs for real there")
    env = dict(os.environ, FUNSHARD_PY=sys.executable, OUT=str(tmp_path))
    env.pop("FUNSHARD_LANE_NO_GPU_OK", None)
    lane = subprocess.run(["bash", "scripts/gpu.sh", "lane"], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)
    log = (tmp_path / "gpu.log").read_text()
    assert lane.returncode == 3 and "sees no CUDA GPU" in log and "== lane: exit 3" in log, log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.log"]
    capped = subprocess.run(["bash", "scripts/gpu.sh", "lane,nope"], capture_output=True,
                            text=True, env=dict(env, FUNSHARD_STAGE_CAP="1"), timeout=60,
                            cwd=ROOT)
    log = (tmp_path / "gpu.log").read_text()
    # lane stopped at its cap (124) or refused (3), then the next stage named: refused
    assert log.count("== lane: exit") == 2 and "unknown stage 'nope'" in capped.stderr, log
    assert capped.returncode == 2, capped.returncode
    bad = subprocess.run(["bash", "scripts/gpu.sh", "nope"], capture_output=True, text=True,
                         env=env, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "unknown stage 'nope'" in bad.stderr, bad.stderr
    env.pop("FUNSHARD_PY")
    none = subprocess.run(["bash", "scripts/gpu.sh", "lane"], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)
    assert none.returncode != 0 and "set FUNSHARD_PY" in none.stderr, none.stderr


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that write bfloat16 values read from float32 ones (casts)."""

    OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
           torch.ops.aten._foreach_copy_.default}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                    if isinstance(t, torch.Tensor)]
            dt = (kwargs or {}).get("dtype")
            if func is torch.ops.aten._to_copy.default:
                self.n += int(dt == torch.bfloat16 and flat[0].dtype == torch.float32)
            else:  # copy_(dst, src) / _foreach_copy_(dsts, srcs): each pair a cast
                half = len(flat) // 2
                self.n += sum(d.dtype == torch.bfloat16 and s.dtype == torch.float32
                              for d, s in zip(flat[:half], flat[half:]))
        return func(*args, **(kwargs or {}))


def casts_per_step(spec, repeat):
    """Casts of float32 parameters to bfloat16 in one steady step of ``Policy(param_dtype=
    bfloat16)``, each block applied ``repeat`` times (every weight used by ``repeat`` times
    the ops), and the all-gathers in it."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    model = _gpt(dev)

    def loss_fn(p, batch):
        x, y = batch
        h = fs.call(model.wte, {"weight": p["wte.weight"]}, x)
        h = h + p["wpe.weight"][: x.shape[1]]
        for i in range(len(model.layers)):
            sub = {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
            for _ in range(repeat):
                h = fs.call(model.layers[i], sub, h)
        h = F.layer_norm(h, (h.shape[-1],), p["ln_f.weight"], p["ln_f.bias"])
        return F.cross_entropy((h @ p["wte.weight"].t()).flatten(0, 1).float(), y.flatten())

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2),
                         policy=fs.Policy(param_dtype=torch.bfloat16))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    g = torch.Generator().manual_seed(1)
    state, _ = step(state, _local(_batch(g, world, dev), rank))
    casts = _Casts()
    with casts, CountCollectives() as cc:
        state, _ = step(state, _local(_batch(g, world, dev), rank))
    return casts.n, cc.counts.get("all_gather", 0)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_param_dtype_casts_once_per_gather_not_per_op(pools, spec):
    """World 1 with ``param_dtype`` casts what it gathers, one cast per leaf per gather, however
    many ops read the weights (FSDP2's ``MixedPrecisionPolicy`` casts as it all-gathers too)."""
    once = pools.run(spec, casts_per_step, 1)
    thrice = pools.run(spec, casts_per_step, 3)
    for (n1, ag1), (n3, ag3) in zip(once, thrice):
        assert n1 > 0 and n1 == n3 and ag1 == ag3, (n1, n3, ag1, ag3)

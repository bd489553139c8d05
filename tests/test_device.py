"""Device-correct by construction: every tensor funshard makes takes its device from the data.

CI has no GPU, so this lane runs the library with torch's default device set to ``meta``
while every tensor of the user's lives on the CPU: a tensor funshard makes without naming a
device lands on ``meta`` and fails as soon as it meets real data or is read, the way a CPU
accumulator beside CUDA tensors fails on a GPU (the first CUDA run failed exactly so).
"""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import mesh
from funshard.testing.models import GPT, gpt_loss

POLICIES = {
    "full": {},
    "grad_op": {"reshard_after_forward": False},
    "mixed": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "accumulate_clip": {"accumulate": 2, "clip_norm": 0.5},
    # the one-host CPU exchanges, opt-in by name (the default is the backend's collectives)
    "no_prefetch_p2p": {"prefetch": False, "transport": "p2p"},
    "cma": {"transport": "cma"},
    "skip_nonfinite": {"skip_nonfinite": True},
    "float16_scaled": {"param_dtype": torch.float16, "reduce_dtype": torch.float32,
                       "loss_scale": "dynamic"},
    "checkpoint": {"checkpoint": True},  # activation checkpointing: the recompute's gathers
    # fs.Mean with a number for its count: the step puts it on the device itself
    "mean_accumulate": {"_mean": True, "accumulate": 2},
}
OPTIMIZERS = {
    "adamw": lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1),
    "sgd": lambda: fs.optim.sgd(lr=0.1, momentum=0.9),
    "fused_adamw": lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1, fused=True),
    "muon": lambda: fs.optim.muon(lr=1e-2, other=fs.optim.adamw(lr=1e-2)),
    # torch's foreach Adam: its step as funshard's own ops, gated on the device
    "from_torch": lambda: fs.optim.from_torch(torch.optim.Adam, lr=1e-2),
    # torch's RMSprop: host code, run after the step's read of its verdict
    "from_torch_rmsprop": lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=1e-2),
    # the same with select=True: torch's own step, kept or undone on the device
    "from_torch_selected": lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=1e-2,
                                                       select=True),
    # torch's fused kernel takes the step's verdict on the device (found_inf)
    "from_torch_fused": lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-2, fused=True),
}


def _model_and_batch(world, per_rank=2, seed=0):
    torch.manual_seed(seed)
    model = GPT(vocab=37, dim=12, heads=2, layers=2, seq=8)
    g = torch.Generator().manual_seed(seed + 1)
    rank = dist.get_rank()
    x = torch.randint(0, 37, (world * per_rank, 8), generator=g)
    y = torch.randint(0, 37, (world * per_rank, 8), generator=g)
    return model, (x[rank * per_rank:(rank + 1) * per_rank],
                   y[rank * per_rank:(rank + 1) * per_rank])


def _mean_loss(model):
    def loss_fn(params, batch):
        logits = fs.call(model, params, batch[0])
        total = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), reduction="sum")
        return fs.Mean(total, batch[1].numel())
    return loss_fn


def step_on_meta_default(spec, policy_kwargs, optimizer, steps=2):
    """Two steps with everything funshard makes on the default device, which is meta; the
    same two steps with the default device left alone; the losses must agree."""
    m = mesh(spec)
    out = []
    kwargs = {k: v for k, v in policy_kwargs.items() if k not in ("_mean", "_compile")}
    compile = policy_kwargs.get("_compile", False)
    for default in ("meta", None):
        model, batch = _model_and_batch(dist.get_world_size())
        opt = OPTIMIZERS[optimizer]()
        loss_fn = _mean_loss(model) if policy_kwargs.get("_mean") else gpt_loss(model)
        step = fs.train_step(loss_fn, opt, policy=fs.Policy(**kwargs), compile=compile)
        params = fs.params(model)
        with torch.device(default) if default else _nothing():
            state = step.init(fs.shard(params, m))
            losses = []
            for _ in range(steps):
                state, metrics = step(state, batch)
                losses.append((metrics["loss"], metrics["grad_norm"]))
            full = fs.unshard(state.params)
        assert all(v.device.type == "cpu" for v in full.values())
        out.append((losses, {k: v.clone() for k, v in full.items()}))
    (meta_losses, meta_full), (losses, full) = out
    err = max((meta_full[k] - full[k]).abs().max().item() for k in full)
    return meta_losses == losses, err


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_the_compiled_step_makes_nothing_on_the_default_device(pools, spec):
    """train_step(compile=True): its first (eager) step, the compile and two runs of the
    program, with the default device on meta."""
    policy = {"_compile": {"backend": "aot_eager"}, "accumulate": 2, "clip_norm": 0.5,
              "loss_scale": 1024.0}
    for rank, (same, err) in enumerate(pools.run(spec, step_on_meta_default, policy,
                                                 "adamw", 4, timeout=600)):
        assert same and err == 0.0, (rank, same, err)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
@pytest.mark.parametrize("policy", list(POLICIES), ids=str)
def test_step_makes_nothing_on_the_default_device(pools, spec, policy):
    for rank, (same, err) in enumerate(pools.run(spec, step_on_meta_default,
                                                 POLICIES[policy], "adamw")):
        assert same and err == 0.0, (rank, same, err)


def _torch_adam_names_its_device() -> bool:
    """Whether torch's own Adam makes its step counters on the CPU by name (2.13) rather than
    on the default device (2.11), where a meta default fails inside torch, not funshard."""
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.zeros(2)
    try:
        with torch.device("meta"):
            torch.optim.Adam([p], lr=0.0, foreach=False).step()
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("spec", [1, 2], ids=str)
# (torch's RMSprop makes its step counter on the default device: a meta default fails inside
# torch.optim, not funshard)
@pytest.mark.parametrize("optimizer", [o for o in OPTIMIZERS if o not in (
    "adamw", "from_torch_rmsprop", "from_torch_selected")], ids=str)
def test_optimizers_make_nothing_on_the_default_device(pools, spec, optimizer):
    if optimizer == "from_torch" and not _torch_adam_names_its_device():
        pytest.skip(f"torch {torch.__version__}'s own Adam makes its step counter on the "
                    "default device: a meta default fails inside torch.optim")
    for rank, (same, err) in enumerate(pools.run(spec, step_on_meta_default, {}, optimizer)):
        assert same and err == 0.0, (rank, same, err)


def functions_on_meta_default(spec):
    """shard / unshard (and its backward) / reshard / reduce_grads / state_dict kinds and
    their inverses, with the default device on meta: every result lives on the CPU."""
    m = mesh(spec)
    model, _ = _model_and_batch(dist.get_world_size())
    params = fs.params(model)
    with torch.device("meta"):
        sp = fs.shard(params, m)
        full = fs.unshard(sp)
        sum(v.float().pow(2).sum() for v in full.values()).backward()
        back = fs.reshard(full, like=sp)
        grads = fs.reduce_grads({k: torch.ones_like(v) for k, v in full.items()}, like=sp)
        sds = {kind: fs.state_dict(sp, kind=kind) for kind in ("full", "sharded", "local")}
        loaded = {kind: fs.load_state_dict(sd, like=sp) for kind, sd in sds.items()}
    devices = {t.device.type for tree in (sp, full, back, grads, *loaded.values())
               for t in fs.pytree.leaves(tree)}
    devices |= {v.grad.device.type for v in sp.values()}
    same = all(torch.equal(fs.unshard(tree)[k], params[k].detach())
               for tree in (back, *loaded.values()) for k in params)
    return devices, same


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_functions_make_nothing_on_the_default_device(pools, spec):
    for rank, (devices, same) in enumerate(pools.run(spec, functions_on_meta_default)):
        assert devices == {"cpu"} and same, (rank, devices, same)


def _cpu_default(fn):
    """``fn`` with the default device back on the CPU: torch.distributed.checkpoint's own
    internals make tensors on the default device; they are torch's, not funshard's."""
    def wrapped(*args, **kwargs):
        with torch.device("cpu"):
            return fn(*args, **kwargs)
    return wrapped


def checkpoint_on_meta_default(spec, path):
    import torch.distributed.checkpoint as dcp

    m = mesh(spec)
    model, batch = _model_and_batch(dist.get_world_size())
    step = fs.train_step(gpt_loss(model), fs.optim.adamw(lr=1e-2))
    state = step.init(fs.shard(fs.params(model), m))
    state, _ = step(state, batch)
    saved = dcp.save, dcp.load
    dcp.save, dcp.load = _cpu_default(dcp.save), _cpu_default(dcp.load)
    try:
        with torch.device("meta"):
            fs.checkpoint.save(path, state)
            back = fs.checkpoint.load(path, like=state)
            fs.checkpoint.save(path + "_async", state, async_save=True).result()
            sd = fs.state_dict(state, kind="full")
    finally:
        dcp.save, dcp.load = saved
    devices_sd = {v.device.type for v in sd.values() if isinstance(v, torch.Tensor)}
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in
               zip(fs.pytree.leaves(state.params), fs.pytree.leaves(back.params)))
    devices = {t.device.type for t in fs.pytree.leaves(back)
               if isinstance(t, torch.Tensor)} | devices_sd
    return same, devices


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_checkpoint_makes_nothing_on_the_default_device(pools, spec, tmp_path):
    for rank, (same, devices) in enumerate(
            pools.run(spec, checkpoint_on_meta_default, str(tmp_path / "ckpt"))):
        assert same and devices == {"cpu"}, (rank, same, devices)


# -- one host read per step ----------------------------------------------------------------

# what reads a tensor's values on the host: on a GPU each waits for the device (a sync)
_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu",
            "nonzero", "any", "all")
_FUNCTIONS = ("equal", "is_nonzero", "nonzero", "any", "all")


class _HostReads:
    """Counts the host reads funshard's own code makes (the calling frame is in funshard), by
    file and line, with each reading method and function replaced for the duration (a
    TorchFunctionMode would miss those made inside another torch function's dispatch, as
    the step's gathers are)."""

    def __init__(self):
        self.seen: dict[str, int] = {}
        self.saved: list = []

    def _counted(self, fn):
        def read(*args, **kwargs):
            f = sys._getframe(1)
            name = f.f_code.co_filename.replace("\\", "/")
            if "/funshard/" in name and "/testing/" not in name:
                where = f"{name.split('/funshard/')[-1]}:{f.f_lineno}"
                self.seen[where] = self.seen.get(where, 0) + 1
            return fn(*args, **kwargs)
        return read

    def __enter__(self):
        for owner, names in ((torch.Tensor, _METHODS), (torch, _FUNCTIONS)):
            for n in names:
                self.saved.append((owner, n, owner.__dict__.get(n)))
                setattr(owner, n, self._counted(getattr(owner, n)))
        return self

    def __exit__(self, *exc):
        for owner, n, old in reversed(self.saved):
            if old is None:
                delattr(owner, n)
            else:
                setattr(owner, n, old)
        return False


def host_reads(spec, policy_kwargs, optimizer, compile=False, unread=False):
    """The host reads of a step after the first two (which learn the schedule; compiled,
    the first runs eagerly and the second compiles the program), and then the caller's
    first read of its metrics."""
    m = mesh(spec)
    kwargs = {k: v for k, v in policy_kwargs.items() if k != "_mean"}
    model, batch = _model_and_batch(dist.get_world_size())
    loss_fn = _mean_loss(model) if policy_kwargs.get("_mean") else gpt_loss(model)
    torch._dynamo.reset()
    step = fs.train_step(loss_fn, OPTIMIZERS[optimizer](), policy=fs.Policy(**kwargs),
                         compile=compile)
    state = step.init(fs.shard(fs.params(model), m))
    for _ in range(2):
        state, metrics = step(state, batch)
    if not unread:  # read: else a step's start reads those of the one before last
        float(metrics["loss"])
    reads = _HostReads()
    with reads:
        state, metrics = step(state, batch)
    read = _HostReads()  # the caller's
    with read:
        loss = metrics["loss"]
    return reads.seen, read.seen, loss


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
@pytest.mark.parametrize("policy", list(POLICIES), ids=str)
def test_a_step_reads_nothing_until_the_caller_does(pools, spec, policy):
    """On a GPU a host read of a tensor waits for the device. The eager step (adamw) makes
    none: its metrics and its checks (the loss and gradient norm, a non-finite step,
    whether the ranks agree) wait on the device, and the update is gated there; the
    caller's first read of the metrics is the one read, of them all together. Seen here as
    the host reads funshard's code makes (CPU tensors), the lane's proxy for what would
    sync a GPU."""
    for rank, (seen, read, loss) in enumerate(pools.run(spec, host_reads, POLICIES[policy],
                                                        "adamw")):
        assert seen == {}, (rank, seen)
        assert sum(read.values()) == 1 and all(w.startswith("step/deferred.py") for w in read), \
            (rank, read)
        assert loss == loss  # the step ran


COMPILED = {"clip": {"clip_norm": 1.0}, "mean_accumulate": {"_mean": True, "accumulate": 2},
            "grad_op_mixed": {"reshard_after_forward": False, "param_dtype": torch.bfloat16},
            "skip_nonfinite": {"skip_nonfinite": True, "clip_norm": 1.0},
            "loss_scale": {"param_dtype": torch.float16, "reduce_dtype": torch.float32,
                           "loss_scale": "dynamic"}}


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
@pytest.mark.parametrize("policy", list(COMPILED), ids=str)
def test_a_compiled_step_reads_nothing_until_the_caller_does(pools, spec, policy):
    """The compiled step (adamw, a non-finite step refused or skipped) reads nothing on the
    host: its checks and metrics wait on the device; the caller's first read of the
    metrics is the one read (unread, the next step's start reads them)."""
    for rank, (seen, read, loss) in enumerate(pools.run(
            spec, host_reads, COMPILED[policy], "adamw", {"backend": "aot_eager"})):
        assert seen == {}, (rank, seen)
        assert sum(read.values()) == 1 and all(w.startswith("step/deferred.py") for w in read), \
            (rank, read)
        assert loss == loss  # the step ran


@pytest.mark.parametrize("policy", ["clip", "skip_nonfinite", "loss_scale"], ids=str)
@pytest.mark.parametrize("spec", [1, 2], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_unread_reads_the_step_before_last(pools, spec, policy, compiled):
    """Metrics never read: a step's start reads the checks of the step before last (on a
    GPU, from pinned memory, after the device finished that step's backward), so that a
    refusal comes two steps late at most, and nothing else; under ``skip_nonfinite`` or a
    dynamic loss scale the compiled update and the scale take the last step's verdict on
    the device, where the eager step, whose update takes its scalars from the host, reads
    the last step's instead (the host stays a step ahead)."""
    last = not compiled and policy != "clip"
    for rank, (seen, read, loss) in enumerate(pools.run(
            spec, host_reads, COMPILED[policy], "adamw",
            {"backend": "aot_eager"} if compiled else False, True)):
        assert sum(seen.values()) == 1, (rank, seen)
        assert all(w.startswith("step/deferred.py") for w in seen), (rank, seen)
        assert sum(read.values()) == 2 - last, (rank, read)  # the caller's: what is unread
        assert loss == loss


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=str)
def test_the_optimizers_read_nothing(pools, optimizer):
    """The optimizers gated on the device make no host read: ``adam``, ``adamw`` (its fused
    kernel too), ``sgd``, ``muon``, and torch's Adam and AdamW (foreach: funshard's own ops;
    fused: its kernel's ``found_inf``) and any other with ``select=True``; the rest (torch's
    RMSprop, a custom chain) run after the step's one read of its metrics."""
    for rank, (seen, read, _) in enumerate(pools.run(2, host_reads, {}, optimizer)):
        if optimizer in ("adamw", "sgd", "fused_adamw", "muon", "from_torch",
                         "from_torch_fused", "from_torch_selected"):
            assert seen == {} and sum(read.values()) == 1, (rank, seen, read)
        else:
            assert sum(seen.values()) == 1 and read == {}, (rank, seen, read)
            assert all(w.startswith("step/update.py") for w in seen), (rank, seen)

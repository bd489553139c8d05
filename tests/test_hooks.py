"""The caller's own saved-tensor hooks (save_on_cpu, an activation-offloading context) around
the model or around the step: the step's go over them, so a gathered parameter stays the
step's and every other saved tensor is theirs, and training is what it is without them. See
[Note: hooks beneath the step's] in funshard.step.saved."""

import pytest
import torch
import torch.nn.functional as F

import funshard as fs
from funshard.step.lazy import LazyParam
from funshard.step.run import Run
from funshard.testing import mesh
from funshard.testing.models import MLP

POLICIES = {"full_shard": {}, "shard_grad_op": {"reshard_after_forward": False},
            "bf16": {"param_dtype": torch.bfloat16}, "accumulate": {"accumulate": 2},
            "checkpoint": {"checkpoint": True}}
WHERE = ("model", "step", "bound")
KINDS = ("save_on_cpu", "detach", "keep")
BOUND = "layers.0.0.weight"  # a group forward frees (FULL_SHARD) before backward


def _model():
    torch.manual_seed(0)
    return MLP(dim=5, hidden=7, layers=3, out=3)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


class Theirs:
    """The caller's hooks of ``kind``, counting what they are given and how much of it lies
    on a parameter's storage as ``loss_fn`` holds it (a gathered one: the step's)."""

    def __init__(self, kind):
        self.kind, self.params, self.packed, self.on_params = kind, {}, 0, 0

    def __call__(self):
        if self.kind == "save_on_cpu":
            inner = torch.autograd.graph.save_on_cpu()
            pack, unpack = inner.pack_hook, inner.unpack_hook
        elif self.kind == "detach":  # a new tensor on the same storage
            pack, unpack = (lambda t: t.detach()), (lambda t: t)
        else:  # the tensor itself
            pack, unpack = (lambda t: t), (lambda t: t)

        def counted(t):
            self.packed += 1
            ptr = t.untyped_storage().data_ptr()
            run = Run.current()  # inside the step: its gathered storages
            self.on_params += (run.storage.get(ptr) is not None if run is not None else
                               any(v.untyped_storage().data_ptr() == ptr
                                   for v in self.params.values()))
            return pack(t)
        return torch.autograd.graph.saved_tensors_hooks(counted, unpack)


def _forward(model, p, x, theirs, where):
    """The model's output with ``theirs`` around it (``model``), or around a forward that
    used the first group before them and again under them before any first use there
    (``bound``); ``step``: the hooks are around the step call."""
    theirs.params = p
    if where == "step":
        return fs.call(model, p, x)
    z = 0
    if where == "bound":
        z = (p[BOUND] * 0).sum()  # its group gathered
    with theirs():
        if where == "bound":  # an op on it that their hooks would save: the step's go over
            z = z + (p[BOUND] * p[BOUND]).sum() * 0  # saved twice, before the step sees them
        return fs.call(model, p, x) + z


def hooked(spec, policy, where, kind):
    """Parameters after three steps with the caller's hooks and without (the same run), what
    the hooks were given (tensors, tensors on a parameter's storage), and the last step's
    peak of gathered groups with and without them."""
    model = _model()
    theirs = Theirs(kind)
    ends, peaks = [], []
    for hooks in (True, False):
        def loss_fn(p, b):
            if not hooks:
                return F.mse_loss(fs.call(model, p, b[0]).float(), b[1])
            return F.mse_loss(_forward(model, p, b[0], theirs, where).float(), b[1])
        step = fs.train_step(loss_fn, fs.optim.adamw(lr=0.05), policy=fs.Policy(**policy))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        for b in _batches(3):
            if hooks and where == "step":
                with theirs():
                    state, m = step(state, b)
            else:
                state, m = step(state, b)
        ends.append(fs.unshard(state.params))
        peaks.append(m["unsharded_groups_peak"])
    same = all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    return same, theirs.packed, theirs.on_params, peaks


def plain_packs(spec, kind, where):
    """What the same hooks are given around one process's forward (``model``), or forward
    and loss (``step``), over a plain module, per step: (tensors, on a parameter's
    storage)."""
    model = _model()
    theirs = Theirs(kind)
    theirs.params = dict(model.named_parameters())
    x, y = _batches(1)[0]
    with theirs():
        out = model(x)
        if where == "step":
            out = F.mse_loss(out, y)
    F.mse_loss(out, y).backward() if where == "model" else out.backward()
    return theirs.packed, theirs.on_params


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_the_callers_hooks_change_nothing_and_never_get_a_gathered_parameter(pools, spec,
                                                                          policy):
    """Around the model, around the step, and after a group was used before them: the
    same parameters, bit for bit, as the same run without them, and as few groups gathered
    at once (a group used before them stays gathered until its backward: one group more at
    the peak); their pack gets activations, never a gathered parameter."""
    for where in WHERE:
        for kind in KINDS:
            for rank, (same, packed, on_params, peaks) in enumerate(
                    pools.run(spec, hooked, POLICIES[policy], where, kind)):
                at = (where, kind, rank)
                assert same, at
                assert packed > 0, at
                # the hooks keep no more gathered than without them; bound: that group
                assert peaks[0] - peaks[1] == (where == "bound" and policy != "shard_grad_op"), \
                    (*at, peaks)
                assert on_params == 0, (*at, on_params)


def test_the_callers_hooks_get_every_activation_a_plain_step_gives_them(pools):
    """2 ranks, FULL_SHARD: their pack gets exactly the saved tensors it gets on a plain
    module in one process, less the parameters."""
    for where in ("model", "step"):
        plain, on_params = pools.run(1, plain_packs, "keep", where)[0]
        assert on_params > 0  # a plain module's weights reach them: the comparison has teeth
        for same, packed, _, _ in pools.run(2, hooked, {}, where, "keep"):
            assert same and packed == 3 * (plain - on_params), (where, packed, plain, on_params)


def first_use_under_hooks_is_a_stand_in(spec):
    """The parameters loss_fn gets on 2 ranks are stand-ins (the case these tests are for)."""
    seen = []

    def loss_fn(p, b):
        seen.append(isinstance(p["inp.weight"], LazyParam))
        return F.mse_loss(fs.call(model, p, b[0]), b[1])
    model = _model()
    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
    step(step.init(fs.shard(fs.params(model), mesh(spec))), _batches(1)[0])
    return seen


def test_these_tests_meet_stand_ins(pools):
    assert pools.run(2, first_use_under_hooks_is_a_stand_in) == [[True], [True]]


def compiled_under_hooks(spec, where):
    """torch.compile(loss_fn) (aot_eager) with save_on_cpu around the model inside it, or
    around the step call: parameters against one process's under the same hooks."""
    import copy
    import gc

    import torch.distributed as dist

    from funshard.testing.models import GPT, gpt_loss

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, heads=2, layers=3, seq=8)
    ref = copy.deepcopy(model)
    inner = gpt_loss(model)

    def loss_fn(p, b):
        if where == "step":
            return inner(p, b)
        with torch.autograd.graph.save_on_cpu():
            return inner(p, b)
    step = fs.train_step(torch.compile(loss_fn, backend="aot_eager"), fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        idx, tgt = (torch.randint(0, 32, (world * 2, 8), generator=g) for _ in range(2))
        mine = slice(rank * 2, rank * 2 + 2)
        with torch.autograd.graph.save_on_cpu() if where == "step" else torch.enable_grad():
            state, _ = step(state, (idx[mine], tgt[mine]))
        opt.zero_grad()
        with torch.autograd.graph.save_on_cpu():
            loss = sum(gpt_loss(ref)(dict(ref.named_parameters()), c)
                       for c in zip(idx.split(2), tgt.split(2))) / world
        loss.backward()
        opt.step()
    full = fs.unshard(state.params)
    torch._dynamo.reset()  # the compiled frames let go of this step's stand-ins
    gc.collect()
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("where", ["model", "step"])
def test_a_compiled_loss_fn_under_the_callers_hooks_trains_as_one_process(pools, where):
    for err in pools.run(2, compiled_under_hooks, where, timeout=300):
        assert err < 1e-6, err


def llama_checkpointed_under_hooks(spec, reentrant):
    """Hugging Face Llama with gradient_checkpointing_enable() (either mode) and save_on_cpu
    around it: the same parameters, bit for bit, as without the hooks."""
    import torch.distributed as dist

    from test_ac import _llama

    rank, world = dist.get_rank(), dist.get_world_size()
    ends = []
    for hooks in (True, False):
        model = _llama(reentrant)

        def loss_fn(p, ids):
            with torch.autograd.graph.save_on_cpu() if hooks else torch.enable_grad():
                return fs.call(model, p, input_ids=ids, labels=ids).loss
        step = fs.train_step(loss_fn, fs.optim.adamw(lr=0.01))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            state, _ = step(state, torch.randint(0, 64, (world * 2, 8), generator=g)[
                rank * 2:rank * 2 + 2])
        ends.append(fs.unshard(state.params))
    return all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_llama_under_the_callers_hooks_trains_as_without(pools, reentrant):
    assert pools.run(2, llama_checkpointed_under_hooks, reentrant, timeout=300) == [True] * 2


def region_input_under_hooks(spec):
    """A parameter no op has used yet given to a non-reentrant checkpoint region as its
    input, under save_on_cpu the step has already gone over: as without the hooks (the
    step's hooks see the region begin through theirs)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    tree = {"a": torch.randn(6, 5).requires_grad_(), "b": torch.randn(4, 6).requires_grad_()}
    ends = []
    for hooks in (True, False):
        def loss_fn(p, batch):
            x, y = batch
            with torch.autograd.graph.save_on_cpu() if hooks else torch.enable_grad():
                h = torch.tanh(x @ p["a"].t())  # the step's hooks go over save_on_cpu here
                h = checkpoint(lambda h, w: torch.tanh(h @ w.t()), h, p["b"],
                               use_reentrant=False)
            return F.mse_loss(h, y)
        step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1), policy=fs.Policy(groups=str))
        state = step.init(fs.shard(tree, mesh(spec)))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            state, _ = step(state, (torch.randn(3, 5, generator=g), torch.randn(3, 4, generator=g)))
        ends.append(fs.unshard(state.params))
    return all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


def test_a_parameter_first_given_to_a_region_under_the_callers_hooks(pools):
    assert pools.run(2, region_input_under_hooks) == [True] * 2

"""Complex parameters train as one process does, the gradient norm and its clip included (a
complex gradient's norm is its modulus's: its imaginary part counts)."""

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import mesh

OPTIMIZERS = {
    # the step's clip, no host read (the default update)
    "sgd": lambda: (fs.optim.sgd(lr=0.1), fs.Policy(clip_norm=0.5)),
    # the step's clip before torch's own step, which reads the verdict first
    "torch_sgd": lambda: (fs.optim.from_torch(torch.optim.SGD, lr=0.1),
                          fs.Policy(clip_norm=0.5)),
    # the chain's clip (fs.optim.clip_by_global_norm), no clip in the policy
    "chain": lambda: (fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(lr=0.1)),
                      fs.Policy()),
}


def _loss(p, x):
    return ((x @ p["w"]).abs() + p["b"]).pow(2).mean()


def complex_clip(spec, kind):
    """Two steps of a complex leaf and a real one under a clip: the norm the step reports,
    one process's (``clip_grad_norm_`` over every rank's batch), and the largest difference
    of the parameters."""
    m, rank, world = mesh(spec), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(6, 3, dtype=torch.cfloat, generator=g), torch.randn(3, generator=g)
    xs = [torch.randn(5, 6, dtype=torch.cfloat, generator=g) for _ in range(world)]
    opt, policy = OPTIMIZERS[kind]()
    step = fs.train_step(_loss, opt, policy=policy)
    state = step.init(fs.shard({"w": torch.nn.Parameter(w0.clone()),
                                "b": torch.nn.Parameter(b0.clone())}, m))
    ref = {"w": w0.clone().requires_grad_(), "b": b0.clone().requires_grad_()}
    ref_opt = torch.optim.SGD(list(ref.values()), lr=0.1)
    norms = []
    for _ in range(2):
        state, metrics = step(state, xs[rank])
        ref_opt.zero_grad()
        (sum(_loss(ref, x) for x in xs) / world).backward()
        want = torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
        ref_opt.step()
        got = metrics.get("grad_norm")
        norms.append((None if got is None else float(got), float(want)))
    full = fs.unshard(state.params)
    return norms, max((full[k] - ref[k].detach()).abs().max().item() for k in ref)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_a_complex_gradient_norm_counts_its_imaginary_part(pools, spec, kind):
    for rank, (norms, diff) in enumerate(pools.run(spec, complex_clip, kind)):
        for got, want in norms:
            assert got is None or abs(got - want) <= 1e-5 * want, (rank, norms)
        assert diff <= 1e-6, (rank, diff, norms)


def complex_params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 3, dtype=torch.cfloat, generator=g).requires_grad_(),
            "b": torch.randn(3, generator=g).requires_grad_()}


def complex_loss(p, batch):
    return _loss(p, batch[0])


def test_assert_parity_clips_a_complex_model_as_one_process(pools):
    """fs.testing's one process clips by the modulus's norm too: a complex model under a clip
    passes on 2 and 2x2 ranks."""
    import functools

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, dtype=torch.cfloat, generator=g),) for _ in range(3)]
    fs.testing.assert_parity(pools, complex_loss, functools.partial(fs.optim.sgd, lr=0.1),
                             batches, params=complex_params(), meshes=(2, "2x2"),
                             policy=fs.Policy(clip_norm=0.5))


def test_assert_parity_sees_a_difference_in_the_imaginary_part_alone():
    from funshard.testing.parity import _difference

    w = torch.tensor([1 + 2j, 3 - 1j])
    same = (0.5, {"w": w.clone()})
    assert _difference(same, (0.5, {"w": w}), 1e-6, 1e-6) == ""
    off = (0.5, {"w": w + 1e-3j})
    assert "leaf 'w' differs by 0.001" in _difference(off, (0.5, {"w": w}), 1e-6, 1e-6)


def complex_buffer_mean(spec):
    """A complex buffer loss_fn writes into (each rank its own batch's mean): after the step
    it is the mean over ranks, imaginary part included, under the default rule."""
    m, rank, world = mesh(spec), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 3, dtype=torch.cfloat, generator=g)
    xs = [torch.randn(5, 6, dtype=torch.cfloat, generator=g) for _ in range(world)]

    def loss_fn(tree, x):
        p, bufs = tree
        with torch.no_grad():
            bufs["avg"].copy_(x.mean(0))
        return (x @ p["w"]).abs().pow(2).mean()

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard({"w": torch.nn.Parameter(w0)}, m),
                      {"avg": torch.zeros(6, dtype=torch.cfloat)})
    state, _ = step(state, xs[rank])
    got = state.buffers["avg"].to_local()
    want = torch.stack([x.mean(0) for x in xs]).mean(0)
    return (got - want).abs().max().item()


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_complex_buffer_is_averaged_over_ranks(pools, spec):
    for rank, err in enumerate(pools.run(spec, complex_buffer_mean)):
        assert err < 1e-6, (rank, err)


ADAMS = {  # funshard's, torch's (one process)
    "adamw": (lambda: fs.optim.adamw(lr=0.1, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)),
    "adamw_fused": (lambda: fs.optim.adamw(lr=0.1, fused=True),
                    lambda ps: torch.optim.AdamW(ps, lr=0.1)),
    "adam": (lambda: fs.optim.adam(lr=0.1), lambda ps: torch.optim.Adam(ps, lr=0.1)),
    "sgd_momentum": (lambda: fs.optim.sgd(lr=0.1, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "torch_adamw": (lambda: fs.optim.from_torch(torch.optim.AdamW, lr=0.1),
                    lambda ps: torch.optim.AdamW(ps, lr=0.1)),
}


def complex_adam(spec, kind, compile):
    """Three steps of a complex leaf and a real one: the largest difference from torch's
    optimizer in one process over every rank's batch."""
    m, rank, world = mesh(spec), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(6, 3, dtype=torch.cfloat, generator=g), torch.randn(3, generator=g)
    xs = [torch.randn(5, 6, dtype=torch.cfloat, generator=g) for _ in range(world)]
    ours, theirs = ADAMS[kind]
    step = fs.train_step(_loss, ours(), compile=compile)
    state = step.init(fs.shard({"w": torch.nn.Parameter(w0.clone()),
                                "b": torch.nn.Parameter(b0.clone())}, m))
    ref = {"w": w0.clone().requires_grad_(), "b": b0.clone().requires_grad_()}
    ref_opt = theirs(list(ref.values()))
    for _ in range(3):
        state, _ = step(state, xs[rank])
        ref_opt.zero_grad()
        (sum(_loss(ref, x) for x in xs) / world).backward()
        ref_opt.step()
    full = fs.unshard(state.params)
    return max((full[k] - ref[k].detach()).abs().max().item() for k in ref)


@pytest.mark.parametrize("kind", sorted(ADAMS))
@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_adam_steps_a_complex_parameter_as_real_pairs_as_torch_does(pools, spec, kind):
    """torch.optim.Adam steps a complex parameter as its real pairs (a second moment per
    part); fs.optim's Adam did a complex ``g * g`` (0.30 off after three steps)."""
    for rank, diff in enumerate(pools.run(spec, complex_adam, kind, False)):
        assert diff <= 1e-6, (rank, diff)


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_the_compiled_step_steps_a_complex_parameter_as_torch_does(pools, spec):
    """Its gathers move a complex leaf as its real pairs (no backend has a complex type)."""
    for rank, diff in enumerate(pools.run(spec, complex_adam, "adamw", True)):
        assert diff <= 1e-6, (rank, diff)


def test_adam_outside_the_step_steps_a_complex_parameter_as_torch_does():
    """fs.optim's Adam used on its own (its chain's update): the same; fused=True there is
    refused by name (torch's fused kernel has no complex form)."""
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(6, 3, dtype=torch.cfloat, generator=g), torch.randn(3, generator=g)
    x = torch.randn(5, 6, dtype=torch.cfloat, generator=g)
    for ours, theirs in (ADAMS["adamw"], (lambda: fs.optim.adam(lr=0.1),
                                          lambda ps: torch.optim.Adam(ps, lr=0.1))):
        p = {"w": w0.clone().requires_grad_(), "b": b0.clone().requires_grad_()}
        ref = {k: v.clone().detach().requires_grad_() for k, v in p.items()}
        opt, ref_opt = ours(), theirs(list(ref.values()))
        state = opt.init(p)
        for i in range(3):
            ref_opt.zero_grad()
            _loss(ref, x).backward()
            ref_opt.step()
            grads = dict(zip(p, torch.autograd.grad(_loss(p, x), list(p.values()))))
            p, state = opt.update(grads, state, p, step=i)
        assert max((p[k] - ref[k].detach()).abs().max().item() for k in p) <= 1e-6
    fused = fs.optim.adamw(lr=0.1, fused=True)
    p = {"w": w0.clone().requires_grad_()}
    state = fused.init(p)
    with pytest.raises(ValueError, match="parameter 'w' is torch.complex64, which torch's "
                                         "fused Adam kernel does not take outside"):
        fused.update({"w": torch.ones_like(w0)}, state, p, step=0)

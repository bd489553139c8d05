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

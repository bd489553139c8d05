"""funshard quickstart: the README's example as a file CI runs (tests/test_quickstart.py).

    torchrun --nproc-per-node 2 examples/quickstart.py                # FSDP on 2 ranks
    torchrun --nproc-per-node 4 examples/quickstart.py --mesh 2x2     # HSDP: 2 replicas x 2 shards

The model starts on the meta device; fs.shard materialises only this rank's rows; every rank
copies its rows of the weights out of a memory-mapped state-dict file. Then it trains,
checkpoints, evaluates and exports the trained weights into an nn.Module. Run it again with a
larger --steps (any mesh) and it resumes from the latest checkpoint.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing.models import GPT  # stands in for your transformer

CONFIG = dict(vocab=64, dim=64, heads=4, layers=2, seq=32)


def get_batch(step: int, rank: int, world: int, batch: int, device="cpu"):
    """This rank's rows of the global batch of ``step`` on ``device``: token ids counting up
    from a random start (a pattern the model can learn). x, y: (batch // world, seq)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, CONFIG["vocab"], (batch, 1), generator=g)
    rows = (start + torch.arange(CONFIG["seq"] + 1)) % CONFIG["vocab"]  # (batch, seq + 1)
    mine = rows.chunk(world)[rank].to(device)
    return mine[:, :-1], mine[:, 1:]


def main(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rep, sh = (int(n) for n in (args.mesh or f"1x{world}").split("x"))
    mesh = fs.make_mesh(shard=sh, replicate=rep)  # ("replicate", "shard"); gloo on CPU
    dev = fs.mesh.mesh_device(mesh)  # this rank's GPU, or the CPU: where the batches go
    rank = dist.get_rank()
    out = Path(args.out)
    torch.manual_seed(0)  # the same seed on every rank: anything random agrees across replicas

    # 1. Weights: a Hugging Face-style state dict file ({fqn: tensor}). Rank 0 makes one here
    #    from a seeded random init; in real life it is the pretrained checkpoint you have.
    weights = out / "pretrained.pt"
    if rank == 0 and not weights.exists():
        out.mkdir(parents=True, exist_ok=True)
        torch.save(GPT(**CONFIG).state_dict(), weights)
    dist.barrier()

    # 2. The model on meta (shapes only, no memory); fs.shard materialises this rank's rows
    #    (NaN until loaded); import_full memory-maps the file and copies only those rows.
    with torch.device("meta"):
        model = GPT(**CONFIG)
    sparams = fs.shard(fs.params(model), mesh)  # {fqn: DTensor}: Shard(0) on "shard"
    sparams = fs.checkpoint.import_full(weights, like=sparams, rank0_only=False,
                                        strict=False)  # strict=False: the tied head's alias

    def loss_fn(params, batch):  # params: {fqn: tensor} with full shapes
        x, y = batch  # (B, T) token ids
        logits = fs.call(model, params, x)  # functional_call, kept until backward ends
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # (B*T, vocab), (B*T,)

    step = fs.train_step(loss_fn, fs.optim.adamw(lr=3e-3, weight_decay=0.1),
                         policy=fs.Policy(reshard_after_forward=True, clip_norm=1.0))
    state = step.init(sparams)  # ranks agree on shapes, policy and replica values, or all raise

    # 3. Resume from the latest complete checkpoint (saved on any mesh or world size).
    ckpts = out / "checkpoints"
    if (latest := fs.checkpoint.latest(ckpts)) is not None:
        state = fs.checkpoint.load(latest, like=state)
        say(f"resumed from {latest} (step {state.step})")

    # 4. Train: each rank its share of the global batch; the step's gradient is the mean.
    while state.step < args.steps:
        batch = get_batch(state.step, rank, world, args.batch, dev)
        state, metrics = step(state, batch)  # donates: use the returned state
        say(f"step {state.step} loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f}")
        if state.step % args.ckpt_every == 0 or state.step == args.steps:
            fs.checkpoint.save(ckpts / f"step_{state.step:06d}", state)  # every rank, atomic
            if rank == 0:
                fs.checkpoint.prune(ckpts, keep=2)

    # 5. Evaluate: a forward without gradients on a held-out batch (the whole batch on every
    #    rank), one group gathered at a time as in training (fs.eval_step runs any function).
    x, y = get_batch(10**6, 0, 1, args.batch, dev)
    val = fs.eval_step(loss_fn)(state.params, (x, y)).item()
    say(f"validation loss {val:.4f}")

    # 6. Export: the trained weights in a plain nn.Module on rank 0 (the meta model's
    #    parameters become CPU tensors); then torch.save, or save_pretrained for an HF model.
    trained = fs.checkpoint.export_module(model, state.params)  # None on other ranks
    if trained is not None:
        torch.save(trained.state_dict(), out / "trained.pt")
        with torch.no_grad():
            again = F.cross_entropy(trained(x.cpu()).flatten(0, 1), y.cpu().flatten()).item()
        say(f"exported to {out / 'trained.pt'} (validation loss {again:.4f} in plain PyTorch)")
    dist.destroy_process_group()


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="funshard quickstart (run under torchrun)")
    ap.add_argument("--mesh", default=None, help="RxS: replicate x shard (default 1xWORLD)")
    ap.add_argument("--steps", type=int, default=20, help="train up to this step")
    ap.add_argument("--batch", type=int, default=8, help="global batch: sequences per step")
    ap.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval in steps")
    ap.add_argument("--out", default="runs/quickstart", help="output directory")
    main(ap.parse_args())

"""The demo training run behind ``python -m funshard train``.

Until the full demo (a small GPT) lands this trains a tiny MLP regression on 2 gloo ranks with
``shard`` / ``unshard`` / ``adamw`` and prints the loss every few steps.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import funshard as fs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    mesh = fs.make_mesh(device_type="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 1))
    params = fs.shard(fs.params(model), mesh)
    opt = fs.optim.adamw(lr=3e-3)
    state = opt.init(params)
    true_w = torch.randn(16, 1)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = torch.sin(x @ true_w)
        full = fs.unshard(params)
        loss = F.mse_loss(torch.func.functional_call(model, full, (x,)), y)
        loss.backward()
        grads = fs.pytree.tree_map(lambda p: p.grad, params)
        params, state = opt.update(grads, state, params, step=step)
        for p in fs.pytree.leaves(params):
            p.grad = None
        if rank == 0 and (step % 20 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="funshard")
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="train a small model on local CPU ranks")
    train.add_argument("--world", type=int, default=2)
    train.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.world < 1 or args.steps < 1:
        parser.error("--world and --steps must be >= 1")
    mp.spawn(_train, args=(args.world, _free_port(), args.steps), nprocs=args.world)
    return 0





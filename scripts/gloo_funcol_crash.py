"""Torch alone (no funshard in the step): expert-parallel exchanges made with torch's
functional collectives and left in flight on gloo crash a rank now and then.

What a test of Mixtral's experts did before it waited on each exchange at once: 4 gloo ranks
on a (2, 2) mesh, each step all-gathers the tokens, their routing weights and expert choices
over "ep" (async results, waited on at first use), runs each rank's experts, reduce-scatters
the outputs, then backward and an all-reduce of the gradients. Measured 2026-11-29 with
torch 2.13.0+cpu on a 2-core machine: a rank died in a gloo thread (SIGSEGV or SIGABRT,
"malloc(): unaligned tcache chunk detected") after 175 runs of 3 steps; with
``--wait-at-once`` (each result cloned as it comes, which waits on it, as torch's own test
``ExpertParallel`` waits) none did in 800; nor in 1,200 runs of the same exchanges made with
``torch.distributed``'s own async ops (``async_op=True``, three in flight, each waited on
at first use): the crash needs the functional collectives. Run from the repository root::

    python scripts/gloo_funcol_crash.py --runs 1000 [--wait-at-once]

It exits 1 at the first crash, with the pool's report (the crashed rank's Python stacks).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

_RS = (getattr(funcol, "reduce_scatter_single_autograd", None)
       or funcol.reduce_scatter_tensor_autograd)
_MESH: dict = {}
warnings.filterwarnings("ignore", category=FutureWarning)  # the names torch 2.11 has too


def steps(n: int, at_once: bool) -> bool:
    """``n`` steps of a two-expert layer per rank on "ep" (see the module's note)."""
    if "m" not in _MESH:
        _MESH["m"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep = _MESH["m"]["ep"]
    pg, r = ep.get_group(), ep.get_local_rank()
    now = (lambda t: t.clone()) if at_once else (lambda t: t)
    torch.manual_seed(0)
    experts = torch.nn.Parameter(torch.randn(2, 16, 16))
    router = torch.nn.Parameter(torch.randn(16, 4))
    for s in range(n):
        g = torch.Generator().manual_seed(s * 4 + dist.get_rank())
        h = torch.randn(32, 16, generator=g)
        w, idx = (h @ router).softmax(-1).topk(2, -1)
        hs = now(funcol.all_gather_tensor_autograd(h, 0, pg))
        ws = now(funcol.all_gather_tensor_autograd(w, 0, pg))
        mine = now(funcol.all_gather_tensor(idx, 0, pg)) - 2 * r
        out = torch.zeros_like(hs)
        for e in range(2):
            tok, pos = torch.where(mine == e)
            out = out.index_add(0, tok, (hs[tok] @ experts[e]) * ws[tok, pos, None])
        now(_RS(out, "sum", 0, pg)).square().mean().backward()
        for p in (experts, router):
            dist.all_reduce(p.grad)
            with torch.no_grad():
                p -= 0.01 * p.grad
            p.grad = None
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--wait-at-once", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from funshard.testing import Pool, RankError

    with Pool(4) as pool:
        for i in range(a.runs):
            try:
                pool.run(steps, 3, a.wait_at_once)
            except RankError as e:
                print(f"run {i + 1} of {a.runs}: a rank crashed\n{e}", flush=True)
                sys.exit(1)
    print(f"{a.runs} runs, no crash (torch {torch.__version__})")


if __name__ == "__main__":
    main()

"""``--simulate WORLD``: funshard's per-rank memory and traffic on a big mesh, from
:func:`funshard.plan.plan` alone (no processes, no collectives).

    python -m benchmarks.bench --simulate 1024 --mesh 8x128 --params 7e9 --vocab 32000 \\
        --seq 2048 --param-dtype bfloat16
"""

from __future__ import annotations

import torch

from funshard import Policy
from funshard import plan as planlib
from funshard.testing.models import GPT

from .report import SHORT


def simulate(args) -> dict:
    """Per-rank memory and traffic of funshard on a big mesh, from arithmetic alone."""
    world = args.simulate
    if args.mesh:
        rep, sh = (int(x) for x in args.mesh.lower().split("x"))
    else:
        rep = args.replicate
        sh = args.shard or world // rep
    if rep * sh != world:
        raise SystemExit(f"bench --simulate: mesh {rep} x {sh} = {rep * sh} ranks, but WORLD is "
                         f"{world}; pass --mesh RxS with R*S == {world}.")
    if args.params:
        dims = planlib.gpt_dims(args.params, vocab=args.vocab, seq=args.seq)
    else:
        dims = {"vocab": args.vocab, "dim": args.dim, "heads": max(1, args.dim // 64),
                "layers": args.blocks, "seq": args.seq}
    with torch.device("meta"):
        model = GPT(**dims)
    pdt = getattr(torch, args.param_dtype) if args.param_dtype else None
    out = {"model": dims, "mesh": {"replicate": rep, "shard": sh}, "param_dtype": str(pdt),
           "policies": {}}
    gib = 2**30
    lines = []
    for name, raf in (("FULL_SHARD", True), ("SHARD_GRAD_OP", False)):
        p = planlib.plan(model, shard=sh, replicate=rep,
                         policy=Policy(reshard_after_forward=raf, param_dtype=pdt),
                         **planlib.gpt_order(dims["layers"]))
        out["numel"] = p.numel
        out["policies"][name] = {"memory": p.memory,
                                 "comms": {k: t._asdict() for k, t in p.comms.items()},
                                 "bound": {k: t._asdict() for k, t in p.bound.items()}}
        mem = p.memory
        traffic = "; ".join(f"{t.count} {SHORT.get(k, k)} {t.bytes / gib:.2f} GiB "
                            f"({t.wire / gib:.2f} sent)" for k, t in p.comms.items())
        lines.append(f"| {name} | {mem['params'] / gib:.3f} | {mem['grads'] / gib:.3f} | "
                     f"{mem['optimizer'] / gib:.3f} | {mem['unsharded_peak'] / gib:.3f} | "
                     f"{mem['reduce_buffers'] / gib:.3f} | {mem['total'] / gib:.3f} | "
                     f"{traffic} |")
    print(f"funshard plan: GPT {dims['layers']} x {dims['dim']} (vocab {dims['vocab']}, seq "
          f"{dims['seq']}) = {out['numel'] / 1e9:.2f} B params; mesh {rep} x {sh} = {world} ranks"
          f"; params {pdt or 'float32'}, AdamW; per rank, per step, activations excluded\n")
    print("| policy | params GiB | grads GiB | AdamW state GiB | unsharded peak GiB | "
          "reduce buffers GiB | total GiB | collectives / step (logical, sent per rank) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(lines))
    return out

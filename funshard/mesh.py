"""Meshes: ``make_mesh``, the process-group set-up, and the names of a mesh's dimensions.

A funshard mesh is 1-D ``("shard",)`` or 2-D ``("replicate", "shard")``: parameters are
``Shard(0)`` on ``"shard"`` and ``Replicate()`` on ``"replicate"`` (HSDP).

    >>> mesh = make_mesh(shard=2)                  # 1-D, 2 ranks
    >>> mesh = make_mesh(shard=2, replicate=2)     # 2-D, 4 ranks
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARD = "shard"
REPLICATE = "replicate"


def mesh_str(mesh: DeviceMesh) -> str:
    """``DeviceMesh('replicate': 2, 'shard': 2; cpu)``: how errors name a mesh."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n!r}: {s}" for n, s in zip(names, mesh.shape))
    return f"DeviceMesh({dims}; {mesh.device_type})"


def shard_dim(mesh: DeviceMesh, *, where: str = "") -> int:
    """Index of the mesh's ``"shard"`` dimension; ValueError naming the mesh if absent."""
    names = mesh.mesh_dim_names or ()
    if SHARD not in names:
        raise ValueError(
            f"{where}mesh {mesh_str(mesh)} has no {SHARD!r} dimension; funshard shards over a "
            f"mesh dimension named {SHARD!r} (and replicates over {REPLICATE!r}). Build the mesh "
            "with fs.make_mesh(shard=..., replicate=...)."
        )
    for name in names:
        if name not in (SHARD, REPLICATE):
            raise ValueError(
                f"{where}mesh {mesh_str(mesh)} has a dimension {name!r}; funshard meshes have only "
                f"{REPLICATE!r} and {SHARD!r} dimensions. Build the mesh with fs.make_mesh(...)."
            )
    return names.index(SHARD)


def process_groups(mesh: DeviceMesh):
    """``(shard group, replicate group or None)`` of a funshard mesh."""
    shard_pg = mesh.get_group(SHARD)
    rep_pg = mesh.get_group(REPLICATE) if REPLICATE in mesh.mesh_dim_names else None
    return shard_pg, rep_pg


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors live on for ``mesh`` (the current CUDA device)."""
    return rank_device(mesh.device_type)


def rank_device(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: the current CUDA device, or the type itself."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def replicas(mesh: DeviceMesh) -> int:
    """Size of the ``"replicate"`` dimension (1 on a 1-D mesh)."""
    return dict(zip(mesh.mesh_dim_names, mesh.shape)).get(REPLICATE, 1)


def under_torchrun() -> bool:
    """True when torchrun / torch elastic set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_process_group(device_type: str, timeout: float | None) -> None:
    if dist.is_initialized():
        _at_exit_let_gloo_finish(str(dist.get_backend()))
        return
    kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if under_torchrun():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # A restarted elastic job reuses the agent's store, where the dead workers'
            # addresses still sit under the default keys: key this attempt's group apart.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=kw.get("timeout", timedelta(minutes=5)),
            )
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"funshard/attempt_{attempt}", store),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kw,
            )
        else:
            dist.init_process_group(backend, **kw)
    else:  # a plain single process: a world of one (NCCL for CUDA tensors, gloo for CPU)
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    _at_exit_let_gloo_finish(backend)


_REGISTERED: list = []


def _at_exit_let_gloo_finish(backend: str) -> None:
    """Once per process with a gloo group, at exit: :func:`_let_gloo_finish`."""
    if "gloo" in backend and not _REGISTERED:
        _REGISTERED.append(atexit.register(_let_gloo_finish))


def _let_gloo_finish() -> None:
    """At exit of a process with a gloo group funshard uses: give gloo's worker threads the
    GIL for a moment. A worker drops a finished collective's work after the caller's wait
    returns; if the caller already let go of the tensors, dropping them takes the GIL, and
    once Python is finalizing a thread that asks for the GIL is ended inside a destructor:
    SIGABRT, "terminate called without an active exception", after the process's last
    line (gdb: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``take_gil``).
    It struck a rank that ended right after its last step, about 1 run in 8."""
    time.sleep(0.02)  # releases the GIL


def make_mesh(
    shard: int | None = None,
    replicate: int = 1,
    *,
    device_type: str | None = None,
    timeout: float | None = None,
) -> DeviceMesh:
    """A ``("shard",)`` or ``("replicate", "shard")`` DeviceMesh over all ranks.

    Initialises the default process group from torchrun's environment when needed (NCCL on
    CUDA, gloo on CPU); a single process without that environment gets a world of 1.

    Args:
        shard: ranks per shard group (default: world size // replicate).
        replicate: number of replicas (HSDP); 1 gives a 1-D mesh.
        device_type: "cuda" or "cpu" (default: cuda when available).
        timeout: seconds a collective may wait before it fails with a timeout error on
            every rank (default: torch's, 10-30 minutes); used when this call initialises
            the process group.
    Returns:
        DeviceMesh; ``make_mesh(shard=2, replicate=2)`` on 4 ranks -> 2x2.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for name, v in (("shard", shard), ("replicate", replicate)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"make_mesh: {name}={v!r} must be a positive int")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"make_mesh: timeout={timeout!r} must be a positive number of seconds")
    _init_process_group(device_type, timeout)
    world = dist.get_world_size()
    if world % replicate:
        raise ValueError(
            f"make_mesh: replicate={replicate} does not divide the world size {world}; "
            f"choose replicate from the divisors of {world}."
        )
    if shard is None:
        shard = world // replicate
    if shard * replicate != world:
        raise ValueError(
            f"make_mesh: shard={shard} x replicate={replicate} = {shard * replicate} ranks, but "
            f"the world has {world}; the mesh must cover every rank "
            f"(e.g. shard={world // replicate})."
        )
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=(SHARD,))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))

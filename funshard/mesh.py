"""Meshes: ``make_mesh``, the process-group set-up, and the names of a mesh's dimensions.

A funshard mesh has a ``"shard"`` dimension and, for HSDP, a ``"replicate"`` one before it:
the data-parallel dimensions, where parameters are ``Shard(0)`` and ``Replicate()``. Any other
named dimension after them is the model's own (expert parallel: ``"ep"``; tensor parallel:
``"tp"``): its placements are the model's (torch's ``parallelize_module``), and funshard
shards each leaf's part on those dimensions over the data-parallel ones, as FSDP2 composes
with tensor and expert parallelism. The ranks of a ``"tp"`` group compute on the same rows
of the batch; those of an ``"ep"`` group on different rows (the model exchanges tokens
between them), so a leaf the model keeps whole there has its gradient averaged over it too.

    >>> mesh = make_mesh(shard=2)                  # 1-D, 2 ranks
    >>> mesh = make_mesh(shard=2, replicate=2)     # 2-D, 4 ranks
    >>> mesh = make_mesh(shard=2, tp=2)            # ("shard", "tp"), 4 ranks; mesh["tp"]
    >>> mesh = make_mesh(shard=2, ep=2)            # ("shard", "ep"): experts on mesh["ep"]

[Note: the model's own dimensions]

On a mesh with dimensions past ``"replicate"`` and ``"shard"`` (``"ep"``, ``"tp"``) a leaf's
placements there are the model's, and funshard works on the part of the leaf this rank
holds under them exactly as it works on a whole leaf elsewhere: its
:class:`funshard.layout.Layout` is laid out over the part (``shape`` is the part's) and
records the model's placements (:class:`funshard.layout.Model`); what is gathered is the
part, and what the model is given (:func:`funshard.layout.as_model`) is that part as the
model's DTensor again, through ``DTensor.from_local``, whose backward hands the part's
gradient back (reduced over the model's dimension first where the model left it pending).
So every collective and transport stays as it is, and the model's collectives the model's.

Three choices, and why:

- *The placement on "shard"*: when the model splits dim 0 too, funshard's rows are rows of
  the model's part, which DTensor calls a strided shard (``_StridedShard(0,
  split_factor=...)``, the placement FSDP2 gives the same leaf); with a plain ``Shard(0)``
  DTensor would read the leaf as another tensor (``full_tensor``, ``redistribute``, a
  checkpoint's resharding). It is torch's private class, found in :mod:`funshard._compat`.
- *Which mesh a leaf lives on*: a placement cannot say whether the model holds a leaf as a
  DTensor or as a plain tensor (a sequence-parallel norm weight is a DTensor
  ``Replicate()`` on "tp", a norm the plan leaves alone a plain tensor, both the same on
  every rank), so the leaf's mesh says it: a leaf lives on the data-parallel dimensions,
  "ep", and the model's dimensions it is placed on; a plain one on the data-parallel ones
  and "ep". :func:`funshard.layout.describe` takes the widest of these as the tree's mesh.
- *"ep" apart from "tp"*: the ranks of a "tp" group compute on the same rows and hold parts
  (or copies) of a leaf; those of "ep" compute on other rows. So a leaf only replicated on
  "ep" is plain to the model and its gradient is averaged over "ep" too
  (:func:`funshard.layout.spread_of`), while an expert (sharded on "ep") already holds every
  "ep" rank's rows in its gradient and is reduced over "shard" only; the mean divides by
  every part of the batch (:func:`data_size`).
"""

from __future__ import annotations

import atexit
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARD = "shard"
REPLICATE = "replicate"
TP = "tp"
EP = "ep"
DATA = (REPLICATE, SHARD)  # the data-parallel dimensions' names
SPLITS = (EP,)  # the model's own dimensions whose ranks compute on different rows


def mesh_str(mesh: DeviceMesh) -> str:
    """``DeviceMesh('replicate': 2, 'shard': 2; cpu)``: how errors name a mesh."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n!r}: {s}" for n, s in zip(names, mesh.shape))
    return f"DeviceMesh({dims}; {mesh.device_type})"


def shard_dim(mesh: DeviceMesh, *, where: str = "", model: bool = False) -> int:
    """Index of the mesh's ``"shard"`` dimension; ValueError naming the mesh if absent, or if
    the mesh has a dimension other than the data-parallel ones where the caller has no use
    for it (``model``: the caller composes with the model's own dimensions)."""
    names = mesh.mesh_dim_names or ()
    if SHARD not in names:
        raise ValueError(
            f"{where}mesh {mesh_str(mesh)} has no {SHARD!r} dimension; funshard shards over a "
            f"mesh dimension named {SHARD!r} (and replicates over {REPLICATE!r}). Build the mesh "
            "with fs.make_mesh(shard=..., replicate=..., tp=...)."
        )
    others = [n for n in names if n not in DATA]
    if others and not model:
        raise ValueError(
            f"{where}mesh {mesh_str(mesh)} has the model's own dimension {others[0]!r} (tensor "
            "or expert parallel), which this does not compose with yet. fs.shard, fs.unshard, "
            "fs.reshard, fs.reduce_grads, the optimizers (Muon aside), fs.state_dict / "
            "fs.load_state_dict and fs.checkpoint do; the training and evaluation steps take "
            f"meshes of {REPLICATE!r} and {SHARD!r} only for now."
        )
    late = [n for n in names[:names.index(SHARD)] if n != REPLICATE]
    late += [n for i, n in enumerate(others) if n in SPLITS and
             any(m not in SPLITS for m in others[:i])]
    if late or REPLICATE in names[names.index(SHARD):]:
        bad = late[0] if late else REPLICATE
        raise ValueError(
            f"{where}mesh {mesh_str(mesh)}: its dimension {bad!r} is out of order; the "
            f"dimensions come as {REPLICATE!r}, {SHARD!r}, then the model's own, {EP!r} before "
            f"{TP!r}, as fs.make_mesh(replicate=..., shard=..., ep=..., tp=...) builds them."
        )
    return names.index(SHARD)


def model_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of ``mesh``'s dimensions that are the model's own (not data-parallel)."""
    return tuple(n for n in (mesh.mesh_dim_names or ()) if n not in DATA)


def data_size(mesh: DeviceMesh) -> int:
    """How many parts of the batch the ranks compute on, which a mean gradient is over:
    ``"replicate"`` x ``"shard"`` x ``"ep"``."""
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    return sizes[SHARD] * math.prod(sizes.get(n, 1) for n in (REPLICATE, *SPLITS))


def submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]``, the same object for the same mesh and names (a slice is a new mesh
    each time it is taken)."""
    if tuple(mesh.mesh_dim_names) == names:
        return mesh
    key = (id(mesh), names)
    hit = _SUBMESHES.get(key)
    if hit is None or hit[0] is not mesh:
        hit = _SUBMESHES[key] = (mesh, mesh[names])
    return hit[1]


_SUBMESHES: dict = {}


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
    ep: int = 1,
    tp: int = 1,
    device_type: str | None = None,
    timeout: float | None = None,
) -> DeviceMesh:
    """A ``("shard",)`` or ``("replicate", "shard")`` DeviceMesh over all ranks, with an
    ``"ep"`` and a ``"tp"`` dimension after them when ``ep > 1`` / ``tp > 1``.

    Initialises the default process group from torchrun's environment when needed (NCCL on
    CUDA, gloo on CPU); a single process without that environment gets a world of 1.

    Args:
        shard: ranks per shard group (default: world size // replicate).
        replicate: number of replicas (HSDP); 1 gives a 1-D mesh.
        ep: ranks per expert-parallel group: ``mesh["ep"]`` is what the model's experts are
            placed on (each rank owns whole experts; the model exchanges the tokens).
        tp: ranks per tensor-parallel group, the innermost dimension (neighbouring ranks,
            one host's GPUs): ``mesh["tp"]`` is what ``parallelize_module`` takes.
        device_type: "cuda" or "cpu" (default: cuda when available).
        timeout: seconds a collective may wait before it fails with a timeout error on
            every rank (default: torch's, 10-30 minutes); used when this call initialises
            the process group.
    Returns:
        DeviceMesh; ``make_mesh(shard=2, replicate=2)`` on 4 ranks -> 2x2.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for name, v in (("shard", shard), ("replicate", replicate), ("ep", ep), ("tp", tp)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"make_mesh: {name}={v!r} must be a positive int")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"make_mesh: timeout={timeout!r} must be a positive number of seconds")
    _init_process_group(device_type, timeout)
    world = dist.get_world_size()
    outer = replicate * ep * tp
    if world % outer:
        raise ValueError(
            f"make_mesh: replicate={replicate} x ep={ep} x tp={tp} = {outer} does not divide "
            f"the world size {world}; choose them from the divisors of {world}."
        )
    if shard is None:
        shard = world // outer
    if shard * outer != world:
        raise ValueError(
            f"make_mesh: shard={shard} x replicate={replicate} x ep={ep} x tp={tp} = "
            f"{shard * outer} ranks, but the world has {world}; the mesh must cover every "
            f"rank (e.g. shard={world // outer})."
        )
    dims = [(REPLICATE, replicate)] if replicate > 1 else []
    dims += [(SHARD, shard)] + [(n, v) for n, v in ((EP, ep), (TP, tp)) if v > 1]
    return init_device_mesh(device_type, tuple(n for _, n in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))


def data_parallel(mesh: DeviceMesh, *, shard: str, replicate: str | None = None) -> DeviceMesh:
    """A mesh the caller built, its data-parallel dimensions named as funshard names them.

    ``shard`` (and ``replicate``) name the dimensions to shard (and replicate) parameters
    over; every other dimension is the model's own and keeps its name (``"tp"``, ``"ep"``),
    so ``data_parallel(mesh, ...)["tp"] == mesh["tp"]``: a model parallelized on the
    caller's mesh composes with it. The same ranks in the same layout, with process groups
    of its own (made once here).

    Example: ``mesh = init_device_mesh("cuda", (8, 4), mesh_dim_names=("dp", "tp"))``;
    ``fs.shard(fs.params(model), fs.mesh.data_parallel(mesh, shard="dp"))``.
    """
    names = list(mesh.mesh_dim_names or ())
    for role, name in ((SHARD, shard), (REPLICATE, replicate)):
        if name is not None and name not in names:
            raise ValueError(f"data_parallel: {role}={name!r} is not a dimension of "
                             f"{mesh_str(mesh)}")
        if name is not None and name != role and role in names:
            raise ValueError(f"data_parallel: {mesh_str(mesh)} already has a dimension "
                             f"{role!r}; name another one {role!r} only if it has none")
    renamed = tuple({shard: SHARD, replicate: REPLICATE}.get(n, n) for n in names)
    if renamed == tuple(names):
        return mesh
    out = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=renamed)
    shard_dim(out, where="data_parallel: ", model=True)  # the order funshard takes
    return out

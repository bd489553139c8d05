"""The test lane: the device the ranks' meshes live on, and the mesh specs tests name.

``FUNSHARD_TEST_DEVICE`` (``cpu``, the default, or ``cuda``) names the device
(:data:`DEVICE`, :func:`device`). A mesh spec is an int (1-D, ``("shard",)``) or a string
:func:`_sizes` reads: ``"2x2"`` (replicate x shard), ``"1x2x2"`` (and tp), ``"1x2x2ep"``
(and ep), ``"1x1x2x2"`` (ep and tp); inside a rank's function :func:`mesh` gives the mesh
of a spec, made once per worker.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

MeshSpec = "int | str"
DEVICE = os.environ.get("FUNSHARD_TEST_DEVICE", "cpu")  # the lane's device type
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"FUNSHARD_TEST_DEVICE={DEVICE!r}: use cpu or cuda")


def world_of(spec) -> int:
    """Processes a mesh spec needs: ``4`` -> 4, ``"2x2"`` -> 4, ``"1x2x2ep"`` -> 4.

    Raises:
        TypeError: ``spec`` is neither an int nor a string.
        ValueError: ``spec`` is not an int >= 1 nor a string :func:`_sizes` reads.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"mesh spec {spec}: a 1-D mesh needs >= 1 rank")
        return spec
    return math.prod(_sizes(spec).values())


_NAMES = {(2, False): ("replicate", "shard"), (3, False): ("replicate", "shard", "tp"),
          (3, True): ("replicate", "shard", "ep"), (4, False): ("replicate", "shard", "ep", "tp")}


def _sizes(spec) -> dict[str, int]:
    """A string mesh spec's ``make_mesh`` sizes: ``"RxS"`` (replicate x shard), ``"RxSxT"``
    (and tp), ``"RxSxEep"`` (and ep), ``"RxSxExT"`` (ep and tp)."""
    if not isinstance(spec, str):
        raise TypeError(f"mesh spec {spec!r}: use an int (1-D, e.g. 4) or 'RxS' (2-D, e.g. "
                        "'2x2': replicate x shard)")
    parts = spec.removesuffix("ep").split("x")
    names = _NAMES.get((len(parts), spec.endswith("ep")))
    if names is None or not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise ValueError(f"mesh spec {spec!r}: a 2-D spec is 'RxS' with R, S >= 1 (replicate "
                         "x shard), e.g. '2x2'; 'RxSxT' adds a tensor-parallel dimension of T "
                         "(replicate x shard x tp), e.g. '1x2x2'; 'RxSxEep' an expert-parallel "
                         "one, e.g. '1x2x2ep'; 'RxSxExT' both, e.g. '1x1x2x2'")
    return dict(zip(names, map(int, parts)))


def device() -> torch.device:
    """This process's device in the lane: the CPU, or its current GPU."""
    from ..mesh import rank_device

    return rank_device(DEVICE)


def devices_for(world: int) -> str:
    """'' when this machine can run ``world`` ranks on the lane's device, else why not."""
    if DEVICE == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world:
            return (f"needs {world} GPU{'s' if world > 1 else ''} (one per rank: NCCL ranks "
                    f"cannot share one); this machine has {n}")
    return ""


_MESHES: dict = {}  # per worker process: mesh spec -> DeviceMesh (process groups are costly)


def mesh(spec=None):
    """A cached mesh in a worker: ``n`` -> 1-D ("shard",) of n; a string -> ``make_mesh`` of
    :func:`_sizes`."""
    from .. import make_mesh

    spec = dist.get_world_size() if spec is None else spec
    kw = {"device_type": DEVICE}
    if spec not in _MESHES:
        if isinstance(spec, int):
            _MESHES[spec] = make_mesh(shard=spec, **kw)
        else:
            _MESHES[spec] = make_mesh(**_sizes(spec), **kw)
    return _MESHES[spec]

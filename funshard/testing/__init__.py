"""Test harness and measuring tools: multi-process pool, the one collective counter, live
tensor memory, parity inputs, small reference models.

    >>> from funshard.testing import Pool, mesh, CountCollectives
    >>> with Pool(2) as pool:
    ...     pool.run(my_module.check_roundtrip, (7, 3))   # -> [result_rank0, result_rank1]

``pool`` (Pool, Pools), ``lane`` (mesh specs, mesh, DEVICE / device / devices_for), ``parity``
(assert_parity: N ranks against one process), ``counting`` (classify, CountCollectives),
``memory`` (LiveMemory, LivePeak, tensor_bytes), ``tensors`` (make_tensor, capture, stepped),
``launch`` (free_port, under_torchrun), ``models`` (GPT, MLP, gpt_loss, mse_loss, MatMulT).
``strategies`` (hypothesis strategies: shapes, dtypes, trees, meshes, policies) needs
hypothesis and is imported by name; ``plugin`` is the pytest plugin (the ``funshard_pool``
fixture), which pytest loads by itself.
"""

from . import models
from .counting import CountCollectives, classify
from .launch import free_port, under_torchrun
from .lane import DEVICE, MeshSpec, device, devices_for, mesh, world_of
from .memory import LiveMemory, LivePeak, tensor_bytes
from .parity import assert_parity
from .pool import Pool, Pools, RankError
from .tensors import TEST_DTYPES, capture, make_tensor, stepped

__all__ = [
    "DEVICE",
    "models",
    "TEST_DTYPES",
    "CountCollectives",
    "LiveMemory",
    "LivePeak",
    "MeshSpec",
    "Pool",
    "Pools",
    "RankError",
    "assert_parity",
    "capture",
    "stepped",
    "classify",
    "device",
    "devices_for",
    "free_port",
    "make_tensor",
    "mesh",
    "tensor_bytes",
    "under_torchrun",
    "world_of",
]

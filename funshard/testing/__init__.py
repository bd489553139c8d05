"""Test harness and measuring tools: multi-process pool, the one collective counter, live
tensor memory, parity inputs, small reference models.

    >>> from funshard.testing import Pool, mesh, CountCollectives
    >>> with Pool(2) as pool:
    ...     pool.run(my_module.check_roundtrip, (7, 3))   # -> [result_rank0, result_rank1]

``pool`` (Pool, mesh, the lane's DEVICE / device / devices_for), ``counting`` (classify,
CountCollectives), ``memory`` (LiveMemory, LivePeak, tensor_bytes), ``tensors`` (make_tensor,
capture), ``launch`` (free_port, under_torchrun), ``models`` (GPT, MLP, gpt_loss, mse_loss,
MatMulT).
"""

from . import models
from .counting import CountCollectives, classify
from .launch import free_port, under_torchrun
from .memory import LiveMemory, LivePeak, tensor_bytes
from .pool import DEVICE, MeshSpec, Pool, RankError, device, devices_for, mesh, world_of
from .tensors import TEST_DTYPES, capture, make_tensor

__all__ = [
    "DEVICE",
    "models",
    "TEST_DTYPES",
    "CountCollectives",
    "LiveMemory",
    "LivePeak",
    "MeshSpec",
    "Pool",
    "RankError",
    "capture",
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

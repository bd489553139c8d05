"""Test harness and measuring tools: multi-process pool, the one collective counter, live
tensor memory, parity inputs, small reference models.

    >>> from funshard.testing import Pool, mesh, CountCollectives
    >>> with Pool(2) as pool:
    ...     pool.run(my_module.check_roundtrip, (7, 3))   # -> [result_rank0, result_rank1]

``pool`` (Pool, mesh), ``counting`` (classify, CountCollectives), ``memory`` (LiveMemory,
LivePeak, tensor_bytes), ``tensors`` (make_tensor, capture), ``launch`` (free_port,
under_torchrun), ``models`` (GPT, MLP, gpt_loss, mse_loss).
"""

from . import models
from .counting import CountCollectives, classify
from .launch import free_port, under_torchrun
from .memory import LiveMemory, LivePeak, tensor_bytes
from .pool import MeshSpec, Pool, RankError, mesh, world_of
from .tensors import TEST_DTYPES, capture, make_tensor

__all__ = [
    "TEST_DTYPES",
    "CountCollectives",
    "LiveMemory",
    "LivePeak",
    "MeshSpec",
    "Pool",
    "RankError",
    "capture",
    "classify",
    "free_port",
    "make_tensor",
    "mesh",
    "tensor_bytes",
    "under_torchrun",
    "world_of",
]

"""Disk full mid-save (RLIMIT_FSIZE): run by tests/test_faults.py as ``python ... DIR``."""

import resource
import signal
import sys

import torch

import funshard as fs

path = f"{sys.argv[1]}/ckpt"
mesh = fs.make_mesh()
old = fs.shard({"w": torch.arange(64.0).view(8, 8)}, mesh)
fs.checkpoint.save(path, old)
new = fs.shard({"w": torch.randn(512, 512)}, mesh)  # 1 MiB: cannot fit under the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
try:
    fs.checkpoint.save(path, new)
    print("NO ERROR")
    sys.exit(1)
except fs.checkpoint.CheckpointError as e:
    print(f"RAISED: {e}")
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
back = fs.checkpoint.load(path, like=old)
print("PREVIOUS INTACT" if torch.equal(back["w"].full_tensor(), old["w"].full_tensor()) else
      "PREVIOUS BROKEN")
import os

print("LEFTOVERS", sorted(n for n in os.listdir(sys.argv[1]) if n != "ckpt"))

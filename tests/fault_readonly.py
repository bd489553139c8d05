"""Save into a read-only directory: run by tests/test_faults.py as ``python ... DIR``.

Root ignores permission bits, so the script saves the previous checkpoint as root, makes the
directory read-only and drops to the unprivileged user ``nobody`` before saving again.
"""

import os
import sys

import torch

import funshard as fs

base = sys.argv[1]
path = f"{base}/ckpt"
os.chmod(base, 0o755)
mesh = fs.make_mesh()
old = fs.shard({"w": torch.arange(64.0).view(8, 8)}, mesh)
fs.checkpoint.save(path, old)
for root, dirs, files in os.walk(base):
    for name in dirs + files:
        os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
os.chmod(base, 0o555)
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)  # nobody: permission bits apply from here on
try:
    fs.checkpoint.save(path, fs.shard({"w": torch.zeros(8, 8)}, mesh))
    print("NO ERROR")
except (fs.checkpoint.CheckpointError, PermissionError) as e:
    print(f"RAISED {type(e).__name__}: {e}")
back = fs.checkpoint.load(path, like=old)
print("PREVIOUS INTACT" if torch.equal(back["w"].full_tensor(), old["w"].full_tensor()) else
      "PREVIOUS BROKEN")

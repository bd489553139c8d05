"""Faults: a stuck collective times out with a clear error instead of hanging."""

import socket
import subprocess
import sys
from pathlib import Path


def test_stuck_rank_times_out_with_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("fault_timeout.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out, err = procs[0].communicate(timeout=120)
    procs[1].kill()
    procs[1].wait()
    assert procs[0].returncode == 0, err[-2000:]
    assert out.startswith("TIMEOUT after "), out
    seconds = float(out.split()[2].rstrip("s:"))
    assert 1.5 <= seconds <= 10, out  # the configured 2 s, not a default of minutes
    assert "all-gather on mesh dimension 'shard'" in out and "make_mesh(timeout=...)" in out
    assert "another rank is stuck, died, or issued a different collective" in out


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path):
    script = Path(__file__).with_name("fault_disk_full.py")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout  # one clear line of error, no tracebacks
    assert lines[0].startswith("RAISED: save to ") and "failed on rank 0" in lines[0], out.stdout
    assert lines[1] == "PREVIOUS INTACT", out.stdout
    assert lines[2] == "LEFTOVERS []", out.stdout  # the partial write was cleaned up

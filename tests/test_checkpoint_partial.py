"""A checkpoint call made on some ranks only (funshard.collectives.calls): every rank raises
within the process group's timeout, naming the call and the fix, instead of hanging (or gloo
ending a process on the save's collective paired with a step's)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from funshard.testing import free_port

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_k, None)
TIMEOUT = 4  # make_mesh(timeout=) of the ranks
MARGIN = 3  # seconds past it: the ranks' posted positions are read for up to 1.5 s


def ranks(tmp_path, transport: str, saver: int) -> list[tuple[str, float, str]]:
    """fault_partial_save.py on 2 ranks: per rank ``(type, seconds, message)``."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_partial_save.py"), str(port),
                               str(r), str(TIMEOUT), transport, str(saver), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=ENV) for r in (0, 1)]
    out = []
    for r, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT + 120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} hung: a save on one rank must not hang the run")
        assert p.returncode != -signal.SIGABRT, f"rank {r} aborted: {stderr[-1500:]}"
        line = next((ln for ln in stdout.splitlines() if ln.startswith(("RAISED", "NO ERR"))),
                    "")
        assert line.startswith("RAISED "), f"rank {r}: {stdout[-500:]} {stderr[-2000:]}"
        _, t, rest = line.split(" ", 2)
        kind, msg = rest.split(": ", 1)
        out.append((kind, float(t), msg))
    return out


@pytest.mark.parametrize("transport,saver", [("c10d", 0), ("default", 0), ("c10d", 1)])
def test_a_save_on_some_ranks_only_raises_on_every_rank(tmp_path, transport, saver):
    """The torch.save habit, ``if rank == 0: fs.checkpoint.save(...)``, while the other rank
    makes its next step: both raise by the timeout, naming the save made on some ranks."""
    out = ranks(tmp_path, transport, saver)
    for rank, (kind, seconds, msg) in enumerate(out):
        assert seconds <= TIMEOUT + MARGIN, (rank, seconds, msg)
        assert f"checkpoint.save was called on some ranks only (rank {saver})" in msg, (
            rank, msg)
        assert "every rank must call it" in msg, (rank, msg)
        assert "train_step" in msg, (rank, msg)  # where the other rank is
    assert out[saver][0] == "CollectiveTimeout", out
    assert out[1 - saver][0] in ("CollectiveTimeout", "PeerLost"), out
    assert not os.path.exists(tmp_path / "step_1"), "nothing may be committed"

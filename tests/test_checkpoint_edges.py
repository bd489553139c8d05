"""Checkpoint edge cases, each on 2 ranks: the same error on every rank within seconds.

Bad or differing arguments (nothing written), one rank's unreadable or corrupt file, a stopped
peer during an async save, symlinked paths, concurrent saves to one path, a full disk on one
rank, no checkpoint (``latest`` None, ``load(None)``, a directory), a changed model, long names.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard import checkpoint as ck
from funshard.checkpoint import lock
from funshard.testing import mesh
from funshard.testing.launch import free_port
from funshard.testing.models import MLP

BOUND = 10.0  # seconds any of these errors may take; the pools' timeout is 120 s


def small(m, seed=0, rows=8):
    g = torch.Generator().manual_seed(seed)
    return fs.shard({"w": torch.randn(rows, 4, generator=g), "b": torch.randn(3, generator=g)}, m)


def full(tree):
    return {k: v.full_tensor() for k, v in tree.items()}


def outcome(fn, *args, **kwargs):
    """``(type name, message, seconds)`` of what ``fn`` raised (``("ok", result, s)`` if not)."""
    t = time.monotonic()
    try:
        return "ok", fn(*args, **kwargs), time.monotonic() - t
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return type(e).__name__, str(e), time.monotonic() - t


def assert_every_rank(results, kind, *parts):
    """The same error of ``kind`` on every rank, holding each of ``parts``, within BOUND."""
    msgs = {r[1] for r in results}
    assert len(msgs) == 1, results  # every rank raised the same message
    for name, msg, took in results:
        assert name == kind, (name, msg)
        for p in parts:
            assert p in msg, (p, msg)
        assert took < BOUND, took


# -- arguments: checked on every rank before anything is written ----------------------------


def bad_save_args(spec, d):
    m = mesh(spec)
    rank = dist.get_rank()
    state = small(m)
    cases = {
        "keep=True": lambda: ck.save(f"{d}/step_000001", state, keep=True),
        "keep=0 on rank 1": lambda: ck.save(f"{d}/step_000001", state, keep=0 if rank else None),
        "async_save='yes'": lambda: ck.save(f"{d}/step_000001", state, async_save="yes"),
        "path None": lambda: ck.save(None, state),
        "paths differ": lambda: ck.save(f"{d}/step_00000{rank}", state),
        "trees differ": lambda: ck.save(f"{d}/step_000001", small(m, rows=8 + rank)),
    }
    return {name: outcome(fn) for name, fn in cases.items()}


def test_bad_arguments_raise_on_every_rank_before_writing(pools, tmp_path):
    d = str(tmp_path / "run")
    res = pools.run(2, bad_save_args, d)
    each = {name: [r[name] for r in res] for name in res[0]}
    assert_every_rank(each["keep=True"], "ValueError",
                      "save: keep=True must be an int >= 1 (or None)")
    assert_every_rank(each["keep=0 on rank 1"], "ValueError", "save: keep=0 must be an int >= 1")
    assert_every_rank(each["async_save='yes'"], "TypeError",
                      "save: async_save='yes' must be True or False")
    assert_every_rank(each["path None"], "TypeError",
                      "save: path must be a str or os.PathLike, got NoneType None")
    assert_every_rank(each["paths differ"], "ValueError",
                      "save: ranks were given different arguments: path is "
                      f"'{d}/step_000000' on rank 0 and '{d}/step_000001' on rank 1")
    assert_every_rank(each["trees differ"], "ValueError",
                      "in the keys, 'w' is {'shape': [8, 4], 'dtype': 'float32'} on rank 0 and "
                      "{'shape': [9, 4], 'dtype': 'float32'} on rank 1")
    assert not os.path.exists(d)  # nothing written, not even the directory


# -- load: one rank's read error is every rank's -------------------------------------------


def load_after_damage(spec, path, damage):
    m = mesh(spec)
    ck.save(path, small(m))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, damage), "r+b") as f:  # a byte only rank 1's share checks
            f.seek(20)
            b = f.read(1)
            f.seek(20)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    return outcome(ck.load, path, like=small(m, seed=1))


def test_one_ranks_corrupt_file_is_every_ranks_error(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    # files sorted: .metadata, __0_0.distcp, __1_0.distcp; rank 1 checks every 2nd from 1
    res = pools.run(2, load_after_damage, path, "__0_0.distcp")
    assert_every_rank(res, "CheckpointError", f"incomplete or corrupted checkpoint at {path!r}: "
                      "file '__0_0.distcp' fails its CRC32 check (found by rank 1)")


def run_fault(mode, base, timeout=60, stuck=False):
    """Both ranks of tests/fault_checkpoint.py; -> (rank 0's lines, rank 1's lines).
    ``stuck``: rank 1 never ends by itself; it is killed once rank 0 is done."""
    script = Path(__file__).with_name("fault_checkpoint.py")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), mode, str(port), str(r), base],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = []
    for p in procs:
        if stuck and p is procs[1]:
            p.kill()
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()  # a stopped rank: SIGKILL ends it
            out, err = p.communicate()
        outs.append((out.splitlines(), err))
    return outs


def parse(line):
    """``RAISED 2.1 CheckpointError: msg`` -> ("CheckpointError", "msg", 2.1)."""
    assert line.startswith("RAISED "), line
    took, rest = line[len("RAISED "):].split(" ", 1)
    kind, msg = rest.split(": ", 1)
    return kind, msg, float(took)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run rank 1 as nobody")
def test_one_ranks_unreadable_file_is_every_ranks_error():
    base = Path("/tmp") / f"funshard-unreadable-{os.getpid()}"  # "nobody" must reach it
    base.mkdir(mode=0o755)
    try:
        (out0, err0), (out1, err1) = run_fault("unreadable", str(base))
        assert len(out0) == 2 and len(out1) == 2, (out0, out1, err0[-2000:], err1[-2000:])
        path = f"{base}/ckpt"
        verified = [parse(out0[0]), parse(out1[0])]
        assert_every_rank(verified, "CheckpointError", f"checkpoint at {path!r}: file "
                          "'__0_0.distcp' cannot be read: Permission denied (found by rank 1)")
        read = [parse(out0[1]), parse(out1[1])]
        assert_every_rank(read, "CheckpointError", "reading it failed on rank 1: PermissionError",
                          f"{path}/__1_0.distcp")
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


# -- async saving honours the process group's timeout ----------------------------------------


def test_async_save_with_a_stuck_peer_fails_within_the_timeout(tmp_path):
    (out0, err0), _ = run_fault("async_stuck", str(tmp_path), stuck=True)
    assert len(out0) == 1, (out0, err0[-2000:])
    kind, msg, took = parse(out0[0])
    assert kind == "CollectiveTimeout" and 1.5 <= took <= BOUND, out0  # the 2 s, not 30 min
    assert f"save to '{tmp_path}/ckpt' failed on rank 0: another rank did not answer" in msg
    assert "timeout (2 s; make_mesh(timeout=...)): it is stuck, died, or did not call save" in msg


def test_save_and_load_with_a_stopped_peer_fail_within_the_timeout(tmp_path):
    """The save times out; the load after it is refused at once, naming that timeout: a rank
    whose collective timed out cannot go on ([Note: a rank out of step])."""
    (out0, err0), _ = run_fault("stopped", str(tmp_path), stuck=True)
    assert len(out0) == 2, (out0, err0[-2000:])
    timeout = (f"save to '{tmp_path}/ckpt' failed on rank 0: another rank did not answer "
               "within the process group's timeout (2 s; ")
    kind, msg, took = parse(out0[0])
    assert kind == "CollectiveTimeout" and took <= BOUND and msg.startswith(timeout), out0[0]
    kind, msg, took = parse(out0[1])
    assert kind == "OutOfStep" and took < 1.0, out0[1]
    assert msg.startswith("funshard: rank 0 cannot make another funshard call: its call 2, "
                          f"checkpoint.save('{tmp_path}/ckpt'), raised CollectiveTimeout: "
                          + timeout), msg


# -- symlinks are followed -------------------------------------------------------------------


def save_through_links(spec, d):
    m = mesh(spec)
    os.makedirs(f"{d}/real", exist_ok=True)
    ck.save(f"{d}/real/step_1", small(m, seed=1))
    if dist.get_rank() == 0:
        os.symlink(f"{d}/real/step_1", f"{d}/link")  # to an existing checkpoint
        os.symlink(f"{d}/real/step_2", f"{d}/dangling")  # to none yet
    dist.barrier()
    got = [ck.save(f"{d}/link", small(m, seed=2)), ck.save(f"{d}/dangling", small(m, seed=3))]
    like = small(m, seed=9)
    back = [full(ck.load(p, like=like)) for p in (f"{d}/link", f"{d}/real/step_1",
                                                   f"{d}/dangling", f"{d}/real/step_2")]
    want = [full(small(m, seed=s)) for s in (2, 2, 3, 3)]
    return got, all(all(torch.equal(b[k], w[k]) for k in w) for b, w in zip(back, want))


def test_symlinked_path_is_followed_not_replaced(pools, tmp_path):
    d = str(tmp_path)
    for got, equal in pools.run(2, save_through_links, d):
        assert got == [f"{d}/link", f"{d}/dangling"] and equal
    assert os.readlink(f"{d}/link") == f"{d}/real/step_1"  # still the same links
    assert os.readlink(f"{d}/dangling") == f"{d}/real/step_2"
    assert sorted(os.listdir(d)) == ["dangling", "link", "real"]  # no .old left behind
    assert sorted(os.listdir(f"{d}/real")) == ["step_1", "step_2"]
    os.makedirs(f"{d}/run")
    os.symlink(f"{d}/real/step_1", f"{d}/run/step_000001")  # on another disk, say
    pools.run(2, save_keep, f"{d}/run/step_000002", 1)
    assert os.listdir(f"{d}/run") == ["step_000002"]  # keep=1 pruned the link...
    assert os.listdir(f"{d}/real") == ["step_2"]  # ...and its target


def save_keep(spec, path, keep):
    ck.save(path, small(mesh(spec)), keep=keep)


# -- concurrent saves to one path ------------------------------------------------------------


def two_async_saves(spec, path):
    m = mesh(spec)
    first = ck.save(path, small(m, seed=1, rows=100_000), async_save=True)  # still writing...
    second = ck.save(path, small(m, seed=2), async_save=True)  # ...when this one starts
    done = [outcome(f.result, timeout=60)[:2] for f in (first, second)]
    back = full(ck.load(path, like=small(m, seed=9)))
    return done, all(torch.equal(back[k], v) for k, v in full(small(m, seed=2)).items())


def test_two_async_saves_to_one_path_leave_the_second_complete(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    for done, equal in pools.run(2, two_async_saves, path):
        assert done == [("ok", path), ("ok", path)] and equal  # the first was not disturbed
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporaries, no lock left


def save_seed(spec, path, seed):
    ck.save(path, small(mesh(spec), seed=seed))
    back = full(ck.load(path, like=small(mesh(spec), seed=9)))
    return all(torch.equal(back[k], v) for k, v in full(small(mesh(spec), seed=seed)).items())


def test_a_save_waits_for_another_jobs_save_and_takes_over_a_dead_ones(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    pools.run(2, save_seed, path, 1)
    holder = subprocess.Popen(["sleep", "60"])  # another job, mid-save, on this machine
    try:
        with open(lock.lock_path(path), "w") as f:
            json.dump(dict(lock._me("0123456789ab"), pid=holder.pid,
                           start=lock._start_time(holder.pid)), f)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=pools.run(2, save_seed, path, 2)))
        t.start()
        time.sleep(2.0)
        assert t.is_alive() and sorted(os.listdir(tmp_path)) == [".ckpt.lock", "ckpt"]
        holder.kill()  # it dies without releasing: its claim is stale, the save takes over
        holder.wait()
        t.join(BOUND)
        assert not t.is_alive()
    finally:
        holder.kill()
    assert result["r"] == [True, True]  # the waiting save wrote, complete
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_save_still_locked_after_the_wait_raises_on_every_rank(tmp_path):
    (out0, err0), (out1, err1) = run_fault("locked", str(tmp_path))
    assert len(out0) == 2 and len(out1) == 1, (out0, out1, err0[-2000:], err1[-2000:])
    lock_file = f"{tmp_path}/.ckpt.lock"
    assert_every_rank([parse(out0[0]), parse(out1[0])], "CheckpointError",
                      f"save: another save to '{tmp_path}/ckpt' is still in progress after 1 s "
                      f"({lock_file!r} is held by pid {os.getpid()} on ",
                      f"or remove {lock_file!r} if no save is running")
    assert out0[1] == "LEFT ['.ckpt.lock']"  # nothing written; the other job's lock kept


# -- a full disk on one rank -----------------------------------------------------------------


def disk_full_on_rank1(spec, path):
    import resource

    m = mesh(spec)
    old = small(m, seed=1)
    ck.save(path, old)
    new = small(m, seed=2, rows=2048)  # 16 KiB a rank: over the limit below
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG
    write = ck.saving._write_shards

    def limited(*args):  # rank 1's disk fills as it writes its shards (its posts fail too)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        return write(*args)

    if dist.get_rank() == 1:
        ck.saving._write_shards = limited
    try:
        res = outcome(ck.save, path, new)
    finally:
        ck.saving._write_shards = write
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    back = full(ck.load(path, like=small(m, seed=9)))
    return res, all(torch.equal(back[k], v) for k, v in full(old).items())


def test_disk_full_on_one_rank_says_so_on_every_rank(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    res = pools.run(2, disk_full_on_rank1, path)
    assert_every_rank([r[0] for r in res], "CheckpointError", f"save to {path!r} failed on rank "
                      "1: ", f"; writing '{path}.tmp-", "MiB free on its filesystem; this process "
                      "may write files of at most 4096 bytes (ulimit -f))")
    assert all(intact for _, intact in res)  # the previous checkpoint still loads
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# -- no checkpoint: latest() None, load(None), load(directory) ---------------------------------


def no_checkpoint(spec, d):
    m = mesh(spec)
    os.makedirs(f"{d}/empty", exist_ok=True)
    like = small(m, seed=9)
    found = ck.latest(f"{d}/empty")
    out = [outcome(ck.load, found, like=like), outcome(ck.load, f"{d}/empty", like=like)]
    for step in (5, 10):
        ck.save(f"{d}/run/step_{step:06d}", small(m, seed=step))
    back = full(ck.load(f"{d}/run", like=like))
    return found, out, all(torch.equal(back[k], v) for k, v in full(small(m, seed=10)).items())


def test_no_checkpoint_is_a_clear_error_and_a_directory_loads_its_newest(pools, tmp_path):
    d = str(tmp_path)
    res = pools.run(2, no_checkpoint, d)
    assert all(found is None and newest for found, _, newest in res)
    assert_every_rank([r[1][0] for r in res], "CheckpointError", "load: no checkpoint: path is "
                      "None. fs.checkpoint.latest(dir) returns None when dir holds no complete "
                      "checkpoint: check its result, or pass the directory itself")
    assert_every_rank([r[1][1] for r in res], "CheckpointError",
                      f"load: no checkpoint under '{d}/empty': it holds no complete step_<n> "
                      "checkpoint")


# -- a changed model on resume ----------------------------------------------------------------


def resume_changed(spec, path):
    m = mesh(spec)

    def state(hidden, layers):
        torch.manual_seed(0)
        params = fs.shard(fs.params(MLP(dim=5, hidden=hidden, layers=layers, out=3)), m)
        return fs.TrainState(params, fs.optim.adamw(1e-2).init(params), 0)

    ck.save(path, state(7, 2))
    return outcome(ck.load, path, like=state(9, 4))


def test_changed_model_on_resume_is_a_short_message(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    res = pools.run(2, resume_changed, path)
    assert_every_rank(res, "ValueError", f"load: the checkpoint at {path!r} does not match like",
                      "shape mismatch at 'params.inp.weight': checkpoint (7, 5), like (9, 5)",
                      "missing key 'params.layers.2.0.weight'", "... and 18 more shape mismatches",
                      "Fix: pass like= a state of the same model and optimizer")
    lines = res[0][1].splitlines()
    assert len(lines) <= 12 and "Traceback" not in res[0][1], res[0][1]


# -- very long names ----------------------------------------------------------------------------


def long_names(spec, d):
    m = mesh(spec)
    state = small(m)
    return [outcome(ck.save, f"{d}/{'x' * 250}", state),
            outcome(ck.save, f"{d}/{'y' * 300}/step_000001", state),
            outcome(ck.load, f"{d}/{'x' * 250}", like=state)]


def test_very_long_names_are_a_clear_error(pools, tmp_path):
    d = str(tmp_path)
    res = pools.run(2, long_names, d)
    x = "x" * 40
    assert_every_rank([r[0] for r in res], "ValueError", f"save: the checkpoint name '{x}'... is "
                      "250 bytes; checkpoint names are at most 238 bytes")
    assert_every_rank([r[1] for r in res], "ValueError", f"save: the directory name '{'y' * 40}'"
                      "... in", "is 300 bytes, over this filesystem's limit of 255 bytes per name")
    assert_every_rank([r[2] for r in res], "ValueError", f"load: the checkpoint name '{x}'... is "
                      "250 bytes")
    assert os.listdir(d) == []  # nothing written

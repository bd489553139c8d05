"""A checkpoint from an untrusted source cannot run code (funshard.checkpoint.trust): a pickle
in it that names another global is refused by name on every rank, and nothing runs."""

import dataclasses
import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import funshard as fs
from funshard.checkpoint import MARKER, trust
from funshard.checkpoint.atomic import _crc32
from funshard.testing import mesh

REFUSED = f"{os.system.__module__}.{os.system.__name__}"  # posix.system on Linux


class Evil:
    """Unpickled, it runs a command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def state_of(m):
    g = torch.Generator().manual_seed(0)
    params = fs.shard({"w": torch.randn(8, 4, generator=g), "b": torch.randn(3, generator=g)}, m)
    return {"params": params, "step": 3}


def _reseal(path):
    """Rewrite the marker's sizes and CRC32s for the files as they are now (what whoever
    hands out a crafted checkpoint would do: the marker is plain JSON)."""
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    for name in marker["files"]:
        p = os.path.join(path, name)
        marker["files"][name] = {"bytes": os.path.getsize(p), "crc32": _crc32(p)}
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(marker, f)


def _plant(path, how, marker):
    """Rank 0 replaces a pickle of the saved checkpoint at ``path`` with one that would run
    ``touch marker``."""
    meta = os.path.join(path, ".metadata")
    if how == "metadata":
        with open(meta, "wb") as f:
            pickle.dump(Evil(marker), f)
    elif how == "inside_metadata":  # a real Metadata, one field of it replaced
        md = trust.read_metadata(meta)
        md.planner_data = {"params.w": Evil(marker)}
        with open(meta, "wb") as f:
            pickle.dump(md, f)
    else:  # "value": the pickled non-tensor value of "step", written by DCP itself
        tmp = path + ".evil"
        dcp.save({"step": Evil(marker)}, storage_writer=dcp.FileSystemWriter(tmp),
                 no_dist=True)
        md = trust.read_metadata(os.path.join(tmp, ".metadata"))
        with open(meta, "rb") as f:
            ours = trust.MetadataUnpickler(f, meta).load()
        # the planted value's bytes, appended to rank 0's file, where ours says "step" lies
        info = md.storage_data[next(k for k in md.storage_data if k.fqn == "step")]
        with open(os.path.join(tmp, info.relative_path), "rb") as f:
            f.seek(info.offset)
            planted = f.read(info.length)
        key = next(k for k in ours.storage_data if k.fqn == "step")
        target = os.path.join(path, ours.storage_data[key].relative_path)
        offset = os.path.getsize(target)
        with open(target, "ab") as f:
            f.write(planted)
        ours.storage_data[key] = dataclasses.replace(ours.storage_data[key], offset=offset,
                                                     length=len(planted))
        with open(meta, "wb") as f:
            pickle.dump(ours, f)
    _reseal(path)


def load_planted(spec, path, how, marker):
    m = mesh(spec)
    state = state_of(m)
    fs.checkpoint.save(path, state)
    if dist.get_rank() == 0:
        _plant(path, how, marker)
    dist.barrier()
    try:
        fs.checkpoint.load(path, like=state)
        out = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        out = (type(e).__name__, str(e))
    dist.barrier()
    return out + (os.path.exists(marker),)


@pytest.mark.parametrize("how", ["metadata", "inside_metadata", "value"])
def test_a_planted_pickle_is_refused_by_name_and_never_runs(pools, tmp_path, how):
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "pwned")
    for kind, msg, ran in pools.run(2, load_planted, path, how, marker):
        assert not ran and not os.path.exists(marker), "the planted command ran"
        assert kind == "CheckpointError", (kind, msg)
        assert f"names the global {REFUSED}" in msg, msg
        assert "Load checkpoints only from sources you trust" in msg, msg
        if how == "value":
            assert f"refused to read 'step' of the checkpoint at {path!r}" in msg, msg
        else:
            assert f"refused to read {os.path.join(path, '.metadata')!r}" in msg, msg


def test_metadata_reads_as_pickle_reads_it(tmp_path):
    """Everything DCP writes into .metadata is admitted: the allowlist reads what a plain
    unpickler reads, for every dtype, nested keys and non-tensor values."""
    sd = {f"t_{dt}".replace("torch.", ""): torch.zeros(2, 3, dtype=dt)
          for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                     torch.uint8, torch.complex64)}
    sd.update(step=5, name="x", lr=1e-3, flag=True, none=None, nested={"a": torch.ones(2)})
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    meta = tmp_path / ".metadata"
    with open(meta, "rb") as f:
        plain = pickle.load(f)
    assert repr(trust.read_metadata(meta)) == repr(plain)


def test_a_pickle_that_is_not_metadata_is_refused(tmp_path):
    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(fs.checkpoint.CheckpointError, match="holds a dict, not"):
        trust.read_metadata(meta)
    meta.write_bytes(b"\x80\x04garbage")
    with pytest.raises(fs.checkpoint.CheckpointError, match="cannot read the checkpoint"):
        trust.read_metadata(meta)

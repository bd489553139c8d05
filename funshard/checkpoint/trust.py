"""Reading a checkpoint without running its code: DCP's pickles read through allowlists.

``torch.distributed.checkpoint`` keeps two kinds of pickle in a checkpoint directory: its
``.metadata`` file (read with a plain ``pickle.load`` by its ``FileSystemReader``) and each
non-tensor value (``step``, a Python scalar; read with ``torch.load(weights_only=False)`` by
its ``DefaultLoadPlanner``). A plain unpickler calls whatever global the file names, so a
checkpoint directory from an untrusted source would run code on every rank. :func:`load`
reads both through allowlists instead:

- ``.metadata``: :class:`MetadataUnpickler` admits only what DCP's metadata is made of --
  the dataclasses and enums of ``torch.distributed.checkpoint.metadata`` and
  ``.filesystem``, ``torch.Size``, dtypes, layouts and memory formats, paths and Python
  containers -- and refuses any other global by name (``module.qualname``, with the file);
- non-tensor values: ``torch.load(weights_only=True)`` (Python scalars, containers and
  tensors only), after naming any global it would refuse;
- tensors: DCP reads them with ``torch.load(weights_only=True)`` already; funshard's own
  marker (``funshard.json``) is JSON; ``import_full`` reads with ``weights_only=True``.

What is trusted: torch's own classes as named above, and the bytes of tensors (a crafted
file can give wrong values, never run code). What is not: any other global a pickle names,
refused before it is looked up, so loading a directory from elsewhere cannot run its code.

    >>> md = read_metadata("ckpt/step_000100/.metadata")   # Metadata, or CheckpointError
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError

# the modules whose dataclasses and enums DCP's metadata is made of
_DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_NAMES = {("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"),
          ("torch", "Size"),
          ("torch.serialization", "_get_layout")}  # how a torch.layout pickles: by its name
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _admitted(module: str, name: str) -> bool:
    """Whether the global ``module.name`` may be looked up (nothing is imported to decide,
    except torch's own checkpoint modules)."""
    if (module, name) in _NAMES:
        return True
    if module == "torch":
        return isinstance(vars(torch).get(name), _TORCH_VALUES)  # no lazy import: vars
    if module in ("pathlib", "pathlib._local"):  # a checkpoint_id (Python 3.13 moved it)
        obj = vars(pathlib).get(name)
        return isinstance(obj, type) and issubclass(obj, pathlib.PurePath)
    if module in _DCP:
        obj = vars(importlib.import_module(module)).get(name)
        return (isinstance(obj, type) and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)))
    return False


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler of DCP's ``.metadata`` that refuses, by name, every global outside its
    allowlist (:func:`_admitted`); ``path`` is named in the refusal."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if _admitted(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"load: refused to read {self.path!r}: its pickle names the global "
            f"{module}.{name}, which is not one of the types a checkpoint's metadata is made "
            "of (torch.distributed.checkpoint's metadata classes, torch.Size, dtypes, Python "
            "containers); unpickling it could run code. The file was not written by "
            "torch.distributed.checkpoint or was altered: nothing was loaded. Load "
            "checkpoints only from sources you trust, or re-save it where it was made.")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"load: refused to read {self.path!r}: its pickle holds a "
                              "persistent id, which checkpoint metadata never does")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` file at ``path``, read through :class:`MetadataUnpickler`.

    Raises:
        CheckpointError: the file names a global outside the allowlist (the message names
            it and the file), or it cannot be read or is not DCP's metadata.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            md = MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle: one clear error
        raise CheckpointError(f"load: cannot read the checkpoint metadata {path!r}: "
                              f"{type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"load: {path!r} holds a {type(md).__name__}, not "
                              "torch.distributed.checkpoint's Metadata")
    return md


class Reader(dcp.FileSystemReader):
    """DCP's file-system reader whose ``read_metadata`` returns ``metadata`` (read already
    by :func:`read_metadata`), or reads it through :func:`read_metadata`."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if rank is None else None
        if md is None:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            md = read_metadata(os.path.join(os.fspath(self.path), name))
        if getattr(md, "storage_meta", None) is None:  # as torch's reader does
            md.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id
        return md


class Planner(dcp.DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor values are read with
    ``torch.load(weights_only=True)``; ``path`` is named in a refusal."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        key = read_item.dest_index.fqn
        find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
        unsafe = find(io.BytesIO(data)) if find is not None else []
        if unsafe:
            raise CheckpointError(
                f"load: refused to read {key!r} of the checkpoint at {self.path!r}: its "
                f"pickle names the global {unsafe[0]}, which is not a plain value (checkpoints "
                "hold tensors and Python scalars); unpickling it could run code. Nothing was "
                "loaded. Load checkpoints only from sources you trust.")
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - one clear error
            raise CheckpointError(f"load: cannot read {key!r} of the checkpoint at "
                                  f"{self.path!r} as plain data: {type(e).__name__}") from e
        plain = io.BytesIO()  # what DCP's planner reads back: the checked value, re-saved
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)

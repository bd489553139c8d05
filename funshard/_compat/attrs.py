"""Private attributes of torch objects, read only through the names below, each checked at
import: importing funshard fails, naming the torch version and what is missing, without
them.

- a DTensor's ``_local_tensor`` and ``_spec``: its shard with no autograd node
  (``to_local()`` makes one where gradients are on) and its layout, which the checkpoint's
  host copy keeps (``from_local`` would move the copy back to the mesh's device);
- a tensor's ``_base``, ``_version`` and ``_backward_hooks``: the tensor a view is of, how
  often it was written in place, and whether hooks were put on it;
- a module's ``_parameters``, ``_buffers`` and ``_modules``: the dicts an installation
  writes tensors into, as ``torch.nn.utils.stateless`` does (``setattr`` refuses a plain
  tensor where a parameter is), and whose sizes tell a module tree's shape;
- an untyped storage's ``_cdata``: its identity (:func:`funshard._compat.storage_refs`;
  fs.testing's memory meter).

Each reader is an ``operator.attrgetter`` (no Python frame per read: some are read per leaf
per step).
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import DTensor


def _missing() -> list[str]:
    out = [f"DTensor.{a}" for a in ("_local_tensor", "_spec")
           if a not in getattr(DTensor, "__slots__", ()) and not hasattr(DTensor, a)]
    out += [f"Tensor.{a}" for a in ("_base", "_version", "_backward_hooks")
            if not hasattr(torch.Tensor, a)]
    module = torch.nn.Module()
    out += [f"Module.{a}" for a in ("_parameters", "_buffers", "_modules")
            if not isinstance(getattr(module, a, None), dict)]
    out += [] if hasattr(torch.UntypedStorage(0), "_cdata") else ["UntypedStorage._cdata"]
    return out


MISSING = _missing()
if MISSING:
    raise ImportError(f"funshard reads private attributes of torch objects which this torch "
                      f"{torch.__version__} lacks: {', '.join(MISSING)}. Use a torch funshard "
                      "supports (2.11 or newer).")

local_tensor = operator.attrgetter("_local_tensor")  # a DTensor's shard, no autograd node
dtensor_spec = operator.attrgetter("_spec")  # a DTensor's layout
view_base = operator.attrgetter("_base")  # the tensor a view is of, or None
version = operator.attrgetter("_version")  # writes in place to a tensor's storage so far
tensor_hooks = operator.attrgetter("_backward_hooks")  # a tensor's hooks (None or a dict)
own_parameters = operator.attrgetter("_parameters")  # a module's own, the dict itself
own_buffers = operator.attrgetter("_buffers")  # likewise
own_modules = operator.attrgetter("_modules")  # a module's children, the dict itself
storage_id = operator.attrgetter("_cdata")  # an untyped storage's identity

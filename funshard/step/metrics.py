"""A compiled step's metrics: a dict whose values wait on the device until the caller first
reads any of them ([Note: a step that reads nothing] in :mod:`funshard.step.deferred`)."""

from __future__ import annotations

import torch


class Metrics(dict):
    """A step's metrics, as a dict, whose device values are read (and whose checks are
    acted on) at the first access to any of them: ``verdict.settle()`` (a
    :class:`~funshard.step.deferred.Verdict`) gives them."""

    def __init__(self, host: dict, verdict, ok: torch.Tensor):
        super().__init__(host)
        self.verdict, self.ok = verdict, ok  # ok: the device's bool, whether to update

    def _read(self) -> None:
        if self.verdict is not None:
            dict.update(self, self.verdict.settle())
            self.verdict = None

    def __getitem__(self, key):
        self._read()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._read()
        return dict.get(self, key, default)

    def __iter__(self):  # dict(m), {**m}: through here and __getitem__
        self._read()
        return dict.__iter__(self)

    def items(self):
        self._read()
        return dict.items(self)

    def values(self):
        self._read()
        return dict.values(self)

    def pop(self, key, *default):
        self._read()
        return dict.pop(self, key, *default)

    def popitem(self):
        self._read()
        return dict.popitem(self)

    def setdefault(self, key, default=None):
        self._read()
        return dict.setdefault(self, key, default)

    def copy(self) -> dict:
        self._read()
        return dict(dict.items(self))

    def __eq__(self, other) -> bool:
        self._read()
        return dict.__eq__(self, other)

    __hash__ = None

    def __repr__(self) -> str:
        self._read()
        return dict.__repr__(self)

    def __reduce__(self):
        return (dict, (self.copy(),))

"""A griffe extension for the docs build: the docstrings' Sphinx-style roles
(``:func:`funshard.call```, ``:class:`Policy```, ``:mod:`.api```) render as code,
``funshard.call``, instead of as a literal ``:func:`` beside it. Nothing else changes."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`~?([^`]+)`")


class Roles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)

"""The private torch funshard uses is found in one place (funshard._compat): on the torch
under test nothing is missing, and where something the eager step needs is missing,
train_step and eval_step refuse to build, naming the torch version and the symbol."""

import pytest
import torch
import torch.nn.functional as F

import funshard as fs
from funshard import _compat


def test_nothing_is_missing_on_this_torch():
    assert _compat.EAGER_MISSING == [] and _compat.MISSING == []
    assert _compat.REPORT_MISSING == [] and _compat.TESTING_MISSING == []
    assert _compat.MODEL_MISSING == []


def _private_torch(path) -> list[str]:
    """Private torch names ``path`` reaches by a module path: ``torch.x._y`` and the names
    its imports from torch bind (an attribute of a tensor or a group object is not seen)."""
    import ast

    tree, bound, out = ast.parse(path.read_text()), {}, []

    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
                    out += [a.name] if private(a.name) else []
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch":
            for a in n.names:
                bound[a.asname or a.name] = f"{n.module}.{a.name}"
                out += [f"{n.module}.{a.name}"] if private(f"{n.module}.{a.name}") else []
    for n in ast.walk(tree):
        parts, node = [], n
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if parts and isinstance(node, ast.Name) and node.id in bound:
            dotted = ".".join([bound[node.id], *reversed(parts)])
            out += [dotted] if private(dotted) else []
    # each name once, up to its first private part (``torch.x._y.z``: ``torch.x._y``)
    cut = {".".join(d.split(".")[:next(i for i, p in enumerate(d.split("."))
                                       if p.startswith("_") and not p.startswith("__")) + 1])
           for d in out}
    return sorted(cut)


def test_private_torch_is_named_only_in_the_compat_module():
    """Every private torch symbol funshard reaches by a module path is looked up in
    funshard._compat (checked at import, missing names reported with the torch version)."""
    import pathlib

    root = pathlib.Path(fs.__file__).parent
    found = {str(p.relative_to(root)): _private_torch(p) for p in root.rglob("*.py")
             if "_compat" not in p.relative_to(root).parts}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_private_torch_scan_sees_each_way_in(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as dist\n"
                   "from torch.utils._python_dispatch import TorchDispatchMode\n"
                   "from torch.distributed import distributed_c10d as c10d\n"
                   "torch._foreach_add_(a, 1)\nx = dist.distributed_c10d._world\n"
                   "y = c10d._get_default_store()\nz = torch.ops.aten._to_copy.default\n"
                   "ok = torch.nn.functional.linear\n")
    assert _private_torch(src) == sorted([
        "torch.utils._python_dispatch", "torch._foreach_add_",
        "torch.distributed.distributed_c10d._world",
        "torch.distributed.distributed_c10d._get_default_store",
        "torch.ops.aten._to_copy"])


def test_no_frame_walk():
    """funshard recognizes no torch code by its Python frames (they differ per release)."""
    import pathlib

    root = pathlib.Path(fs.__file__).parent
    walks = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if "_getframe" in p.read_text() or "f_back" in p.read_text()]
    assert walks == []


@pytest.mark.parametrize("make", ["train_step", "eval_step"])
def test_a_missing_symbol_refuses_the_step_by_name(monkeypatch, make):
    monkeypatch.setattr(_compat, "EAGER_MISSING", ["torch._C._gone"])
    with pytest.raises(RuntimeError) as e:
        if make == "train_step":
            fs.train_step(lambda p, b: F.mse_loss(p["w"], b), fs.optim.sgd(lr=0.1))
        else:
            fs.eval_step(lambda p, b: p["w"] * b)
    msg = str(e.value)
    assert f"{make} needs torch internals this torch {torch.__version__} lacks" in msg, msg
    assert "torch._C._gone" in msg, msg


# a NamedTuple's own API, public though it is spelled with an underscore
_NAMEDTUPLE = {"_replace", "_make", "_fields", "_asdict", "_field_defaults"}


def _private_attributes(root, skip=("_compat",)) -> dict[str, list[str]]:
    """Per file under ``root`` (outside ``skip``), the private attributes it reads
    (``x._name``) that no code under ``root`` defines (a def, a class, an assignment, an
    argument, an import): another library's, torch's."""
    import ast

    trees = {p: ast.parse(p.read_text()) for p in root.rglob("*.py")}
    defined = set(_NAMEDTUPLE)
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.arg):
                defined.add(n.arg)
            elif isinstance(n, ast.alias):
                defined.add(n.asname or n.name.split(".")[-1])
    out = {}
    for p, tree in trees.items():
        if any(s in p.relative_to(root).parts for s in skip):
            continue
        found = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                        and n.attr.startswith("_") and not n.attr.startswith("__")
                        and n.attr not in defined})
        if found:
            out[str(p.relative_to(root))] = found
    return out


def test_private_attributes_of_torch_are_read_only_in_the_compat_module():
    """A private attribute of a torch object (``DTensor._local_tensor``,
    ``Module._parameters``, ...) is read only through funshard._compat, which checks each
    at import."""
    import pathlib

    assert _private_attributes(pathlib.Path(fs.__file__).parent) == {}


def test_the_private_attribute_scan_sees_a_torch_attribute(tmp_path):
    (tmp_path / "m.py").write_text(
        "class A:\n    def __init__(self):\n        self._mine = 1\n\n"
        "def f(t, m, a):\n    return t._local_tensor, m._parameters, a._mine, a._replace()\n")
    assert _private_attributes(tmp_path) == {"m.py": ["_local_tensor", "_parameters"]}


def test_a_missing_private_attribute_fails_the_import_by_name(monkeypatch):
    """Where torch lacks a private attribute funshard reads, importing funshard fails, naming
    it and the torch version (here: a storage without ``_cdata``)."""
    import importlib
    import re

    from funshard._compat import attrs

    assert attrs.MISSING == []
    monkeypatch.setattr(torch, "UntypedStorage", lambda n: object())
    with pytest.raises(ImportError, match=re.escape(
            f"this torch {torch.__version__} lacks: UntypedStorage._cdata. Use a torch")):
        importlib.reload(attrs)
    monkeypatch.undo()
    assert importlib.reload(attrs).MISSING == []

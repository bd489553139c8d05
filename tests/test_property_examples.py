"""The guide's examples (docs/property-testing.md, examples/property/) pass as a user runs
them: pytest on the folder, with the plugin's fixture and nothing of this suite's."""

import os
import re
import subprocess
import sys

from conftest import ROOT

EXAMPLES = ROOT / "examples" / "property"


def test_the_property_examples_pass_as_a_user_runs_them():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES)],
        capture_output=True, text=True, timeout=600, cwd=EXAMPLES, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    names = sorted(p.name for p in EXAMPLES.glob("test_*.py"))
    assert names == ["test_parity.py", "test_reduce_grads.py", "test_roundtrip.py"], names
    assert re.search(r"\b4 passed\b", out.stdout), out.stdout[-2000:]

"""examples/quickstart.py (the README's example) runs as written on 2 ranks and 2x2, and what
it relies on: a model built on meta, sharded, then loaded with every rank reading its rows."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from conftest import ROOT
from funshard.testing import mesh, stepped
from funshard.testing.models import GPT, gpt_loss

sys.path.insert(0, str(ROOT / "examples"))
import quickstart  # noqa: E402


def torchrun(nproc, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), str(ROOT / "examples" / "quickstart.py"),
                          *args], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def losses(text):
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([\d.]+)", text, re.M)}


def test_quickstart_on_2_ranks_then_resumed_on_2x2(tmp_path):
    out = tmp_path / "qs"
    first = torchrun(2, "--steps", "4", "--ckpt-every", "2", "--out", str(out))
    assert sorted(losses(first)) == [1, 2, 3, 4] and "resumed" not in first
    # step 1's loss is the pretrained file's loss on the first global batch, in one process
    model = GPT(**quickstart.CONFIG)
    model.load_state_dict(torch.load(out / "pretrained.pt"))
    with torch.no_grad():
        ref = gpt_loss(model)(fs.params(model), quickstart.get_batch(0, 0, 1, 8)).item()
    assert abs(losses(first)[1] - ref) < 1e-4, (first, ref)

    second = torchrun(4, "--mesh", "2x2", "--steps", "6", "--ckpt-every", "2", "--out", str(out))
    assert f"resumed from {out}/checkpoints/step_000004 (step 4)" in second
    got = losses(second)
    assert sorted(got) == [5, 6] and got[6] < losses(first)[1] - 0.3  # it carries on learning
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000004", "step_000006"]
    val = re.search(r"^validation loss ([\d.]+)$", second, re.M).group(1)
    assert f"exported to {out}/trained.pt (validation loss {val} in plain PyTorch)" in second
    trained = GPT(**quickstart.CONFIG)
    trained.load_state_dict(torch.load(out / "trained.pt"))  # strict: every key, right shapes
    x, y = quickstart.get_batch(10**6, 0, 1, 8)
    with torch.no_grad():
        assert abs(F.cross_entropy(trained(x).flatten(0, 1), y.flatten()).item()
                   - float(val)) < 1e-4


def shard_meta(spec, path):
    """A GPT built on meta: fs.shard makes only this rank's rows (NaN); a step refuses them;
    import_full (every rank mapping the file) fills them with the file's values."""
    m = mesh(spec)
    torch.manual_seed(0)
    real = GPT(**quickstart.CONFIG)
    if dist.get_rank() == 0:
        torch.save(real.state_dict(), path)
    dist.barrier()
    with torch.device("meta"):
        model = GPT(**quickstart.CONFIG)
    sparams = fs.shard(fs.params(model), m)
    rows = {k: tuple(v.to_local().shape) for k, v in sparams.items()}
    want = {k: tuple(v.chunk(m.size(m.ndim - 1))[m.get_local_rank(m.ndim - 1)].shape)
            for k, v in fs.params(real).items()}
    nan = all(v.to_local().isnan().all() for v in sparams.values())
    step = fs.train_step(gpt_loss(model), fs.optim.sgd(lr=0.1))
    try:
        stepped(step, step.init(sparams),
                quickstart.get_batch(0, dist.get_rank(), dist.get_world_size(), 8))
        refused = None
    except (FloatingPointError, ValueError) as e:
        refused = str(e)
    loaded = fs.checkpoint.import_full(path, like=sparams, rank0_only=False, strict=False)
    same = all(torch.equal(fs.unshard(loaded)[k], v) for k, v in fs.params(real).items())
    return rows == want, nan, refused, same


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_meta_model_shards_then_loads_its_rows(pools, tmp_path, spec):
    for rows, nan, refused, same in pools.run(spec, shard_meta, str(tmp_path / "w.pt")):
        assert rows and nan and same
        assert refused is not None and "is not finite (NaN or inf) at step 0" in refused, refused


def test_namespace_and_python_m_funshard():
    """What the README promises after `import funshard as fs`, and `python -m funshard`."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", fs.__version__)
    for name in ("testing", "plan", "checkpoint", "optim", "pytree", "collectives"):
        assert getattr(fs, name).__name__ == f"funshard.{name}"
    assert callable(fs.testing.Pool) and callable(fs.plan.plan)
    assert callable(fs.optim.adamw) and callable(fs.checkpoint.export_module)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    helped = subprocess.run([sys.executable, "-m", "funshard", "--help"], capture_output=True,
                            text=True, env=env)
    assert helped.returncode == 0 and helped.stdout.startswith(f"funshard {fs.__version__}:")
    for what in ("bash scripts/demo.sh", "bash scripts/test.sh", "examples/quickstart.py",
                 "scripts/setup.sh", "fs.checkpoint", "fs.testing", "fs.plan", "fs.optim"):
        assert what in helped.stdout, what
    version = subprocess.run([sys.executable, "-m", "funshard", "--version"],
                             capture_output=True, text=True, env=env)
    assert version.stdout == f"{fs.__version__}\n"
    wrong = subprocess.run([sys.executable, "-m", "funshard", "train"], capture_output=True,
                           text=True, env=env)
    assert wrong.returncode == 2 and "no command 'train'" in wrong.stderr


def test_readme_shows_the_quickstart_as_it_is():
    """The README's example block is examples/quickstart.py's main, line for line."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Example: your own model"):readme.index("## Export")]
    block = section.split("```python\n")[1].split("```")[0]
    source = (ROOT / "examples" / "quickstart.py").read_text()
    assert block.startswith("def main(args):") and block in source

"""The demo CLI end to end: trains, checkpoints, resumes on another world size; bad flags."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "gpt"  # the demo; it imports its siblings by name, as a script
sys.path.insert(0, str(EXAMPLE))
import flags  # noqa: E402
import train as demo  # noqa: E402


def run_cli(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq", "32", "--batch", "2",
         "--sample", "40", "--no-progress"]


def test_train_checkpoint_and_resume_on_another_world(tmp_path):
    out = str(tmp_path / "run")
    first = run_cli(*SMALL, "--steps", "30", "--ckpt-every", "15", "--eval-every", "10",
                    "--out", out)
    assert first.returncode == 0, first.stderr[-3000:]
    recs = [json.loads(x) for x in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 31))
    assert [r["step"] for r in recs if "val_loss" in r] == [10, 20, 30]
    assert recs[29]["val_loss"] < recs[9]["val_loss"]
    assert all(r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert {r["mesh"] for r in recs} == {"2x2"} and recs[0]["world"] == 4
    early = sum(r["loss"] for r in recs[:5]) / 5
    late = sum(r["loss"] for r in recs[-5:]) / 5
    assert late < early - 0.3, (early, late)  # it learns
    for name in ("loss.png", "summary.json", "sample.txt"):
        assert os.path.getsize(f"{out}/{name}") > 0
    assert sorted(os.listdir(f"{out}/checkpoints")) == ["step_000015", "step_000030"]
    assert "final loss" in first.stdout and "collectives/step" in first.stdout

    # resume on 2 processes (1-D mesh) and continue the step count
    second = run_cli(*SMALL, "--steps", "40", "--nproc", "2", "--resume", "--ckpt-every", "20",
                     "--out", out)
    assert second.returncode == 0, second.stderr[-3000:]
    recs = [json.loads(x) for x in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in recs][30:] == list(range(31, 41))
    assert recs[-1]["world"] == 2 and recs[-1]["mesh"] == "1x2"
    summary = json.load(open(f"{out}/summary.json"))
    assert summary["resumed_from"][1] == 30 and summary["steps"] == 40
    assert "resumed from" in second.stdout
    # the resumed run carries on from the trained model, not from scratch
    assert recs[30]["loss"] < early - 0.3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mesh", "3x3"], "--mesh 3x3 needs 9 processes but the world has 4"),
        (["--mesh", "two"], "--mesh 'two' is not RxS"),
        (["--corpus", "/no/such/file.txt"], "--corpus /no/such/file.txt: no such file"),
        (["--batch", "5", "--accumulate", "2"], "--batch 5 does not split into --accumulate 2"),
        (["--dim", "30", "--heads", "4"], "--dim 30 is not divisible by --heads 4"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--policy", "no-shard", "--mesh", "1x4"], "--policy no-shard replicates everything"),
        (["--resume", "--out", "/nonexistent/run"], "--resume: no complete checkpoint under"),
        (["--resume", "--force"], "--resume continues the run in --out, --force deletes it"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        pytest.param(["--device", "cuda"], "--device cuda: torch sees no CUDA GPU here",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
    ],
)
def test_bad_flags_give_one_line(capsys, flags, message):
    assert demo.main([*flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("funshard train: error: ") and message in err


def test_rank_killed_under_torchrun_restarts_and_matches_uninterrupted(tmp_path):
    """torchrun --max-restarts=1: a rank SIGKILLs itself at step 12; the job restarts, resumes
    from the step-10 checkpoint, and every step's loss equals an uninterrupted run's."""
    flags = [*SMALL, "--steps", "20", "--ckpt-every", "5"]
    ref = run_cli(*flags, "--nproc", "2", "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    faulty = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(EXAMPLE / "train.py"), *flags, "--mesh", "1x2",
         "--fail-at-step", "12", "--out", str(tmp_path / "faulty")],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "resumed from" in faulty.stdout and "step_000010" in faulty.stdout

    def losses(run):
        out = {}
        for line in open(tmp_path / run / "metrics.jsonl"):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]  # the restarted attempt's record wins
        return out

    lines = open(tmp_path / "faulty" / "metrics.jsonl").read().splitlines()
    # steps 11 and 12 ran twice (before the kill and after the restart), logged once
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 21))
    assert losses("faulty") == losses("ref")


def test_a_used_out_is_refused_without_resume_or_force(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000010").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert demo.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"funshard train: error: --out {out} already holds a run (metrics.jsonl, "
                   f"{out}/checkpoints/); pass --resume to continue it, --force to delete it and "
                   "start over, or another --out\n")
    args = demo.build_parser().parse_args(["--out", str(out), "--force"])
    demo.validate(args, world=4)  # accepted
    (out / "notes.txt").write_text("mine")
    demo._clear(args)  # what --force deletes: the run's own outputs and checkpoints, no more
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_metrics_are_trimmed_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    demo._trim_metrics(path, 5)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def setup_dry_run(tmp_path, wheels):
    env = dict(os.environ, FUNSHARD_VENV=str(tmp_path / "venv"), FUNSHARD_WHEELS=str(wheels))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "venv").exists()  # a dry run changes nothing
    return run.stdout


def test_setup_without_a_wheel_folder_uses_the_cpu_index(tmp_path):
    out = setup_dry_run(tmp_path, tmp_path / "no-wheels")
    assert "no torch 2.13.0 wheel in a local folder" in out
    pip = [line for line in out.splitlines() if line.startswith("+ ") and " install " in line]
    assert pip[0].endswith("install --quiet torch==2.13.0 --index-url "
                           "https://download.pytorch.org/whl/cpu"), pip
    assert pip[1].endswith("install --quiet -e .[test]") and len(pip) == 2


def test_setup_with_a_wheel_folder_pins_its_cpu_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    out = setup_dry_run(tmp_path, wheels)
    assert f"installing torch 2.13.0+cpu from the local wheel folder {wheels}" in out
    assert f"install --quiet --find-links {wheels} torch==2.13.0+cpu\n" in out
    assert "download.pytorch.org" not in out


def test_the_default_out_is_numbered_so_the_readme_command_runs_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    parse = demo.build_parser().parse_args
    first = parse([])
    demo.validate(first, world=4)
    assert first.out == "runs/demo"
    (tmp_path / "runs" / "demo" / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "metrics.jsonl").write_text('{"step": 1}\n')
    again = parse([])
    demo.validate(again, world=4)
    assert again.out == "runs/demo-2"
    assert flags.default_out(parse(["--force"])) == "runs/demo"  # starts over in it
    assert flags.default_out(parse(["--resume"])) == "runs/demo"  # the newest used one

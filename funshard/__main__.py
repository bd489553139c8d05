"""``python -m funshard``: what there is to run and what there is to import (the library itself
has no command line)."""

import sys

from . import __version__

HELP = f"""\
funshard {__version__}: fully-sharded data parallelism for PyTorch as pure functions over pytrees.

From the repository root:

  bash scripts/demo.sh [FLAGS]        the demo: a byte-level GPT trained on local CPU ranks
                                      (examples/gpt/train.py; --help lists its flags)
  torchrun --nproc-per-node 2 examples/quickstart.py
                                      the README example: meta init, load, train, resume,
                                      evaluate, export (--mesh 2x2 with 4 processes)
  bash scripts/test.sh [PYTEST ARGS]  the test suite (--device cuda: the CUDA lane)
  bash scripts/setup.sh [--dry-run]   create .venv with the CPU build of torch and funshard
  bash scripts/docs.sh                the guides and the API reference, built into site/
  python -m benchmarks.bench [FLAGS]  funshard vs FSDP2 on the same transport, DDP and the
                                      compute-only floor
  python -m funshard --version        the version

In your own code, import funshard as fs:

  fs.make_mesh, fs.params, fs.buffers, fs.shard, fs.unshard, fs.reshard, fs.reduce_grads
  fs.train_step, fs.Policy, fs.TrainState       the training step
  fs.call, fs.eval_step, fs.Mean, fs.MicroBatches
  fs.state_dict, fs.load_state_dict             full / sharded / local state dicts
  fs.optim        sgd, adam, adamw, chain, schedules, muon, from_torch: optax-style
  fs.checkpoint   save, load, latest, prune, export_full, import_full, export_module
  fs.plan         per-rank memory and traffic on paper, from shapes alone
  fs.testing      Pool (N gloo ranks), assert_parity (N ranks == one process),
                  CountCollectives, LiveMemory, small models; strategies (hypothesis) and
                  the funshard_pool pytest fixture (docs/property-testing.md)
  fs.pytree       optree under namespace "funshard"
  fs.collectives  the transports: "c10d" (torch.distributed's collectives, the default),
                  "p2p" and "cma" (opt-in, one host's gloo CPU ranks)

Documentation: README.md, then docs/ (docs/index.md; bash scripts/docs.sh builds the site
with the API reference). History: CHANGELOG.md.
"""


def main(argv: list[str]) -> int:
    if argv in (["-V"], ["--version"]):
        print(__version__)
        return 0
    if argv and argv[0] not in ("-h", "--help"):
        print(f"python -m funshard: no command {argv[0]!r}; what there is:\n", file=sys.stderr)
        print(HELP, end="", file=sys.stderr)
        return 2
    print(HELP, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

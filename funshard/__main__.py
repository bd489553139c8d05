"""``python -m funshard``: what there is to run (the library itself has no command line)."""

import sys

HELP = """\
funshard: fully-sharded data parallelism for PyTorch as pure functions over pytrees.

From the repository root:

  bash scripts/demo.sh [FLAGS]        the demo: a byte-level GPT trained on local CPU ranks
                                      (examples/gpt/train.py; --help lists its flags)
  python -m benchmarks.bench [FLAGS]  funshard vs FSDP2, DDP and the compute-only floor
  bash scripts/test.sh [PYTEST ARGS]  the test suite

In your own code: import funshard as fs (see README.md).
"""


def main(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        print(f"python -m funshard: no command {argv[0]!r}; what there is:\n", file=sys.stderr)
        print(HELP, end="", file=sys.stderr)
        return 2
    print(HELP, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env bash
# The whole test suite, from a fresh machine with only Python 3.11: set-up, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/test_shard.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
FUNSHARD_EXTRAS=test bash scripts/setup.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected" >&2
fi
exit "$rc"

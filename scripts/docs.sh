#!/usr/bin/env bash
# The guides and the API reference, built into site/ with warnings as errors: set-up with
# the docs extra (mkdocs, mkdocstrings; the reference is read from the docstrings without
# importing funshard), then `mkdocs build --strict`. Extra arguments go to mkdocs build.
#
#   bash scripts/docs.sh                   # what CI runs; open site/index.html
#   .venv/bin/mkdocs serve                 # the same pages, rebuilt as you edit
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
FUNSHARD_EXTRAS=docs bash scripts/setup.sh
export NO_MKDOCS_2_WARNING=1  # the theme's notice about MkDocs 2.0, printed on every build
start=$(date +%s)
.venv/bin/mkdocs build --strict --site-dir site "$@"
echo "docs: built site/ in $(( $(date +%s) - start )) s (mkdocs build --strict)"

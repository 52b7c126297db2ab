#!/usr/bin/env bash
# The main job end to end: save a sharded model, reload it under another sharding.
# It writes to a temporary directory that is removed when the script ends, however it ends
# (success, failure, Ctrl-C); a --dir DIR of your own is kept.
source "$(dirname "$0")/_venv.sh"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/ost-demo-XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"$PY" examples/demo.py --dir "$scratch" "$@"

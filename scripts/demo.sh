#!/usr/bin/env bash
# The main job end to end: save a sharded model, reload it under another sharding.
# It writes to a temporary directory that is removed when the script ends, however it ends
# (success, failure, Ctrl-C); a --dir DIR of your own is kept, and like any path you give it is
# relative to where you run the script from.
caller=$PWD
source "$(dirname "$0")/_venv.sh"  # (which moves to the repository's root)
root=$PWD
case $PY in /*) ;; *) PY=$root/$PY ;; esac
cd "$caller"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/ost-demo-XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# --scratch rather than --dir: the demo then says its checkpoint is gone and how to keep one.
"$PY" "$root/examples/demo.py" --scratch "$scratch" "$@"

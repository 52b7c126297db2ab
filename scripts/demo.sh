#!/usr/bin/env bash
# The main job end to end: save a sharded model, reload it under another sharding.
source "$(dirname "$0")/_venv.sh"
exec "$PY" examples/demo.py "$@"

#!/usr/bin/env bash
# The whole test suite, in the project's own virtualenv. Extra args go to pytest.
source "$(dirname "$0")/_venv.sh"
exec "$PY" -m pytest "$@"

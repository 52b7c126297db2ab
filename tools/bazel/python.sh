#!/usr/bin/env bash
# The Python interpreter of the Bazel toolchain (tools/bazel/BUILD): the project's virtualenv,
# so py_binary/py_test targets get jax, numpy, fsspec, google-crc32c, ml_dtypes, ... from it and BUILD
# names no third-party repository.
#
# Which virtualenv: $OST_VENV if set (pass it to tests with --test_env=OST_VENV and to run/build
# actions with --action_env=OST_VENV), else <repo>/.venv, the one scripts/_venv.sh makes. The repo
# is found from this script's real path: Bazel runs it through a runfiles symlink, which resolves
# to the source tree, wherever the clone is.
set -euo pipefail
if [ -n "${OST_VENV:-}" ]; then
  venv="$OST_VENV"
else
  here="$(readlink -f "${BASH_SOURCE[0]}")"
  venv="$(dirname "$(dirname "$(dirname "$here")")")/.venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "tools/bazel/python.sh: no virtualenv at $venv" \
       "(make it with scripts/_venv.sh, or set OST_VENV)" >&2
  exit 127
fi
exec "$venv/bin/python" "$@"

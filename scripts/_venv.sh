# Sourced by the other scripts: makes (once) and fills the project's virtualenv.
# VENV overrides its location; OST_EXTRAS the extras installed (default "test";
# "test,interop" adds torch and transformers for the interop tests, which skip
# without them). The install is incremental, so re-runs are quick.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[${OST_EXTRAS:-test}]"
PY="$VENV/bin/python"

# Sourced by the other scripts: makes (once) and fills the project's virtualenv.
# PYTHON is its interpreter (default: the newest CPython 3.11+ found, as users install today);
# VENV its location (default .venv; made anew when PYTHON is another version than the one
# it holds); OST_EXTRAS the extras installed (default "test"; "test,interop" adds torch and
# transformers for the interop tests, which skip without them); OST_CONSTRAINTS a pip
# constraints file (.ci/oldest-constraints.txt: the oldest versions pyproject.toml allows).
# The install is incremental, so re-runs are quick.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-$(python_in 3.11 3.99)}"
version() { "$1" -c 'import sys; print(sys.version.split()[0])'; }
if [ -x "$VENV/bin/python" ] && [ "$(version "$VENV/bin/python")" != "$(version "$PYTHON")" ]; then
  echo "$VENV holds Python $(version "$VENV/bin/python"); making it anew with $PYTHON ($(version "$PYTHON"))" >&2
  "$PYTHON" -m venv --clear "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  ${OST_CONSTRAINTS:+--constraint "$OST_CONSTRAINTS"} -e ".[${OST_EXTRAS:-test}]"
PY="$VENV/bin/python"

# Sourced by the other scripts: makes (once) and fills the project's virtualenv.
# PYTHON is its interpreter (default: the newest CPython 3.11+ found, as users install today,
# when the venv is made; the venv's own after); VENV its location (default .venv; made anew
# when PYTHON is another version than the one it holds); OST_EXTRAS the extras installed
# (default "test"; "test,interop" adds torch and transformers for the interop tests, which skip
# without them); OST_CONSTRAINTS a pip constraints file (.ci/oldest-constraints.txt: the oldest
# versions pyproject.toml allows).
# pip runs only when something it would act on changed: the package is installed editable, so
# source edits need no reinstall, and $VENV/.ost-installed holds a hash of pyproject.toml, the
# pip command (extras, constraints file and its contents) and the venv's Python; a match skips
# pip, which would otherwise spend ~20 s re-resolving on every run. OST_REINSTALL=1 forces it.
# pip's output goes to $VENV/install.log: its last 30 lines are printed when it fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
VENV="${VENV:-.venv}"
# Without PYTHON an existing venv keeps its Python: finding the newest one runs every python3*
# on PATH and in pyenv (~1 s each through pyenv's shims), which a re-run should not pay for.
if [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ]; then
  PYTHON=$VENV/bin/python
else
  PYTHON="${PYTHON:-$(python_in 3.11 3.99)}"
fi
version() { "$1" -c 'import sys; print(sys.version.split()[0])'; }
# Messages name the script the user ran ("[demo]", "[test]"), "[venv]" when sourced by bash -c.
_venv_tag=$(basename "${0%.sh}")
case $_venv_tag in bash | sh | -bash | _venv) _venv_tag=venv ;; esac
_venv_tag="[$_venv_tag]"
case $VENV in /*) _venv_log=$VENV/install.log ;; *) _venv_log=$PWD/$VENV/install.log ;; esac
_venv_stamp=$VENV/.ost-installed
_venv_extras=${OST_EXTRAS:-test}

# Runs pip with its output in the log; on failure shows the log's tail and ends the script.
_venv_pip() {
  echo "\$ pip $*" >> "$_venv_log"
  "$VENV/bin/python" -m pip "$@" >> "$_venv_log" 2>&1 && return
  echo "$_venv_tag pip failed; the last 30 lines of $_venv_log:" >&2
  tail -n 30 "$_venv_log" >&2
  exit 1
}

_venv_new="" _venv_clear=()
if [ -x "$VENV/bin/python" ] && [ "$(version "$VENV/bin/python")" != "$(version "$PYTHON")" ]; then
  echo "$_venv_tag $VENV holds Python $(version "$VENV/bin/python"); making it anew with $PYTHON ($(version "$PYTHON"))" >&2
  _venv_new=yes _venv_clear=(--clear)
elif [ ! -x "$VENV/bin/python" ]; then
  _venv_new=yes
fi
if [ -n "$_venv_new" ]; then
  # The slow part (pip downloads and installs JAX, Orbax and the extras): said before it starts.
  echo "$_venv_tag building $VENV (first run only, ~1-2 min: jax, orbax, safetensors, extras: $_venv_extras); pip's log: $_venv_log" >&2
  _venv_out=$("$PYTHON" -m venv ${_venv_clear[@]+"${_venv_clear[@]}"} "$VENV" 2>&1) || {
    printf '%s\n' "$_venv_out" >&2
    echo "$_venv_tag could not make a virtualenv in $VENV with $PYTHON" >&2
    exit 1
  }
  rm -f "$_venv_stamp"  # a stamp left in the directory describes the venv it replaces
  : > "$_venv_log"
  _venv_pip install --upgrade pip
fi
_venv_install=(install --disable-pip-version-check
  ${OST_CONSTRAINTS:+--constraint "$OST_CONSTRAINTS"} -e ".[$_venv_extras]")
# The constraints file's contents count too: editing it must reinstall.
_venv_key=$("$VENV/bin/python" -c '
import hashlib, sys
h = hashlib.sha256(sys.version.encode())
h.update(open("pyproject.toml", "rb").read())
h.update("\0".join(sys.argv[1:]).encode())
for i, arg in enumerate(sys.argv[1:-1], 1):
    if arg == "--constraint":
        h.update(open(sys.argv[i + 1], "rb").read())
print(h.hexdigest())' "${_venv_install[@]}")
if [ -n "${OST_REINSTALL:-}" ] || [ "$(cat "$_venv_stamp" 2>/dev/null)" != "$_venv_key" ]; then
  if [ -z "$_venv_new" ]; then
    echo "$_venv_tag installing into $VENV: pyproject.toml, extras \"$_venv_extras\", constraints or Python differ from its last install (or OST_REINSTALL is set); pip's log: $_venv_log" >&2
    : > "$_venv_log"
  fi
  rm -f "$_venv_stamp"  # no stamp while pip runs: an interrupted install is redone next time
  _venv_pip "${_venv_install[@]}"
  # Written whole, then renamed: a script started meanwhile reads the old stamp or the new one.
  printf '%s\n' "$_venv_key" > "$_venv_stamp.$$"
  mv -f "$_venv_stamp.$$" "$_venv_stamp"
fi
PY="$VENV/bin/python"

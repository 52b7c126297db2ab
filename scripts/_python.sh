# Sourced by the scripts that make a virtualenv: python_in MIN MAX prints the newest CPython
# whose minor version lies in [MIN, MAX] (e.g. python_in 3.11 3.99), from python3.X on PATH and
# pyenv's versions; it fails, saying so, where there is none.
python_in() {
  local lo=${1#3.} hi=${2#3.} best="" best_v=0 p v
  local pyenv_root
  pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for p in $(compgen -c python3 | sort -u) "$pyenv_root"/versions/3.*/bin/python3; do
    v=$("$p" -c 'import sys; v = sys.version_info
if sys.implementation.name == "cpython": print(v[1] * 10000 + v[2] * 100 + (v[3] == "final"), sys.executable)' \
      2>/dev/null) || continue
    [ -n "$v" ] && [ "${v%% *}" -ge $((lo * 10000)) ] && [ "${v%% *}" -lt $(((hi + 1) * 10000)) ] \
      && [ "${v%% *}" -gt "$best_v" ] || continue
    best=${v#* } best_v=${v%% *}
  done
  [ -n "$best" ] || { echo "no CPython between $1 and $2 found (python3.X on PATH, pyenv); set PYTHON=" >&2; return 1; }
  echo "$best"
}

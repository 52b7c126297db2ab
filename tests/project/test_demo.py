"""``bash scripts/demo.sh``, the README's first command: what it says, and what it reruns.

The set-up tests run ``scripts/_venv.sh`` in a copy of the scripts beside a pyproject.toml of
their own, with a stand-in interpreter whose ``-m pip`` records its arguments instead of
installing, and whose ``-m venv`` makes another such stand-in: no network, well under a second
each.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
from tests.support import REPO

_REPO = str(REPO)
_SMALL = ["--layers", "2", "--hidden", "64", "--vocab", "512"]

# Its -m pip appends its arguments to $FAKE_PIP_CALLS, writes 40 lines of chatter and exits
# $FAKE_PIP_RC; its -m venv DIR makes DIR/bin/python, a copy of itself; anything else is Python.
_FAKE_PYTHON = f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
  shift 2
  echo "$*" >> "$FAKE_PIP_CALLS"
  for i in $(seq 1 40); do echo "pip chatter $i"; done
  exit "${{FAKE_PIP_RC:-0}}"
fi
if [ "$1 $2" = "-m venv" ]; then
  for dir; do :; done
  mkdir -p "$dir/bin" && cp "$0" "$dir/bin/python" && exit 0
fi
exec {shlex.quote(sys.executable)} "$@"
"""


@pytest.fixture
def project(tmp_path):
    """A stand-in checkout: the two set-up scripts and a pyproject.toml."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    for name in ("_venv.sh", "_python.sh"):
        shutil.copy(os.path.join(_REPO, "scripts", name), root / "scripts" / name)
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    python = tmp_path / "python"
    python.write_text(_FAKE_PYTHON)
    python.chmod(0o755)
    return root


def _setup(project, **env):
    """Sources _venv.sh as the scripts do; returns (exit status, stderr, the pip calls made)."""
    calls = project.parent / "pip-calls"
    calls.unlink(missing_ok=True)
    environment = {**os.environ, "PYTHON": str(project.parent / "python"),
                   "VENV": str(project.parent / "venv"), "FAKE_PIP_CALLS": str(calls)}
    for name in ("OST_EXTRAS", "OST_CONSTRAINTS", "OST_REINSTALL"):
        environment.pop(name, None)
    result = subprocess.run(["bash", "-c", 'source scripts/_venv.sh && echo "$PY"'],
                            cwd=project, env={**environment, **env},
                            capture_output=True, text=True, timeout=60)
    made = calls.read_text().splitlines() if calls.exists() else []
    return result.returncode, result.stderr, made


def test_first_setup_says_what_it_builds_before_pip_and_keeps_pip_quiet(project):
    code, err, calls = _setup(project)
    assert code == 0, err
    log = project.parent / "venv" / "install.log"
    assert err.splitlines() == [
        f"[venv] building {project.parent / 'venv'} (first run only, ~1-2 min: jax, orbax, "
        f"safetensors, extras: test); pip's log: {log}"]
    assert calls == ["install --upgrade pip", "install --disable-pip-version-check -e .[test]"]
    assert log.read_text().count("pip chatter 40") == 2


def test_nothing_changed_runs_no_pip(project):
    assert _setup(project)[0] == 0
    code, err, calls = _setup(project)
    assert (code, err, calls) == (0, "", [])


def test_changed_extras_constraints_or_pyproject_reinstall(project):
    assert _setup(project)[0] == 0
    code, err, calls = _setup(project, OST_EXTRAS="test,interop")
    assert code == 0 and calls == ["install --disable-pip-version-check -e .[test,interop]"]
    assert 'installing into' in err and '"test,interop"' in err
    assert _setup(project, OST_EXTRAS="test,interop")[2] == []
    assert len(_setup(project)[2]) == 1  # back to the default extras: installs again

    constraints = project / "constraints.txt"
    constraints.write_text("jax==0.7.0\n")
    assert _setup(project, OST_CONSTRAINTS="constraints.txt")[2] == [
        "install --disable-pip-version-check --constraint constraints.txt -e .[test]"]
    assert _setup(project, OST_CONSTRAINTS="constraints.txt")[2] == []
    constraints.write_text("jax==0.7.1\n")  # same file, other pins
    assert len(_setup(project, OST_CONSTRAINTS="constraints.txt")[2]) == 1

    assert _setup(project)[0] == 0
    (project / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["numpy"]\n')
    assert len(_setup(project)[2]) == 1
    assert _setup(project)[2] == []
    assert len(_setup(project, OST_REINSTALL="1")[2]) == 1


def test_failed_pip_shows_the_log_tail_and_is_retried(project):
    assert _setup(project)[0] == 0
    (project / "pyproject.toml").write_text('[project]\nname = "y"\n')
    code, err, calls = _setup(project, FAKE_PIP_RC="1")
    assert code != 0 and len(calls) == 1
    assert "pip failed; the last 30 lines of" in err
    assert "pip chatter 40" in err and "pip chatter 11\n" in err and "pip chatter 10\n" not in err
    code, err, calls = _setup(project)  # no stamp was left: the next run installs again
    assert code == 0 and len(calls) == 1


def test_python_change_rebuilds(project, tmp_path):
    assert _setup(project)[0] == 0
    other = tmp_path / "other-python"  # says another version
    other.write_text('#!/usr/bin/env bash\n'
                     '[ "$1" = "-c" ] && case $2 in *sys.version.split*) echo 3.99.0; exit 0;; esac\n'
                     f'exec {shlex.quote(str(tmp_path / "python"))} "$@"\n')
    other.chmod(0o755)
    code, err, calls = _setup(project, PYTHON=str(other))
    assert code == 0, err
    assert "making it anew" in err and "building" in err and len(calls) == 2


def _demo_env(tmp_path):
    """scripts/demo.sh with a stand-in venv whose python skips pip, as tests/integrations/test_cli.py does."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        f'#!/usr/bin/env bash\n[ "$1 $2" = "-m pip" ] && exit 0\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    return {**os.environ, "VENV": str(venv), "PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])}


def test_demo_script_ends_by_saying_how_to_keep_and_inspect_a_checkpoint(tmp_path):
    result = subprocess.run(["bash", os.path.join("scripts", "demo.sh"), *_SMALL], cwd=_REPO,
                            env=_demo_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith("checkpoint removed; keep one with: "
                           "bash scripts/demo.sh --dir ./demo-ckpt, then: "), last
    assert last.endswith(" inspect ./demo-ckpt/checkpoint"), last


def test_demo_names_a_working_inspect_command_for_a_kept_checkpoint(tmp_path):
    """A relative --dir is where the user runs the demo from, and so is the command printed."""
    result = subprocess.run([sys.executable, os.path.join(_REPO, "examples", "demo.py"),
                             "--dir", "kept", *_SMALL], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    prefix = "checkpoint kept in kept/checkpoint; inspect it with: "
    assert last.startswith(prefix), last
    command = shlex.split(last[len(prefix):])
    assert command[-2:] == ["inspect", "kept/checkpoint"]
    if command[0] == "orbax-safetensors" and not shutil.which(command[0]):
        # The package is importable but its console script is not installed here.
        command[:1] = [sys.executable, "-m", "orbax_safetensors.integrations.cli"]
    inspected = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0, inspected.stderr
    assert "model.layers.1.mlp.up_proj.weight" in inspected.stdout


def test_an_existing_venv_is_used_without_looking_for_pythons(project, tmp_path):
    """Finding the newest Python runs every python3* on PATH: a re-run must not wait for that."""
    assert _setup(project)[0] == 0
    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    probe = bin_dir / "python3.98"
    probe.write_text(f'#!/usr/bin/env bash\ntouch {shlex.quote(str(tmp_path / "probed"))}\nexit 1\n')
    probe.chmod(0o755)
    environment = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    code, err, calls = _setup(project, **environment, PYTHON="")
    assert (code, err, calls) == (0, "", [])
    assert not (tmp_path / "probed").exists()

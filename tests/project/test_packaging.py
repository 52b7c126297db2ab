"""What the installed distribution declares and ships: its requirements and extras, the
``py.typed`` marker (PEP 561), and that a user's type checker reads our annotations."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tests.support import REPO

# Run outside the repository, isolated (-I: neither the current directory nor PYTHONPATH on
# sys.path), so what answers is the installed distribution, never a source tree's stale
# orbax_safetensors.egg-info.
_INSTALLED = r"""
import importlib.metadata, importlib.resources, json
dist = importlib.metadata.distribution("orbax-safetensors")
print(json.dumps({"requires": dist.requires or [], "version": dist.version,
                  "extras": dist.metadata.get_all("Provides-Extra") or [],
                  "py_typed": importlib.resources.files("orbax_safetensors").joinpath("py.typed").is_file()}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    done = subprocess.run([sys.executable, "-I", "-c", _INSTALLED], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path_factory.mktemp("elsewhere"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _extra(requirement: str) -> str | None:
    found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
    return found.group(1) if found else None


def test_requirements_and_object_store_extras(installed):
    """Reinstall (``pip install -e .``) if this fails after pyproject.toml changed."""
    requires = installed["requires"]
    assert "absl-py" not in {_name(r) for r in requires}  # never imported (Orbax brings it)
    assert {"s3", "gcs"} <= set(installed["extras"])
    by_extra = {(_name(r), _extra(r)) for r in requires}
    assert ("s3fs", "s3") in by_extra and ("gcsfs", "gcs") in by_extra
    # The test extra keeps both backends: directly, or through the s3 and gcs extras.
    test = [r for r in requires if _extra(r) == "test"]
    for backend, extra in (("s3fs", "s3"), ("gcsfs", "gcs")):
        assert any(_name(r) == backend or (_name(r) == "orbax-safetensors" and extra in r)
                   for r in test), (backend, test)


def test_installed_package_has_py_typed(installed):
    assert installed["py_typed"]


def test_one_version_everywhere(installed):
    """pyproject.toml's version (what pip and ``--version`` report) is ``ost.__version__``."""
    import orbax_safetensors as ost
    assert installed["version"] == ost.__version__


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the working tree (a copy, so no build/ lands in the repository)."""
    pytest.importorskip("setuptools", minversion="77")  # built without isolation: no downloads
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "orbax_safetensors", source / "orbax_safetensors",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = out.glob("*.whl")
    return built


def _mypy(wheel: Path, where: Path, script: str, *options: str) -> subprocess.CompletedProcess:
    """mypy on a user's ``script``, the package installed from ``wheel`` (not from the repo:
    mypy reads no py.typed of a source tree on its path, and cannot see an editable install)."""
    pytest.importorskip("mypy")
    site = where / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    (where / "user.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(where / "cache"),
         "--no-error-summary", "--hide-error-context", *options, "user.py"],
        capture_output=True, text=True, timeout=300, cwd=where, env={**env, "PYTHONPATH": str(site)})


_USER = """\
import numpy as np
import orbax_safetensors as ost

ost.save("ckpt", {"w": np.zeros((2, 2), np.float32)}, max_shard_size="2GB")
params = ost.load("ckpt", strict=False, options=ost.LoadOptions(threads=4))
report: ost.VerifyReport = ost.verify("ckpt")
"""


def test_wheel_ships_py_typed_and_mypy_sees_it(wheel, tmp_path):
    assert "orbax_safetensors/py.typed" in zipfile.ZipFile(wheel).namelist()
    # Imports skipped: only whether mypy accepts the package as typed (fast, a few seconds).
    checked = _mypy(wheel, tmp_path, _USER, "--follow-imports=skip")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "import-untyped" not in checked.stdout


@pytest.mark.slow  # mypy analyses the package and JAX: ~15 s
def test_mypy_checks_calls_against_our_annotations(wheel, tmp_path):
    checked = _mypy(wheel, tmp_path, _USER + "ost.save(3, {})\n"
                    + "ost.load('ckpt', max_shard_size=1)\nost.save('ckpt', {}, checksums='no')\n")
    # The good calls pass; the bad ones are caught (an unexpected keyword adds a note).
    errors = [line for line in checked.stdout.splitlines() if ": error: " in line]
    assert len(errors) == 3, checked.stdout + checked.stderr
    assert errors[0].startswith("user.py:7: error: Argument 1 to \"save\" has incompatible type")
    assert errors[0].endswith("[arg-type]")
    # The options' fields as keywords (**shorthand: Unpack[...]) are typed too.
    assert errors[1].startswith('user.py:8: error: Unexpected keyword argument "max_shard_size"')
    assert errors[2].startswith('user.py:9: error: Argument "checksums" to "save" has incompatible type')


def test_a_missing_object_store_backend_names_the_extra(monkeypatch):
    import sys

    import orbax_safetensors as ost
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    registry = sys.modules["fsspec.registry"]  # (fsspec.registry is the mapping, not the module)
    for protocol in ("s3", "s3a"):
        if protocol in registry._registry:
            monkeypatch.delitem(registry._registry, protocol)
    with pytest.raises(ImportError, match=r"'s3://bucket/ckpt': .*pip install 'orbax-safetensors\[s3\]'"):
        ost.metadata("s3://bucket/ckpt")

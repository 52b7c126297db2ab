"""``BUILD`` builds, lists every module, and runs tests under Bazel's native Python rules.

docs/bazel.md: the Python toolchain (tools/bazel) is this virtualenv, so third-party packages
come from it and nothing is downloaded; Debian's ``bazel-bootstrap`` (Bazel 4.2.3) is enough.
Skips without ``bazel`` on PATH. A few fast test targets stand for all of them (each target is
the same pytest run of its file); the Bazel server is shut down at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support import REPO

pytestmark = pytest.mark.slow
# Fast targets (~15 s together): the import layering (no jax), the index and shard packing
# against the reference safetensors crate, tree names (jax, hypothesis).
TEST_TARGETS = ["//:project/test_layers", "//:index/test_index", "//:planning/test_tree_names"]
TIMEOUT = 600


@pytest.fixture(scope="module")
def bazel():
    exe = shutil.which("bazel")
    if exe is None:
        pytest.skip("bazel is not on PATH (apt-get install bazel-bootstrap; see docs/bazel.md)")
    env = dict(os.environ)
    if sys.prefix != sys.base_prefix:  # the toolchain runs tests in the venv running this test
        env["OST_VENV"] = sys.prefix

    def run(*args: str) -> subprocess.CompletedProcess:
        start = time.monotonic()
        result = subprocess.run([exe, *args], check=False, cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=TIMEOUT)
        print(f"bazel {' '.join(args)}: {time.monotonic() - start:.1f} s")
        assert result.returncode == 0, (f"bazel {' '.join(args)} exited {result.returncode}\n"
                                        f"{result.stdout}\n{result.stderr}")
        return result

    try:
        yield run
    finally:
        subprocess.run([exe, "shutdown"], check=False, cwd=REPO, env=env, capture_output=True,
                       timeout=120)


def test_every_target_builds(bazel):
    bazel("build", "//...")


def test_build_lists_every_module_and_test_file(bazel):
    def query(expression: str) -> set[str]:
        return set(bazel("query", "--output=label", expression).stdout.split())

    package = {f"//:{p.relative_to(REPO).as_posix()}"
               for p in (REPO / "orbax_safetensors").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert package - query('kind("source file", deps(//:orbax_safetensors))') == set()
    support = {f"//:{p.relative_to(REPO).as_posix()}" for p in (REPO / "tests").rglob("*.py")
               if not p.name.startswith("test_") and p.name != "pytest_main.py"}
    assert query("labels(srcs, //:test_support)") == support
    assert query("tests(//:all)") == {f"//:{p.relative_to(REPO / 'tests').with_suffix('').as_posix()}"
                                      for p in (REPO / "tests").rglob("test_*.py")}


def test_fast_test_targets_pass(bazel):
    # Bazel can't see the virtualenv change, so cached results could be stale: always run.
    bazel("test", "--nocache_test_results", *TEST_TARGETS)


def test_the_cli_binary_runs(bazel):
    result = bazel("run", "//:orbax-safetensors", "--", "--help")
    assert "usage: orbax-safetensors" in result.stdout

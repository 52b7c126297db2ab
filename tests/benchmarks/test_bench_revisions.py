"""``bench/revisions.py``: this checkout against another, every operation, in one run.

The smoke test compares the checkout with itself given as the baseline: every row must have
run on both sides (no "failed"), and the baseline's workers must have imported the package
from the baseline's directory, which the bench checks before it runs anything. A directory
without the package is refused before any work.
"""

import shutil
import subprocess
import sys

import pytest

from tests.support import REPO


def run_bench(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "revisions.py"), *arguments],
                          check=False, capture_output=True, text=True, cwd=REPO, timeout=900)


@pytest.mark.slow
def test_every_operation_runs_on_both_checkouts(tmp_path):
    baseline = tmp_path / "baseline"
    shutil.copytree(REPO / "orbax_safetensors", baseline / "orbax_safetensors",
                    ignore=shutil.ignore_patterns("__pycache__"))
    chosen = ["load fsdp", "save hf", "tiny metadata"]  # one of each worker: the others differ in arguments
    done = run_bench("--baseline", str(baseline), "--quick", "--conditions", "cold", "--dir", str(tmp_path / "cache"),
                     "--operations", ",".join(chosen))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "| cold |" in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == chosen, done.stdout
    assert not any("failed" in row for row in rows), done.stdout


def test_a_baseline_without_the_package_is_refused(tmp_path):
    done = run_bench("--baseline", str(tmp_path), "--quick")
    assert done.returncode == 2 and "holds no orbax_safetensors package" in done.stderr

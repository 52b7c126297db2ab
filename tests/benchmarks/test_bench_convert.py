"""``bench/convert.py`` runs end to end on its tiny model: a smoke test of the benchmark itself.

Each row is only worth its number if the run converted what it should: the bench checks every
output (a committed MaxText checkpoint; an HF directory with the source's tensors, bitwise but
the rounded query) and reports a failed row otherwise, so a table without "failed" means every
command ran and wrote the right thing. Ours runs in the fast tier; MaxText's scripts need the
MaxText venv (``tests/families/test_maxtext_mapping.py`` builds it, or the test skips) and are slow.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.families.test_maxtext_mapping import maxtext_python  # noqa: F401  (a fixture)
from tests.support import REPO


def run_bench(work_dir: Path, contenders: str) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "convert.py"), "--quick", "--contenders", contenders,
         "--conditions", "cold", "--work-dir", str(work_dir)],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def rows_of(table: str, contender: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| tiny |") and f"| {contender} |" in line]


def test_ours_converts_both_ways_in_the_quick_bench(tmp_path):
    table = run_bench(tmp_path, "ours")
    rows = rows_of(table, "ours")
    assert [row.split(" | ")[1] for row in rows] == ["to_maxtext", "to_hf"], table
    assert not any("failed" in row for row in rows), table
    assert "to_hf reads the MaxText checkpoint ours wrote" in table


@pytest.mark.slow
def test_maxtext_and_ours_two_processes_in_the_quick_bench(tmp_path, maxtext_python):  # noqa: F811
    table = run_bench(tmp_path, "ours_2proc,maxtext")
    for contender in ("ours_2proc", "maxtext"):
        rows = rows_of(table, contender)
        assert len(rows) == 2 and not any("failed" in row for row in rows), table
    assert "to_hf reads the MaxText checkpoint maxtext wrote" in table

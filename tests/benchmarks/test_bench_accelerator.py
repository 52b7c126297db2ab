"""``bench/accelerator.py``: its smallest setting runs end to end, every contender in its tables.

The bench loads a checkpoint into one device (here ``cpu:0``; on a GPU box the GPU) and saves from
it, ours against the peers. Run through its command line as a user runs it (slow: a fresh process
per run), every contender has its row, with a value or "n/a (why)" (the CUDA peers on this
machine), never "failed", and each load's result was checked against the values saved with the
checkpoint before it counted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import REPO
# A CI-sized cut (each run is a fresh process, 4-8 s of imports): ours both ways, the checksums
# pair, one host peer, both CUDA peers (n/a here), Orbax's save; every contender in a real run.
LOADS = ("ours", "ours_pooled", "ours_noverify", "safe_open", "instanttensor", "fastsafetensors_gpu")
SAVES = ("ours", "ours_nocrc", "orbax_standard", "dd")
SECONDS = re.compile(r"^\d+\.\d\d \[\d+\.\d\d–\d+\.\d\d\]$")  # common.spread: median [min–max]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip()[1:-1].split("|")]


def table(stdout: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the table under the ``####`` heading that starts with ``heading``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#### " + heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("####"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append(cells(line))
    return rows[1:]  # past the header row


def measured_or_na(row: list[str], at: int) -> bool:
    return bool(SECONDS.match(row[at])) or row[at].startswith("n/a (")


@pytest.mark.slow
def test_the_smallest_setting_has_every_contender_and_checks_the_loads(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "accelerator.py"), "--quick", "--conditions", "cold",
         "--page-cache", "cold", "--attempts", "1", "--dir", str(tmp_path / "checkpoints"),
         "--contenders", ",".join(c for c in (*LOADS, *SAVES) if c != "dd"),
         "--save-dir", str(tmp_path / "saves")],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "- command: `" in out and re.search(r"\(20\d\d-\d\d-\d\d \d\d:\d\d", out), out[:2000]
    assert "- device: `cpu` (cpu" in out, out[:2000]  # jax.devices()[0].device_kind, its platform
    assert "failed" not in out, out

    loads = table(out, "Load into one device")
    assert [row[:2] for row in loads] == [["dropped", c] for c in LOADS], out
    dropped = "cannot drop the page cache" in out  # not root: every load row n/a, saying why
    for row in loads:
        assert measured_or_na(row, 2), row
        if row[2].startswith("n/a ("):
            assert row[1] in ("instanttensor", "fastsafetensors_gpu") or dropped, row
        else:
            assert row[-2] == "1/1", row  # checked: the result compared with the saved values
            assert "% of disk" in row[4], row
    by_name = {row[1]: row for row in loads}
    for peer in ("instanttensor", "fastsafetensors_gpu"):  # CUDA peers, on a CPU: n/a, never a crash
        assert by_name[peer][2] == "n/a (needs a CUDA device; this run's devices are cpu)", by_name[peer]
    if not dropped:
        assert SECONDS.match(by_name["ours"][2]) and by_name["ours"][6] == "1.00", by_name["ours"]

    saves = table(out, "Save from device memory")
    assert [row[0] for row in saves] == list(SAVES), out
    for row in saves:
        assert SECONDS.match(row[1]), row
        assert row[-2] == ("—" if row[0] == "dd" else "1/1"), row  # read back after the save

    checksums = table(out, "Block checksums")
    assert [row[0] for row in checksums] == (["save"] if dropped else ["load, page cache dropped", "save"]), out
    assert all(re.match(r"^\*\*[+-]\d+%\*\*$", row[3]) for row in checksums), checksums

    overlap = table(out, "`ost.async_load` overlapping")
    if not dropped:
        assert [row[1] for row in overlap] == ["compile alone", "`ost.load` alone",
                                               "`ost.async_load` → compile → `.result()`",
                                               "**hidden**: compile + load − overlapped"], out
        assert all(SECONDS.match(row[2]) for row in overlap[:3]), overlap
        assert [row[-2] for row in overlap[:3]] == ["—", "1/1", "1/1"], overlap
        assert re.match(r"^-?\d+\.\d\d s, -?\d+% of the shorter$", overlap[3][2]), overlap[3]
    assert (REPO / "bench" / "results" / "accelerator-quick.md").read_text() in out


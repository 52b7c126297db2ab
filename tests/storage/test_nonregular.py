"""A FIFO, a device or a directory where a checkpoint file belongs is refused before it is
opened, naming it: an ``open`` of a FIFO would wait for a writer forever, a device would read
without end. Each call runs in a child process under a deadline, so a hang fails the test
instead of hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support import REPO

pytestmark = pytest.mark.slow  # FIFOs and devices, each command in a child process

REPO_ROOT = REPO
_CALLS = r"""
import sys, orbax_safetensors as ost

path = sys.argv[1]
for call in ("load", "metadata", "verify"):
    try:
        if call == "verify":
            print(call, "verify:", "; ".join(str(p) for p in ost.verify(path).problems), flush=True)
        else:
            getattr(ost, call)(path)
            print(call, "no error", flush=True)
    except ost.SafetensorsError as e:
        print(call, "SafetensorsError:", e, flush=True)
"""


def _make(kind: str, where: Path) -> None:
    if kind == "fifo":
        os.mkfifo(where)
    elif kind == "device":
        os.symlink("/dev/zero", where)
    else:
        where.mkdir()


def _setups(tmp_path: Path):
    """(path to load, the name to replace) for each place a checkpoint file sits."""
    single = tmp_path / "single"
    single.mkdir(parents=True)
    ost.save(single / "x.safetensors", {"a": np.ones(4, np.float32)})
    directory = tmp_path / "directory"
    ost.save(directory, {"a": np.ones(4, np.float32)})
    sharded = tmp_path / "sharded"
    ost.save(sharded, {f"t{i}": np.ones(2048, np.float32) for i in range(4)}, max_shard_size=10000)
    return {"x.safetensors": (single / "x.safetensors", single / "x.safetensors"),
            "model.safetensors": (directory, directory / "model.safetensors"),
            "a shard": (sharded, sorted(sharded.glob("model-0*.safetensors"))[-1]),
            "the index": (sharded, sharded / "model.safetensors.index.json")}


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_non_regular_files_are_refused_by_name_without_blocking(tmp_path, kind):
    failures = []
    for place, (path, victim) in _setups(tmp_path / kind).items():
        victim.unlink()
        _make(kind, victim)
        done = subprocess.run([sys.executable, "-c", _CALLS, str(path)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        lines = done.stdout.strip().splitlines()
        if len(lines) != 3:
            failures.append(f"{place}: {done.stdout} {done.stderr[-300:]}")
        for line in lines:
            call, _, out = line.partition(" ")
            if not (out.startswith(("SafetensorsError:", "verify:")) and victim.name in out):
                failures.append(f"{place}, {call}: {out}")
        cli = subprocess.run([str(Path(sys.executable).parent / "orbax-safetensors"), "inspect",
                              str(path)], capture_output=True, text=True, timeout=60)
        if cli.returncode != 1 or victim.name not in cli.stderr:
            failures.append(f"{place}, inspect: exit {cli.returncode}: {cli.stderr[-300:]}")
    assert not failures, "\n".join(failures)

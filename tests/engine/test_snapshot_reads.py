"""A load is a snapshot: readers in one process, a writer overwriting the same path in a loop
in another; every load returns exactly one of the two versions, and (locally) never fails.

Every tensor differs between the versions, so a load that mixed two saves, or read a file
half replaced, matches neither and is counted as mixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import REPO

pytestmark = pytest.mark.slow  # readers racing writers for seconds

REPO_ROOT = REPO

_COMMON = r"""
import json, sys, time
import numpy as np
import orbax_safetensors as ost

def tree(version, n=6):
    return {f"layers.{i}.w": np.full((96, 80), version * 1000 + i, np.float32) for i in range(n)}

def save(path, version, case):
    if case == "sharded <-> single file":  # the same directory alternates between two layouts
        size = 20000 if version == 1 else "5GB"
    else:
        size = 20000
    layout = "distributed" if case == "distributed" else "hf"
    size = None if path.endswith(".safetensors") else size  # one file: nothing to split
    ost.save(path, tree(version), max_shard_size=size, layout=layout, overwrite=True)
"""

_WRITER = _COMMON + r"""
path, case, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
save(path, 1, case)
print("ready", flush=True)
deadline, version, saves = time.monotonic() + seconds, 1, 0
while time.monotonic() < deadline:
    version = 3 - version
    save(path, version, case)
    saves += 1
print(json.dumps({"saves": saves}), flush=True)
"""

_READER = _COMMON + r"""
path, seconds = sys.argv[1], float(sys.argv[2])
expected = {v: tree(v) for v in (1, 2)}
counts = {"1": 0, "2": 0, "mixed": 0, "errors": 0}
examples = []
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        loaded = ost.load(path)
    except Exception as e:
        counts["errors"] += 1
        examples.append(f"{type(e).__name__}: {e}")
        continue
    for v, values in expected.items():
        if sorted(loaded) == sorted(values) and all(np.array_equal(loaded[k], values[k]) for k in values):
            counts[str(v)] += 1
            break
    else:
        counts["mixed"] += 1
        examples.append({k: float(a.ravel()[0]) for k, a in sorted(loaded.items())})
print(json.dumps({"counts": counts, "examples": examples[:5]}), flush=True)
"""

CASES = {"sharded directory": 20.0, "model.safetensors": 6.0, "x.safetensors": 6.0,
         "distributed": 6.0, "sharded <-> single file": 6.0}


@pytest.mark.parametrize("case", list(CASES))
def test_loads_never_mix_two_saves_and_never_fail_while_another_process_overwrites(
        tmp_path, case):
    seconds = CASES[case]
    path = tmp_path / ("x.safetensors" if case == "x.safetensors" else "ckpt")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), case, str(seconds)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        reader = subprocess.run([sys.executable, "-c", _READER, str(path), str(seconds)],
                                cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=seconds + 120)
        out, err = writer.communicate(timeout=seconds + 120)
    finally:
        writer.kill()
    assert reader.returncode == 0, reader.stderr
    assert writer.returncode == 0, err
    result = json.loads(reader.stdout.strip().splitlines()[-1])
    counts, saves = result["counts"], json.loads(out.strip().splitlines()[-1])["saves"]
    summary = f"{case}: {saves} saves, loads {counts}, examples {result['examples']}"
    print(summary)
    assert counts["mixed"] == 0, summary
    assert counts["errors"] == 0, summary
    assert counts["1"] > 0 and counts["2"] > 0, summary  # both versions were seen: the race ran

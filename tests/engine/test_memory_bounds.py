"""Peak host memory of load, save and consolidate on checkpoints much larger than their budgets.

Each measured operation runs in a fresh child process (``tests/support/memory_child.py``,
8 CPU devices): the child records its resident set once imports, devices and the
target tree are ready (``baseline``, where ``VmHWM`` is reset), runs the
operation, and reports ``VmHWM`` (``peak``); it checks the values afterwards.
Checkpoint files sit in the page cache, which is no process's RSS, and the
local backend reads with ``preadv`` into the destination buffers (no mmap), so
what is measured is the library's own buffers.

The bounds are ``result + staging + MARGIN`` where staging is what the library
promises to hold at once (``memory_budget``, or one tensor's shard when that is
larger; plus the per-thread bounce buffers of strided reads), and ``MARGIN``
covers allocator and XLA noise. Measured on the 2-CPU CI machine (MiB above
the baseline of ~188 MiB, or ~528 MiB with the tree to save; 256 MiB
checkpoints and trees of float32; load budget 32 MiB):

    case                            result  peak  bound  (bound = result + staging + 64)
    hf-numpy                           256   256    352
    hf-fsdp                            256   257    352
    hf-fsdp-to-bf16                    128   169    224
      same, budget = whole checkpoint  128   326    (must exceed 224)
    big-tensor-numpy                   256   257    448  (128 MiB tensor staged whole)
    big-tensor-fsdp-to-bf16            128   217    320
    distributed-resharded              256   364    512  (+ 16 threads x 4 MiB bounce)
    distributed-resharded-to-bf16      128   335    384
    save fsdp                            -     1     64
    save columns (524288 runs)           -   153    256  (+ 384 B per run; 331 when every
                                                          run of a 64 MiB range had its view at once)
    consolidate, 2 MiB blocks            -    41     96  (16 blocks + 64)
      same, 128 MiB blocks               -   193    (must exceed 96)

Loads into the stored dtype on CPU cost the result only (XLA adopts the
64-byte aligned read buffers as device buffers), so a budget that is ignored
shows only when the result is not the staging buffer: the ``bfloat16``
conversions below stage ``float32`` bytes, and the control run with a budget
of the whole checkpoint shows what ignoring the budget costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import REPO

pytestmark = pytest.mark.slow  # each measurement in a child process

REPO_ROOT = REPO
MiB = 1 << 20
MARGIN = 64 * MiB  # measured noise is below 20 MiB: allocator arenas, XLA's per-device state, thread stacks, Python objects
BUDGET = 32 * MiB
THREADS = 16  # LoadOptions.threads default
BOUNCE = 4 * MiB  # engine.read_policy.BOUNCE_BYTES: one strided-read buffer per read thread
CHILD_TIMEOUT = 180

# Checkpoint A (HF, 3 files): 16 tensors of 16 MiB, 8x the budget.
SPEC_A = [[f"layers.{i:02d}.w", [4096, 1024]] for i in range(16)]
# Checkpoint B (HF): one 128 MiB tensor (4x the budget) among 8 of 16 MiB.
SPEC_B = [["embed", [32768, 1024]]] + [[f"layers.{i}.w", [4096, 1024]] for i in range(8)]
# Checkpoint C (our distributed layout, every tensor in 2 row slices, as 2 processes with
# FSDP would write it): one 128 MiB tensor and 8 of 16 MiB.
SPEC_C = SPEC_B


def _nbytes(spec, itemsize=4):
    return sum(itemsize * shape[0] * shape[1] for _, shape in spec)


def _run(command: str, args: dict, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT), **(extra_env or {}))
    env.pop("XLA_FLAGS", None)  # the child sets its own 8 devices
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.memory_child", command, json.dumps(args)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0, f"child {command} failed:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEMORY_CHILD_RESULT ")]
    assert lines, f"child {command} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_bounds")
    paths = {"A": str(root / "a"), "B": str(root / "b"), "C": str(root / "c")}
    _run("make", {"checkpoints": [
        {"path": paths["A"], "spec": SPEC_A, "layout": "hf", "max_shard_size": "100MB"},
        {"path": paths["B"], "spec": SPEC_B, "layout": "hf", "max_shard_size": "200MB"},
        {"path": paths["C"], "spec": SPEC_C, "layout": "distributed", "slices": 2},
    ]})
    return paths


def _describe(m: dict, bound: int, **sizes) -> str:
    parts = [f"peak {(m['peak'] - m['baseline']) / MiB:.0f} MiB above baseline "
             f"{m['baseline'] / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"]
    parts += [f"{k} {v / MiB:.0f} MiB" for k, v in sizes.items()]
    return "; ".join(parts)


# (checkpoint, spec, target sharding (None: numpy), target dtype, extra staging beyond the budget)
LOAD_CASES = {
    # (a) HF shards into host arrays and into FSDP-sharded arrays over 8 devices.
    "hf-numpy": ("A", SPEC_A, None, "float32", 0),
    "hf-fsdp": ("A", SPEC_A, "x", "float32", 0),
    "hf-fsdp-to-bf16": ("A", SPEC_A, "x", "bfloat16", 0),
    # (b) one tensor 4x the budget: its shard is staged whole, nothing else beside it.
    "big-tensor-numpy": ("B", SPEC_B, None, "float32", 128 * MiB - BUDGET),
    "big-tensor-fsdp-to-bf16": ("B", SPEC_B, "x", "bfloat16", 128 * MiB - BUDGET),
    # (c) row slices read into column shards: every shard is assembled through bounce buffers.
    "distributed-resharded": ("C", SPEC_C, "-,x", "float32", 128 * MiB - BUDGET + THREADS * BOUNCE),
    "distributed-resharded-to-bf16": ("C", SPEC_C, "-,x", "bfloat16",
                                      128 * MiB - BUDGET + THREADS * BOUNCE),
}


def _load(checkpoints, case: str, budget: int) -> tuple[dict, int]:
    name, spec, sharding, dtype, extra = LOAD_CASES[case]
    m = _run("load", {"path": checkpoints[name], "spec": spec, "sharding": sharding,
                      "dtype": dtype, "budget": budget})
    return m, m["result_bytes"] + budget + extra + MARGIN


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_load_peak_stays_within_result_plus_budget(checkpoints, case):
    name, spec, _, dtype, _ = LOAD_CASES[case]
    assert _nbytes(spec) >= 8 * BUDGET  # ignoring the budget would stage 8x it
    m, bound = _load(checkpoints, case, BUDGET)
    itemsize = 2 if dtype == "bfloat16" else 4
    assert m["result_bytes"] == _nbytes(spec, itemsize)
    message = _describe(m, bound, checkpoint=_nbytes(spec), result=m["result_bytes"], budget=BUDGET)
    print(case, message)
    assert m["peak"] - m["baseline"] <= bound, message


@pytest.mark.timeout(300)
def test_budget_is_what_bounds_the_staging(checkpoints):
    """The same converting load with a budget of the whole checkpoint breaks the bound above:
    the bound is tight enough to notice a budget that is not honoured."""
    m, bound = _load(checkpoints, "hf-fsdp-to-bf16", BUDGET)
    control, _ = _load(checkpoints, "hf-fsdp-to-bf16", _nbytes(SPEC_A))
    message = (f"budgeted: {_describe(m, bound)}; "
               f"unbounded: peak {(control['peak'] - control['baseline']) / MiB:.0f} MiB")
    print(message)
    assert m["peak"] - m["baseline"] <= bound, message
    assert control["peak"] - control["baseline"] > bound, message


# (target sharding, bytes allowed per strided run): column shards of a row-major tensor are
# written as one run per row of each shard, and the save plan holds a Python object per run
# (``planning.Piece``) for the whole save, plus a memoryview per run of the ranges being
# written: ~300 bytes of RSS per run measured, which the bound allows 384.
SAVE_CASES = {"fsdp": ("x", 0), "columns": ("-,x", 384)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_save_peak_stays_within_tree_plus_margin(tmp_path, case):
    """``ost.save`` to a local disk writes the CPU device buffers themselves (``pwritev`` of
    views, 64 MiB ranges on 8 threads): nothing above the tree it saves but the plan."""
    sharding, per_run = SAVE_CASES[case]
    assert _nbytes(SPEC_A) >= 4 * (64 * MiB)  # several times save's 64 MiB write ranges
    m = _run("save", {"path": str(tmp_path / "saved"), "spec": SPEC_A, "sharding": sharding,
                      "layout": "hf", "max_shard_size": "100MB"})
    runs = sum(shape[0] * 8 for _, shape in SPEC_A) if per_run else 0  # a row of each of 8 shards
    bound = MARGIN + runs * per_run
    message = _describe(m, bound, tree=m["tree_bytes"], runs_x_per_run=runs * per_run)
    print(case, message)
    assert m["tree_bytes"] == _nbytes(SPEC_A)
    assert m["peak"] - m["baseline"] <= bound, message


@pytest.mark.timeout(300)
def test_distributed_save_gathers_one_tensor_at_a_time(tmp_path):
    """Column shards of each tensor on one process are stored as one slice (a file holds at most
    one slice of a tensor), so they are copied together, one tensor at a time as its file is
    written: the peak above the tree is about the largest tensor, not the tree."""
    m = _run("save", {"path": str(tmp_path / "saved"), "spec": SPEC_A, "sharding": "-,x",
                      "layout": "distributed", "max_shard_size": "100MB"})
    largest = max(_nbytes([s]) for s in SPEC_A)
    assert _nbytes(SPEC_A) >= 8 * largest  # gathering the whole tree first would break the bound
    bound = 2 * largest + MARGIN
    message = _describe(m, bound, tree=m["tree_bytes"], largest_tensor=largest)
    print(message)
    assert m["peak"] - m["baseline"] <= bound, message


# What a save to an object store keeps in flight: 8 upload threads, each joining one 64 MiB part
# into the request body (the clients then stream it; s3fs's own write buffer would copy it twice
# more: 747 MiB measured for this tree before parts were sent as one request each).
OBJECT_STORE_IN_FLIGHT = 8 * 64 * MiB


@pytest.mark.timeout(300)
def test_object_store_save_peak_is_the_parts_in_flight():
    from tests.support.object_stores import object_store_server

    with object_store_server("s3") as (bucket, env):
        m = _run("save", {"path": f"{bucket}/saved", "spec": SPEC_A, "sharding": "x",
                          "layout": "hf", "max_shard_size": "100MB"}, extra_env=env)
    bound = OBJECT_STORE_IN_FLIGHT + MARGIN
    message = _describe(m, bound, tree=m["tree_bytes"], parts_in_flight=OBJECT_STORE_IN_FLIGHT)
    print(message)
    assert m["peak"] - m["baseline"] <= bound, message


def _consolidate(checkpoints, tmp_path, block: int) -> dict:
    return _run("consolidate", {"src": checkpoints["C"], "dst": str(tmp_path / f"hf-{block}"),
                                "spec": SPEC_C, "block_bytes": block, "max_shard_size": "100MB"})


@pytest.mark.timeout(300)
def test_consolidate_peak_is_a_few_blocks(checkpoints, tmp_path):
    """``consolidate`` holds ``_PREFETCH + 1`` blocks plus a block and a slice part per reader
    thread, whatever the tensor size: a 128 MiB tensor moves through 2 MiB blocks. The same
    copy in 128 MiB blocks (the whole tensor at once) breaks the bound."""
    block = 2 * MiB
    bound = 16 * block + MARGIN
    assert 128 * MiB > bound  # holding the big tensor whole would break the bound
    m = _consolidate(checkpoints, tmp_path, block)
    control = _consolidate(checkpoints, tmp_path, 128 * MiB)
    message = (f"{_describe(m, bound, checkpoint=_nbytes(SPEC_C), block=block)}; in 128 MiB "
               f"blocks: peak {(control['peak'] - control['baseline']) / MiB:.0f} MiB")
    print(message)
    assert m["peak"] - m["baseline"] <= bound, message
    assert control["peak"] - control["baseline"] > bound, message

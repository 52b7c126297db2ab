"""What ``bench/load.py`` and ``bench/save.py`` share: the model, the workers, memory, the header.

Not a package: each benchmark puts this directory on ``sys.path`` and does
``import common``. Kept free of jax/numpy imports at module level so that the
parent processes stay light; the functions that need them import them.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

LAYERS = 8
VOCAB = 32000
SEED = 20240601
SPEC_VERSION = 2  # 2: checkpoints carry block checksums (ost.save writes them by default)
WORKER_TIMEOUT = 600.0
RESULT_MARK = "BENCH_RESULT "
BENCH_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# The synthetic llama-like model.


def llama_shapes(hidden: int, ffn: int, vocab: int = VOCAB, layers: int = LAYERS) -> dict:
    """Names and shapes of a llama-like model: 9 * layers + 3 tensors."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def nbytes_of(shapes: dict) -> int:
    total = 0
    for shape in shapes.values():
        n = 2  # bf16
        for d in shape:
            n *= d
        total += n
    return total


def model_spec(size_gb: float, max_shard_size: str) -> dict:
    """Dims (hidden a multiple of 64, ffn ~2.75x hidden, a multiple of 64) nearest ``size_gb``."""
    best = None
    for hidden in range(64, 16384 + 1, 64):
        ffn = max(64, round(hidden * 2.75 / 64) * 64)
        size = nbytes_of(llama_shapes(hidden, ffn))
        error = abs(size - size_gb * 1e9)
        if best is None or error < best[0]:
            best = (error, hidden, ffn, size)
    _, hidden, ffn, size = best
    return {"version": SPEC_VERSION, "seed": SEED, "layers": LAYERS, "vocab": VOCAB,
            "hidden": hidden, "ffn": ffn, "bytes": size, "max_shard_size": max_shard_size}


# ---------------------------------------------------------------------------
# Which package hashes the block checksums (in the workers).


def without_crc32c_extra() -> None:
    """Makes ``import crc32c`` fail in this worker, before ``orbax_safetensors`` is imported:
    its checksums then hash with ``google-crc32c``, as an install without the extra does."""
    sys.modules["crc32c"] = None


def hasher() -> str:
    """The package ``orbax_safetensors`` hashes its block checksums with in this process."""
    from orbax_safetensors.format import checksums
    return checksums.HASHER


# ---------------------------------------------------------------------------
# Devices and shardings (in the workers).


# The JAX platform the workers run on: "cpu" (8 host devices, the default) or an accelerator's
# ("cuda", "tpu"), whose devices the mesh then spans (one GPU: a mesh of 1).
PLATFORM = os.environ.get("OST_BENCH_PLATFORM", "cpu")
# How many of them the mesh spans: all, or the first N with OST_BENCH_DEVICES=N
# (bench/accelerator.py: 1, the whole model on one device).
MESH_DEVICES = int(os.environ.get("OST_BENCH_DEVICES", "0")) or None


def mesh_1d():
    """A 1-D mesh ``("x",)`` over the workers' devices: the 8 host CPU devices they are started
    with, or every device of ``PLATFORM`` (the first ``MESH_DEVICES`` of them where set)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    if PLATFORM == "cpu" and len(devices) != 8:
        raise RuntimeError(f"expected 8 CPU devices, got {len(devices)}: {devices}")
    return Mesh(np.array(devices[:MESH_DEVICES]), ("x",))


def drop_page_cache() -> None:
    """Empties the page cache (root only), so that the next read comes from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def disk_read_gbps(files: list[Path], direct: bool = False) -> float:
    """The disk's own sequential read bandwidth over ``files`` (GB/s), page cache dropped first:
    what any loader is bounded by on a cold cache (dd with a 64 MB block, in Python; ``direct``:
    ``iflag=direct``, O_DIRECT into a page-aligned buffer, with neither page cache nor readahead)."""
    drop_page_cache()
    buffer = memoryview(mmap.mmap(-1, 64 << 20))
    total, started = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - started) / 1e9


def partition_spec(sharding_name: str, ndim: int):
    """``fsdp``: 2-D tensors by rows; ``tensor_parallel``: by columns; else (and 1-D) replicated."""
    from jax.sharding import PartitionSpec as P

    if sharding_name == "replicated" or ndim != 2:
        return P()
    if sharding_name == "fsdp":
        return P("x", None)
    if sharding_name == "tensor_parallel":
        return P(None, "x")
    raise ValueError(f"unknown sharding {sharding_name!r}")


# ---------------------------------------------------------------------------
# Memory.


def prefault_memory(gb: float) -> None:
    """Touches and frees ``gb`` GB of anonymous memory.

    On a VM whose guest returns freed pages to the host (virtio-balloon free
    page reporting, e.g. Firecracker), the first touch of freshly freed memory
    is several times slower than on bare metal; doing it in the parent before
    every run gives every worker that much host-backed free memory.
    """
    import numpy as np
    chunks, left = [], int(gb * 1e9)
    while left > 0:
        chunks.append(np.ones(min(left, 256 << 20), np.uint8))
        left -= len(chunks[-1])
    del chunks


def prefault_memory_in_child(gb: float) -> None:
    """``prefault_memory`` in a short-lived child process.

    For a worker that wants free memory host-backed right before its timed
    region without disturbing its own allocator: freeing big blocks raises
    glibc's dynamic mmap threshold, after which the worker's later frees go
    back through ``madvise`` rather than ``munmap`` and ``VmHWM`` misses
    their peak.
    """
    code = (f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); import common; "
            f"common.prefault_memory({gb!r})")
    subprocess.run([sys.executable, "-c", code], check=True)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak RSS: ``VmHWM``, the high-water mark of its own address space.

    Not ``ru_maxrss``: Linux keeps that across ``execve`` as the maximum of the
    old address space, and ``subprocess`` spawns with ``vfork``, whose old
    address space is the parent's, so every worker would report at least the
    parent's peak (the parent that just generated the checkpoint, or touched
    ``--prefault-gb``).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KB


def reset_peak_rss() -> bool:
    """Resets this process's ``VmHWM`` to its current RSS (``/proc/self/clear_refs``, Linux >= 4.0).

    Lets a worker that does untimed work first (building a model, touching
    memory) report the peak of its timed region only. False if not supported.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed_load(load, condition: str) -> tuple[object, dict]:
    """A worker's timed region: ``load()`` (which blocks until its arrays are ready) after the
    ``condition``'s preparation, with the peak RSS of the region alone. Returns the result and
    the report fields ``Probe`` measures plus ``peak_rss`` and ``baseline_rss`` (the RSS right
    before the load)."""
    if condition == "warm":
        prefault_memory_in_child(WARM_GB)
    reset_peak_rss()
    baseline = current_rss()
    with Probe() as probe:
        result = load()
    return result, {**probe.report, "peak_rss": peak_rss(), "baseline_rss": baseline}


# ---------------------------------------------------------------------------
# What a run cost: time, CPU, faults, and whether anyone else used the CPU meanwhile.


def _system_cpu() -> tuple[float, float]:
    """Seconds of (user + nice, system) time all CPUs spent since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system = (int(x) for x in fields[:3])
    return (user + nice) / tick, system / tick


def _thp_faults() -> int:
    """Transparent huge pages faulted in, system-wide (``/proc/vmstat`` ``thp_fault_alloc``)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("thp_fault_alloc "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Probe:
    """Measures a timed region: wall seconds, this process's CPU and page faults, huge-page
    faults, and the user CPU every *other* process spent meanwhile.

    A run is *disturbed* when other processes used more than ``DISTURBED_SECONDS`` plus
    ``DISTURBED_FRACTION`` of the run's wall time of user CPU: on a 2-CPU machine anything
    else running takes a core from the run. Kernel threads (writeback, the page-cache
    flushers a save wakes) count as system time and are not held against it. Pass
    ``children=True`` when the measured work runs in child processes (``dd``).
    """

    def __init__(self, children: bool = False):
        self.who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF

    def __enter__(self) -> "Probe":
        self._usage = resource.getrusage(self.who)
        self._cpu = _system_cpu()
        self._thp = _thp_faults()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        self.seconds = time.perf_counter() - self.started
        usage, cpu = resource.getrusage(self.who), _system_cpu()
        own_user = usage.ru_utime - self._usage.ru_utime
        self.report = {
            "seconds": self.seconds,
            "cpu_user": own_user, "cpu_system": usage.ru_stime - self._usage.ru_stime,
            "minor_faults": usage.ru_minflt - self._usage.ru_minflt,
            "major_faults": usage.ru_majflt - self._usage.ru_majflt,
            "thp_faults": _thp_faults() - self._thp,
            "others_cpu": max(0.0, cpu[0] - self._cpu[0] - own_user),
        }
        self.report["disturbed"] = (
            self.report["others_cpu"] > DISTURBED_SECONDS + DISTURBED_FRACTION * self.seconds)


DISTURBED_SECONDS = 0.05
DISTURBED_FRACTION = 0.10
CONDITIONS = ("cold", "warm")
WARM_GB = 4.0
CONDITION_NOTES = {
    "cold": "a fresh process, nothing prefaulted: memory as a user's job finds it",
    "warm": f"the same, after a child of the worker touched and freed {WARM_GB:g} GB right before "
            "the timed region, so that free memory is host-backed on a VM that returns freed "
            "memory to its host",
}


def spread(values: list[float]) -> str:
    """``median [min–max]``."""
    import statistics
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]"


# ---------------------------------------------------------------------------
# Workers: one fresh process per run, one JSON result line.


def report_result(report: dict) -> None:
    """Called by a worker: the one line its parent parses."""
    print(RESULT_MARK + json.dumps(report), flush=True)


def run_undisturbed(run, attempts: int = 4) -> dict:
    """``run()``'s result, run again while it was disturbed (see ``Probe``); the result says
    how many disturbed attempts were discarded."""
    discarded = 0
    for _ in range(attempts):
        result = run()
        if not result.get("ok") or not result.get("disturbed"):
            break
        discarded += 1
        time.sleep(1.0)
    result["discarded"] = discarded
    return result


def progress(result: dict, measured) -> str:
    """A run's progress line: ``measured(result)`` and the disturbed runs discarded, or why it failed."""
    if not result["ok"]:
        return "failed: " + result["error"]
    discarded = result.get("discarded")
    return measured(result) + (f", {discarded} disturbed run(s) discarded" if discarded else "")


def run_worker(script: Path, arguments: list[str]) -> dict:
    """Runs ``script --worker *arguments`` on ``PLATFORM`` (8 host CPU devices by default); its
    result, or why it failed."""
    env = dict(os.environ)
    if PLATFORM == "cpu":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = PLATFORM
    command = [sys.executable, str(script), "--worker", *arguments]
    try:
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT, cwd=BENCH_DIR.parent)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {WORKER_TIMEOUT:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    lines = [l.strip() for l in (done.stderr + done.stdout).splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "Exception" in l or l.startswith("Killed")]
    last = (errors or lines or [f"exit status {done.returncode}"])[-1]
    if done.returncode < 0:
        last = f"killed by signal {-done.returncode} (out of memory?); {last}"
    return {"ok": False, "error": last[:200], "returncode": done.returncode}


# ---------------------------------------------------------------------------
# The table's header.


def machine_line() -> str:
    import psutil
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model}, "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, {platform.system()} {platform.release()}")


def versions_line() -> str:
    from importlib.metadata import version
    return ", ".join(f"{p} {version(p)}" for p in
                     ("jax", "jaxlib", "orbax-checkpoint", "safetensors", "numpy")) + \
        f", Python {platform.python_version()}"


def listed(parser, text: str, known, what: str) -> list[str]:
    """The comma-separated names of ``text``; an unknown one ends the script through
    ``parser.error``, naming the choices."""
    names = [n for n in text.split(",") if n]
    for name in names:
        if name not in known:
            parser.error(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    return names


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def publish(table: str, name: str) -> None:
    """Prints a benchmark's table and keeps it as ``bench/results/<name>`` (gitignored)."""
    out = BENCH_DIR / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(table)
    print(f"(written to {out.relative_to(BENCH_DIR.parent)})", file=sys.stderr)


def cached(home: Path, spec: dict, *also: str) -> bool:
    """Whether ``home`` holds a complete cache for ``spec`` (its ``spec.json``, written last,
    equal to ``spec``, and the files ``also``); otherwise it is cleared for a rewrite."""
    spec_file = home / "spec.json"
    if spec_file.exists() and all((home / name).exists() for name in also):
        try:
            if json.loads(spec_file.read_text()) == spec:
                return True
        except ValueError:
            pass
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    return False


def dispatch(children: dict, arguments, run_all, render, name: str) -> None:
    """A bench's ``main``: ``argv[1]`` naming one of ``children`` (``"--worker"``: the child
    that runs one measurement) hands it the rest of argv; otherwise every measurement runs
    and its table is published as ``name`` (``<name>-quick.md`` with ``--quick``)."""
    if sys.argv[1:2] and sys.argv[1] in children:
        children[sys.argv[1]](*sys.argv[2:])
        return
    args = arguments()
    started = time.perf_counter()
    measured = run_all(args)
    publish(render(args, measured, time.perf_counter() - started), f"{name}-quick.md" if args.quick else f"{name}.md")

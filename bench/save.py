"""Save throughput of ``ost.save`` against its peers, on the same model, in one run.

    .venv/bin/python bench/save.py                 # ~1.1 GB model, 5 repeats, cold and warm
    .venv/bin/python bench/save.py --quick         # ~0.1 GB, 1 repeat: a smoke test
    .venv/bin/python bench/save.py --contenders ours_hf,orbax_standard --repeats 5

What it measures: the wall time of saving a synthetic llama-like bf16 model
(75 tensors, the dims of ``bench/load.py``'s checkpoint) held as ``jax.Array``s
on 8 host CPU devices, FSDP-sharded over a 1-D mesh (every 2-D tensor
``P("x", None)``, 1-D tensors replicated), until it is **durable**: every timed
region ends with ``os.sync()``. Contenders:

* ``ours_hf``: ``ost.save(dir, params, max_shard_size="500MB")`` (HF sharded dir);
* ``ours_distributed``: ``ost.save(dir, params, layout="distributed")``;
* ``ours_nocrc``: ``ours_hf`` with ``checksums=False`` (what the block checksums cost);
* ``ours_hf_google``: ``ours_hf`` hashing with ``google-crc32c``, as installed without the
  ``crc32c`` extra (``ours_hf`` hashes with the ``crc32c`` package where it is installed);
* ``ours_async``: ``ost.async_save(dir, params, max_shard_size="500MB")``, then
  ``.result()``; the table also shows how long ``async_save`` blocked;
* ``orbax_standard``: ``ocp.StandardCheckpointer().save(dir, params)`` +
  ``.wait_until_finished()`` (the checkpointer is built before the timed region);
* ``gather_save_file``: ``jax.device_get(params)`` (every array gathered to one
  host numpy array) + ``safetensors.numpy.save_file(..., metadata={"format": "pt"})``.

Plus ``dd``, the disk's raw sequential write bandwidth measured in the same
alternation: ``dd if=/dev/zero of=<dir>/dd.bin bs=16M count=64 conv=fsync``
(1 GiB), timed by the parent like the others (the ``dd`` process + ``os.sync()``).
It always runs; the table's "% of dd" column is each contender's GB/s over its.

The model is created inside each worker from a fixed seed
(``jax.random.normal`` in bf16, on device, directly in its sharding) before the
timed region; the worker then ``os.sync()``s, so the timed region starts with no
dirty pages of anyone else's. Timed: the save call(s) + ``os.sync()``; the
table also shows the part before ``os.sync()`` and the ``os.sync()`` itself
(ours ``fsync``s its files before it commits, the peers leave that to the page
cache). After the timed region the worker checks that two tensors (one sharded,
one replicated) read back equal to the source: ``ost.load`` for ours,
``safetensors.numpy.load_file`` for ``gather_save_file``, Orbax's ``restore`` for
Orbax. Every run writes into a fresh directory under ``--dir`` that the parent
deletes afterwards (untimed).

Peak RSS is the worker's ``VmHWM``, reset to its current RSS right before the
timed region (``/proc/self/clear_refs``, so that building the model and the
warm-up do not count) and read right after it; "RSS growth" is that peak minus
the RSS right before the save, which already holds the model (on CPU the
"device" buffers live in host memory). Fresh processes and alternation as in
``bench/load.py`` (see its docstring).

Cold and warm: every contender runs both ways, alternating (which goes first
flips every repeat), 5 repeats by default. *Cold* is a fresh worker as a
training job finds its memory; *warm* touches and frees 4 GB in a child of the
worker right before the timed region (in the parent right before ``dd``),
not in the parent before the worker starts: a save worker spends ~10 s
importing jax and building the model first, by which time a VM with free page
reporting has handed the pages back to its host, and the page cache the save
writes into comes from cold memory again. Each run counts its page faults and
the huge pages faulted system-wide, and a run during which other processes
used the CPU is discarded and run again (``common.Probe``).

Results go to stdout and to ``bench/results/save.md`` (``save-quick.md`` with
``--quick``, whose sharded saves use ``max_shard_size="50MB"`` so that they too
write several files and an index), as a markdown table ready to paste into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
from common import (
    BENCH_DIR,
    CONDITION_NOTES,
    CONDITIONS,
    current_rss,
    fmt_gb,
    llama_shapes,
    machine_line,
    mesh_1d,
    model_spec,
    partition_spec,
    peak_rss,
    prefault_memory,
    prefault_memory_in_child,
    Probe,
    publish,
    report_result,
    reset_peak_rss,
    run_undisturbed,
    spread,
    versions_line,
    WARM_GB,
)

CONTENDERS = ("ours_hf", "ours_nocrc", "ours_hf_google", "ours_distributed", "ours_async",
              "orbax_standard", "gather_save_file")
OURS = ("ours_hf", "ours_nocrc", "ours_hf_google", "ours_distributed", "ours_async")
BASELINE = "ours_hf"
MAX_SHARD_SIZE = "500MB"
QUICK_MAX_SHARD_SIZE = "50MB"  # --quick: still several files and an index
DD_BLOCK, DD_COUNT = "16M", 64  # 1 GiB
DD_BYTES = (16 << 20) * DD_COUNT
CONTENDER_NOTES = {
    "ours_hf": "`ost.save(dir, params, max_shard_size=...)`",
    "ours_nocrc": "`ost.save(dir, params, max_shard_size=..., checksums=False)`",
    "ours_hf_google": "`ours_hf` hashing with google-crc32c (the `crc32c` package hidden, as "
                      "without the `crc32c` extra)",
    "ours_distributed": "`ost.save(dir, params, layout=\"distributed\")`",
    "ours_async": "`ost.async_save(dir, params, max_shard_size=...)` → `.result()`; "
                  "blocking = until `async_save` returned",
    "orbax_standard": "`ocp.StandardCheckpointer().save(dir, params)` + `.wait_until_finished()` "
                      "(Orbax defaults: OCDBT + zarr3, zstd-compressed chunks)",
    "gather_save_file": "`jax.device_get(params)` → `safetensors.numpy.save_file(d, path, "
                        "metadata={\"format\": \"pt\"})`",
    "dd": f"`dd if=/dev/zero of=<dir>/dd.bin bs={DD_BLOCK} count={DD_COUNT} conv=fsync` "
          f"({DD_BYTES / 2**30:.0f} GiB), the disk's raw sequential write bandwidth",
}


# ---------------------------------------------------------------------------
# The worker: one contender, in a fresh process.


def verified_names() -> list[str]:
    """One FSDP-sharded 2-D tensor (the last file) and one replicated 1-D tensor."""
    return ["lm_head.weight", "model.norm.weight"]


def make_params(spec: dict) -> dict:
    """The model, on device and FSDP-sharded, from ``spec["seed"]`` (bf16 standard normals)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh = mesh_1d()
    key = jax.random.key(spec["seed"])
    makers: dict = {}
    params = {}
    shapes = llama_shapes(spec["hidden"], spec["ffn"], spec["vocab"], spec["layers"])
    for i, (name, shape) in enumerate(shapes.items()):
        sharding = NamedSharding(mesh, partition_spec("fsdp", len(shape)))
        make = makers.get((shape, sharding))
        if make is None:
            make = makers[(shape, sharding)] = jax.jit(
                lambda k, shape=shape: jax.random.normal(k, shape, jnp.bfloat16),
                out_shardings=sharding)
        params[name] = make(jax.random.fold_in(key, i))
    return jax.block_until_ready(params)


def save_stats_json(stats) -> dict:
    import dataclasses
    return dataclasses.asdict(stats)


def save_ours_hf(out: Path, params: dict, spec: dict, extra: dict, checksums: bool = True) -> None:
    import orbax_safetensors as ost
    stats = ost.save(str(out / "checkpoint"), params, max_shard_size=spec["max_shard_size"],
                     checksums=checksums)
    extra["save_stats"] = save_stats_json(stats)


def save_ours_nocrc(out: Path, params: dict, spec: dict, extra: dict) -> None:
    save_ours_hf(out, params, spec, extra, checksums=False)


def save_ours_hf_google(out: Path, params: dict, spec: dict, extra: dict) -> None:
    save_ours_hf(out, params, spec, extra)  # prepare() hid the crc32c package


def save_ours_distributed(out: Path, params: dict, spec: dict, extra: dict) -> None:
    import orbax_safetensors as ost
    stats = ost.save(str(out / "checkpoint"), params, layout="distributed")
    extra["save_stats"] = save_stats_json(stats)


def save_ours_async(out: Path, params: dict, spec: dict, extra: dict) -> None:
    import orbax_safetensors as ost
    started = time.perf_counter()
    future = ost.async_save(str(out / "checkpoint"), params, max_shard_size=spec["max_shard_size"])
    extra["blocking_seconds"] = time.perf_counter() - started
    extra["save_stats"] = save_stats_json(future.result())


def save_orbax_standard(out: Path, params: dict, spec: dict, extra: dict) -> None:
    checkpointer = extra.pop("checkpointer")
    started = time.perf_counter()
    checkpointer.save(out / "checkpoint", params)
    extra["blocking_seconds"] = time.perf_counter() - started  # it is asynchronous too
    checkpointer.wait_until_finished()
    extra["close"] = checkpointer.close


def save_gather_save_file(out: Path, params: dict, spec: dict, extra: dict) -> None:
    import jax
    from safetensors.numpy import save_file
    host = jax.device_get(params)
    save_file(host, str(out / "model.safetensors"), metadata={"format": "pt"})


SAVERS = {
    "ours_hf": save_ours_hf, "ours_nocrc": save_ours_nocrc, "ours_hf_google": save_ours_hf_google,
    "ours_distributed": save_ours_distributed,
    "ours_async": save_ours_async, "orbax_standard": save_orbax_standard,
    "gather_save_file": save_gather_save_file,
}


def prepare(contender: str, extra: dict) -> None:
    """Untimed set-up a real user would do once, not per save: imports, Orbax's checkpointer."""
    if contender in OURS:
        if contender == "ours_hf_google":
            common.without_crc32c_extra()
        extra["hasher"] = common.hasher()
    elif contender == "gather_save_file":
        import safetensors.numpy  # noqa: F401
    elif contender == "orbax_standard":
        import orbax.checkpoint as ocp
        extra["checkpointer"] = ocp.StandardCheckpointer()


def read_back(contender: str, out: Path, params: dict, names: list[str]) -> dict:
    """``names`` read back from what ``contender`` wrote, as numpy arrays."""
    import numpy as np

    if contender in OURS:
        import jax
        import orbax_safetensors as ost
        got = ost.load(str(out / "checkpoint"), {name: jax.ShapeDtypeStruct(params[name].shape, params[name].dtype)
                                                 for name in names}, strict=False)
    elif contender == "gather_save_file":
        from safetensors.numpy import load_file
        got = load_file(str(out / "model.safetensors"))
    elif contender == "orbax_standard":
        import jax
        import orbax.checkpoint as ocp
        abstract = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for name, x in params.items()}
        with ocp.StandardCheckpointer() as checkpointer:
            got = checkpointer.restore(out / "checkpoint", abstract)
    else:
        raise ValueError(contender)
    return {name: np.asarray(got[name]) if got[name] is not None else None for name in names}


def verify(contender: str, out: Path, params: dict, spec: dict) -> None:
    import numpy as np

    names = verified_names()
    got = read_back(contender, out, params, names)
    for name in names:
        want = np.asarray(params[name])
        if got[name] is None:
            raise AssertionError(f"{name}: not read back")
        if got[name].shape != want.shape or got[name].dtype != want.dtype:
            raise AssertionError(f"{name}: read back {got[name].shape} {got[name].dtype}, "
                                 f"saved {want.shape} {want.dtype}")
        if not np.array_equal(got[name].view(np.uint16), want.view(np.uint16)):
            raise AssertionError(f"{name}: read back values differ from the source")


def tree_size(path: Path) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.lstat(os.path.join(root, name)).st_size
            files += 1
    return size, files


def worker(args) -> None:
    spec = json.loads(args.spec)
    out = Path(args.out)
    import jax

    params = make_params(spec)
    extra: dict = {}
    prepare(args.contender, extra)
    saver = SAVERS[args.contender]
    os.sync()  # start with no dirty pages of anyone else's
    if args.condition == "warm":
        prefault_memory_in_child(WARM_GB)
    peak_reset = reset_peak_rss()

    baseline = current_rss()
    with Probe() as probe:
        saver(out, params, spec, extra)
        saved = time.perf_counter() - probe.started
        os.sync()
    peak = peak_rss()

    if "close" in extra:
        extra.pop("close")()
    verify(args.contender, out, params, spec)
    disk_bytes, disk_files = tree_size(out)
    report = {
        "ok": True, **probe.report, "save_seconds": saved, "sync_seconds": probe.seconds - saved,
        "bytes": sum(int(x.nbytes) for x in params.values()), "tensors": len(params),
        "disk_bytes": disk_bytes, "disk_files": disk_files,
        "peak_rss": peak, "baseline_rss": baseline, "peak_reset": peak_reset,
        "devices": len(jax.devices()),
    }
    for key in ("blocking_seconds", "save_stats", "hasher"):
        if key in extra:
            report[key] = extra[key]
    report_result(report)


# ---------------------------------------------------------------------------
# The parent: runs the workers (and dd), alternating, and prints the table.


def run_dd(directory: Path) -> dict:
    """``dd`` of 1 GiB with ``conv=fsync``, timed like a worker's save (+ ``os.sync()``)."""
    command = ["dd", "if=/dev/zero", f"of={directory / 'dd.bin'}", f"bs={DD_BLOCK}",
               f"count={DD_COUNT}", "conv=fsync"]
    try:
        with Probe(children=True) as probe:
            done = subprocess.run(command, check=False, capture_output=True, text=True,
                                  timeout=common.WORKER_TIMEOUT)
            saved = time.perf_counter() - probe.started
            os.sync()
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    if done.returncode != 0:
        lines = [l for l in done.stderr.splitlines() if l.strip()] or [f"exit status {done.returncode}"]
        return {"ok": False, "error": lines[-1][:200]}
    # "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 1.234 s, 870 MB/s"
    match = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", done.stderr, re.MULTILINE)
    if match is None or int(match.group(1)) != DD_BYTES:
        return {"ok": False, "error": f"unexpected dd output: {done.stderr.strip()[-150:]}"}
    return {"ok": True, **probe.report, "save_seconds": saved, "sync_seconds": probe.seconds - saved,
            "bytes": DD_BYTES, "disk_bytes": DD_BYTES, "disk_files": 1,
            "dd_seconds": float(match.group(2))}


def run_one(contender: str, condition: str, spec: dict, directory: Path) -> dict:
    """One run in a fresh ``directory``, deleted afterwards (untimed)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    os.sync()
    try:
        if contender == "dd":
            if condition == "warm":
                prefault_memory(WARM_GB)
            return run_dd(directory)
        return common.run_worker(Path(__file__).resolve(), [
            "--contender", contender, "--spec", json.dumps(spec), "--out", str(directory),
            "--condition", condition])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def disk_line(directory: Path) -> str:
    """The filesystem ``directory`` is on, from ``/proc/mounts`` (longest mount-point prefix)."""
    target = str(directory.resolve())
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                source, point, fstype, options = line.split()[:4]
                point = point.replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) > len(best[1])):
                    best = (source, point, fstype, options)
    except OSError:
        pass
    if best is None:
        return f"`{target}`"
    source, point, fstype, options = best
    free = shutil.disk_usage(target).free
    return f"`{target}` on {source} ({fstype}, mounted at {point}, {options}; {free / 1e9:.0f} GB free)"


def code_line() -> str:
    """The commit measured, and whether the library had uncommitted changes."""
    def git(*arguments: str) -> str:
        done = subprocess.run(["git", *arguments], check=False, capture_output=True, text=True,
                              cwd=BENCH_DIR.parent)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--", "orbax_safetensors")
    return f"`{commit}`" + (" + uncommitted changes to `orbax_safetensors/`" if dirty else "")


def median_of(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def render(spec: dict, results: dict, args, wall: float) -> str:
    names = llama_shapes(spec["hidden"], spec["ffn"], spec["vocab"], spec["layers"])
    rows = [*args.contenders, "dd"]

    def ok(contender: str, condition: str) -> list[dict]:
        return [r for r in results[contender][condition] if r["ok"]]

    def gbps(contender: str, condition: str) -> float | None:
        runs = ok(contender, condition)
        return (median_of(runs, lambda r: r["bytes"]) / median_of(runs, lambda r: r["seconds"]) / 1e9
                if runs else None)

    lines = [
        (f"### `ost.save` vs peers: {spec['bytes'] / 1e9:.2f} GB bf16 model, FSDP on 8 CPU devices, "
         "to local disk, durable, cold and warm"),
        "",
        (f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
         f"whole benchmark {wall:.0f} s)"),
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}",
        f"- code: {args.code}" + ("" if code_line() == args.code else f" at the start, {code_line()} at the end"),
        f"- disk: {disk_line(Path(args.dir))}",
        (f"- model: {len(names)} tensors, {spec['bytes'] / 1e9:.3f} GB of bf16 tensor data, llama-like "
         f"(layers {spec['layers']}, hidden {spec['hidden']}, ffn {spec['ffn']}, vocab {spec['vocab']}), "
         "`jax.random.normal` made on device in each worker (untimed), FSDP: 2-D tensors "
         "`P(\"x\", None)` on a 1-D mesh of 8 host CPU devices, 1-D tensors replicated; "
         f"HF saves use `max_shard_size=\"{spec['max_shard_size']}\"`"),
        f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']} (for dd: the "
        "parent, right before dd).",
        f"- **timings include `os.sync()`**: timed = the save call(s) + `os.sync()`, so every "
        "contender's bytes are on disk when the clock stops (the worker `os.sync()`s before the "
        "timed region too). Each run is a fresh Python process (`JAX_PLATFORMS=cpu`, 8 host "
        "devices) writing into a fresh directory, deleted after the run; runs alternate contender "
        f"by contender and cold/warm (which goes first alternates), {args.repeats} of each; cells "
        "give `median [min–max]` seconds. A run during which other processes used more than "
        "0.05 s + 10% of its wall time of user CPU is discarded and run again (*discarded*).",
        "- *× ours_hf*: this row's median seconds over ours_hf's (above 1: ours_hf is faster); "
        "*% of dd*: this row's GB/s (tensor bytes / median seconds) over dd's (1 GiB / its median); "
        "*os.sync*, *blocking*: cold medians of the part spent in the final `os.sync()` and until "
        "the save call returned (async saves return early).",
        "- faults: the run's minor page faults (thousands) and transparent huge pages faulted "
        "system-wide, medians. RSS (cold): peak = the worker's `VmHWM` over the timed region "
        "(reset right before it); growth = peak − RSS just before the save, which already holds "
        "the model (CPU \"device\" arrays live in host RAM).",
        "",
        ("| contender | cold s | warm s | × ours_hf cold | × ours_hf warm | % of dd cold "
         "| % of dd warm | os.sync s | blocking s | faults cold (K minor / THP) | faults warm "
         "| peak / growth RSS (GB) | on disk (GB) | discarded |"),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    if any(not r.get("peak_reset", True) for c in rows for runs in results[c].values()
           for r in runs if r["ok"]):
        lines.insert(len(lines) - 3,  # before the blank line and the table's two header rows
                     "- note: `/proc/self/clear_refs` was not writable, so peak RSS also covers "
                     "building the model and the warm-up.")
    notes = []
    for contender in rows:
        runs = [r for c in CONDITIONS for r in results[contender][c]]
        failed = [r for r in runs if not r["ok"]]
        cold, warm = ok(contender, "cold"), ok(contender, "warm")
        if not cold and not warm:
            error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
            lines.append(f"| {contender} | failed: {error} |" + " |" * 12)
            continue
        cells = [spread([r["seconds"] for r in runs]) if runs else "—" for runs in (cold, warm)]
        for c in CONDITIONS:
            mine, base = gbps(contender, c), gbps(BASELINE, c) if BASELINE in results else None
            cells.append(f"{base / mine:.2f}" if mine and base and contender != "dd" else "—")
        for c in CONDITIONS:
            mine, dd = gbps(contender, c), gbps("dd", c)
            cells.append(f"{100 * mine / dd:.0f}%" if mine and dd else "—")
        first = cold or warm
        cells.append(f"{median_of(first, lambda r: r['sync_seconds']):.2f}")
        cells.append(f"{median_of(first, lambda r: r.get('blocking_seconds', r['seconds'])):.2f}")
        for runs in (cold, warm):
            cells.append(f"{median_of(runs, lambda r: r['minor_faults']) / 1e3:.0f} / "
                         f"{median_of(runs, lambda r: r['thp_faults']):.0f}" if runs else "—")
        cells.append(f"{fmt_gb(median_of(first, lambda r: r['peak_rss']))} / "
                     f"{fmt_gb(median_of(first, lambda r: r['peak_rss'] - r['baseline_rss']))}"
                     if "peak_rss" in first[0] else "—")
        cells.append(fmt_gb(median_of(first, lambda r: r["disk_bytes"])))
        discarded = sum(r.get("discarded", 0) for r in runs)
        cells.append(f"{discarded}" + (f"; {len(failed)} failed: {failed[0]['error'].replace('|', '/')}"
                                       if failed else ""))
        lines.append(f"| {contender} | " + " | ".join(cells) + " |")
        middle = sorted(first, key=lambda r: r["seconds"])[len(first) // 2]
        if "save_stats" in middle:
            s = middle["save_stats"]
            notes.append(f"  - {contender}: bytes_written {fmt_gb(s['bytes_written'])} GB, "
                         f"{s['requests']} requests, {s['files']} files, blocking_seconds "
                         f"{s['blocking_seconds']:.2f}, seconds {s['seconds']:.2f} (its own clock, "
                         f"before os.sync); {middle['disk_files']} files on disk")
        elif contender == "orbax_standard":
            notes.append(f"  - {contender}: `save()` returned after {middle['blocking_seconds']:.2f} s "
                         f"(it is asynchronous as well), `wait_until_finished()` after "
                         f"{middle['save_seconds']:.2f} s; {middle['disk_files']} files on disk, "
                         f"{fmt_gb(middle['disk_bytes'])} GB")
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}" for c in rows) + ". "
              "Every worker reads two tensors back (one sharded, one replicated) after the timed "
              "region and fails the run if they differ from the source."]
    if notes:
        lines += ["", "SaveStats and files (median cold run):", *notes]
    return "\n".join(lines) + "\n"


def describe(result: dict) -> str:
    """One run, for the progress lines."""
    if not result["ok"]:
        return "failed: " + result["error"]
    shown = (f"{result['seconds']:.2f} s ({result['sync_seconds']:.2f} in os.sync), "
             f"{result['bytes'] / result['seconds'] / 1e9:.2f} GB/s, "
             f"{result['minor_faults'] / 1e3:.0f}K faults, {result['thp_faults']} THP")
    if "peak_rss" in result:
        shown += f", peak RSS {fmt_gb(result['peak_rss'])} GB"
    if "blocking_seconds" in result:
        shown += f", blocking {result['blocking_seconds']:.2f} s"
    if "dd_seconds" in result:
        shown += f" (dd itself: {result['dd_seconds']:.2f} s)"
    if result.get("discarded"):
        shown += f", {result['discarded']} disturbed run(s) discarded"
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench-save",
                        help="where each run writes (a fresh subdirectory, deleted after it; default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender and condition (5)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated (dd always runs as the disk reference)")
    parser.add_argument("--size-gb", type=float, default=None, help="model size (1.1)")
    parser.add_argument("--quick", action="store_true", help="~0.1 GB model, 1 repeat: a smoke test")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--condition", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    args.repeats = args.repeats or (1 if args.quick else 5)
    args.size_gb = args.size_gb or (0.1 if args.quick else 1.1)
    args.contenders = [c for c in args.contenders.split(",") if c and c != "dd"]
    for c in args.contenders:
        if c not in CONTENDERS:
            parser.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")

    started = time.perf_counter()
    args.code = code_line()
    spec = model_spec(args.size_gb, QUICK_MAX_SHARD_SIZE if args.quick else MAX_SHARD_SIZE)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    results = {c: {k: [] for k in CONDITIONS} for c in [*args.contenders, "dd"]}
    for repeat in range(args.repeats):
        order = conditions if repeat % 2 == 0 else conditions[::-1]
        for contender in [*args.contenders, "dd"]:
            for condition in order:
                result = run_undisturbed(lambda: run_one(
                    contender, condition, spec,
                    root / f"run-{os.getpid()}-{repeat + 1}-{contender}-{condition}"))
                results[contender][condition].append(result)
                print(f"[{repeat + 1}/{args.repeats} {condition}] {contender}: {describe(result)}",
                      file=sys.stderr, flush=True)
    table = render(spec, results, args, time.perf_counter() - started)
    publish(table, ("save-quick.md" if args.quick else "save.md"))


if __name__ == "__main__":
    main()

"""On an accelerator: a llama-like checkpoint loaded into one device and saved from it, ours against its peers.

    .venv/bin/python bench/accelerator.py                  # 2 GB here (8 GB where the device is an accelerator)
    .venv/bin/python bench/accelerator.py --quick          # 0.1 GB, 1 repeat: a smoke test (~3 min here)
    .venv/bin/python bench/accelerator.py --quick --conditions cold --page-cache cold --attempts 1  # the test's
    .venv/bin/python bench/accelerator.py --size-gb 16 --repeats 3 --parts load,overlap

    # On a GPU box, unchanged: its workers run on JAX's default platform, jax.devices()[0] the GPU.
    pip install -e '.[test,bench-peers]' 'jax[cuda12]' instanttensor  # a CUDA jax; the peers are optional
    python bench/accelerator.py                            # 8 GB, every part, page cache dropped and warm
    python bench/accelerator.py --conditions cold          # about half as long: bare metal has no cold-memory
                                                           # penalty to measure (see below)

About 50 fresh processes at the defaults (10 load contenders × 2 page caches × 2 memory conditions,
5 saves × 2, 2 overlap modes × 4): at 8 GB on one GPU, about 10–15 minutes, most of it JAX's and
torch's start-up and the disk; ``--conditions cold`` halves it, ``--parts`` picks parts.

What it measures, each part in one run, every contender side by side in one table:

* **load**: a synthetic llama-like bf16 checkpoint (``bench/load.py``'s: 75 tensors, an HF sharded
  directory with its index, written once by ``ost.save(..., max_shard_size="500MB")`` and cached
  under ``--dir``; values checked against ``expected.npz`` beside it) loaded into ONE device,
  ``jax.devices()[0]`` (a mesh of 1, every tensor ``P()``: ``common.mesh_1d`` with
  ``OST_BENCH_DEVICES=1``). Contenders: ``ours`` (``ost.load(path, target)``, default options),
  ``ours_pooled`` / ``ours_fresh`` (``ost.LoadOptions(staging="pooled")`` / ``"fresh"``: host
  staging recycled from a pool, registered for DMA where the platform allows, or fresh pages;
  the default ``"auto"`` pools on accelerators), ``ours_noverify``
  (``verify_checksums=False``), Orbax's v1 ``SafetensorsLayout``, ``safe_open`` +
  ``jax.device_put`` (both ``bench/load.py``'s loaders), and ``bench/peers.py``'s: Run:ai Model
  Streamer, fastsafetensors on the host (then ``device_put``), and the two that read into CUDA
  memory themselves: fastsafetensors' GPU mode and InstantTensor 0.2. Each with the page cache
  **dropped** (``echo 3 > /proc/sys/vm/drop_caches`` right before the run: the bytes come off the
  disk) and **warm** (every file read right before the run). The disk's own sequential read
  bandwidth (``common.disk_read_gbps``, dd-like, page cache dropped; buffered, and past the page
  cache with ``O_DIRECT``, what fastsafetensors and Run:ai read with) is measured in the same run,
  at its start and its end; a share "of disk" is of the faster of the two. Timed: the load
  call + ``jax.block_until_ready``; every run's result is then checked (names, shapes, dtypes,
  shardings, and the first and last rows of six tensors against the values saved with the
  checkpoint, ``bench/load.py``'s ``verify``) before it counts.
* **save**: the same model made on the device (``jax.random.normal`` in bf16, untimed) and saved
  until durable, ``bench/save.py``'s workers unchanged: ``ours`` (``ost.save``), ``ours_nocrc``
  (``checksums=False``), Orbax's ``StandardCheckpointer``, gather + ``safetensors.numpy.save_file``
  (``jax.device_get``: one numpy array per tensor), and ``dd`` (the disk's raw write bandwidth).
  Timed: the save call(s) + ``os.sync()``; two tensors are read back and compared after.
* **checksums**: what the block checksums cost, from the runs above: ``ours`` against
  ``ours_noverify`` (loads) and ``ours`` against ``ours_nocrc`` (saves).
* **overlap**: ``ost.async_load`` overlapping a real compile, ``bench/overlap.py``'s llama-like
  forward step (every layer unrolled) lowered for the loaded target and compiled: the compile
  alone, ``ost.load`` alone (the load part's ``ours`` runs, where it ran: the same call in the
  same kind of worker), and ``ost.async_load(...)``, the compile, then ``.result()``, each in its
  own process; *hidden* is (load + compile) − overlapped, and its share of the shorter of the
  two (the most that overlapping can hide).

Why fresh processes: every run starts from the same state (no allocator pools, staging pools,
jit caches, CUDA contexts or imports left by an earlier contender), the peak RSS is per run, and
a compile is not served from the process's cache. Imports, the backend's start-up (the CUDA
context: torch's too for the CUDA peers) and building the target happen before the clock. Runs
alternate contender by contender and cold/warm (which goes first flips every repeat). Peak RSS is
the worker's ``VmHWM`` over the timed region (reset right before it): host memory, the staging
and whatever a loader keeps on the host; on CPU the "device" arrays live in host memory too.

Memory, cold and warm (``common.CONDITION_NOTES``): *cold* is a fresh worker with nothing
prefaulted, as a job finds its memory; *warm* the same after a child of the worker touched and
freed 4 GB right before the timed region (on a VM that returns freed memory to its host, the
first touch of fresh memory is several times slower). Not to be confused with the page cache,
dropped or warm, which says where the checkpoint's bytes come from. A run during which other
processes used the CPU is discarded and run again (``--attempts``, ``common.run_undisturbed``).

The platform is JAX's default here (``OST_BENCH_PLATFORM`` overrides it: ``cpu``, ``cuda``,
``rocm``, ``tpu``; so does ``JAX_PLATFORMS`` naming one of them), found by asking a child
process, so that the parent never holds a device.
Nothing assumes the device is a CPU; on CPU the workers start with 8 host devices (as the other
benches) and use the first.

"n/a (reason)": the contender cannot run here, and the row says why: a peer not installed, a
CUDA peer on a machine without CUDA (or with a torch that sees none, or one that failed on the
device: the exception), or the page cache that cannot be dropped (not root). A contender that can run and fails says "failed: ..." instead. Neither
stops the bench.

Results go to stdout and to ``bench/results/accelerator.md`` (``accelerator-quick.md`` with
``--quick``, whose 0.1 GB checkpoint uses ``max_shard_size="50MB"``, still a sharded directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
import load as load_bench
import peers
import save as save_bench
from common import (
    CONDITION_NOTES,
    CONDITIONS,
    fmt_gb,
    model_spec,
    run_undisturbed,
    spread,
)
from overlap import forward

PARTS = ("load", "save", "overlap")
OURS_OPTIONS = {"ours": {}, "ours_pooled": {"staging": "pooled"}, "ours_fresh": {"staging": "fresh"},
                "ours_noverify": {"verify_checksums": False}}
LOAD_CONTENDERS = (*OURS_OPTIONS, "orbax_layout", "safe_open", "instanttensor", "fastsafetensors",
                   "fastsafetensors_gpu", "runai")
SAVE_CONTENDERS = {"ours": "ours_hf", "ours_nocrc": "ours_nocrc", "orbax_standard": "orbax_standard",
                   "gather_save_file": "gather_save_file", "dd": "dd"}  # ours -> bench/save.py's name
MODES = {"compile": "compile alone", "load": "`ost.load` alone",
         "overlapped": "`ost.async_load` → compile → `.result()`"}
PAGE_CACHES = {"cold": "dropped", "warm": "warm"}  # --page-cache value -> the tables' label
TOKENS = (8, 16)  # the step's input: a batch of token ids
QUICK_SIZE_GB = 0.1
INSTALL = {"instanttensor": "`pip install instanttensor` (0.2.2 on PyPI, CUDA + torch)"}
LOAD_NOTES = {
    **{c: load_bench.CONTENDER_NOTES[c] for c in ("ours", "ours_noverify", "orbax_layout", "safe_open")},
    "ours_pooled": "`ost.load(path, target, options=ost.LoadOptions(staging=\"pooled\"))`: host staging "
                   "recycled from a pool, registered for DMA where the platform allows",
    "ours_fresh": "`ost.load(path, target, options=ost.LoadOptions(staging=\"fresh\"))`: fresh host pages",
    **{c: peers.CONTENDER_NOTES[c] for c in ("instanttensor", "fastsafetensors", "fastsafetensors_gpu", "runai")},
}
SAVE_NOTES = {"ours": save_bench.CONTENDER_NOTES["ours_hf"],
              **{c: save_bench.CONTENDER_NOTES[c] for c in SAVE_CONTENDERS if c != "ours"}}
SAVE_NOTES["gather_save_file"] += " (the same gather as `np.asarray` of each array)"


class NotAvailable(Exception):
    """The contender cannot run here; its row says n/a and why."""


# ---------------------------------------------------------------------------
# The workers: one run in a fresh process (``--worker <json>``).


def load_ours(checkpoint: Path, target: dict, extra: dict):
    import orbax_safetensors as ost
    return ost.load(str(checkpoint), target, stats=extra["stats"], options=extra["options"])


def prepare(contender: str, extra: dict):
    """Imports and set-up before the clock; returns the loader. Raises ``NotAvailable``."""
    if contender in OURS_OPTIONS:
        import orbax_safetensors as ost
        extra["options"] = ost.LoadOptions(**OURS_OPTIONS[contender])
        extra["stats"] = ost.LoadStats()
        return load_ours
    if contender in peers.CUDA_PEERS:
        try:
            peers.prepare(contender)
        except Exception as e:  # noqa: BLE001 (whatever stops a CUDA peer makes its n/a)
            raise NotAvailable(f"{type(e).__name__}: {e}") from None
        return peers.LOADERS[contender]
    load_bench.prepare(contender)
    return load_bench.LOADERS[contender]


def device_info() -> dict:
    import jax
    device = jax.devices()[0]
    return {"platform": device.platform, "kind": device.device_kind, "name": str(device),
            "visible": len(jax.devices()), "version": device.client.platform_version}


def checkpoint_and_target(args: dict):
    """The worker's checkpoint home, its spec and the target: every tensor on the one device."""
    home = Path(args["home"])
    spec = json.loads((home / "spec.json").read_text())
    return home, spec, load_bench.build_target(spec, "replicated")  # P() over a mesh of 1


def load_worker(args: dict) -> dict:
    contender = args["contender"]
    if contender in peers.CUDA_PEERS:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # room for torch's allocator
    import jax

    home, spec, target = checkpoint_and_target(args)
    extra: dict = {}
    try:
        loader = prepare(contender, extra)
        load = partial(loader, home / "checkpoint", target, extra)
        result, report = common.timed_load(lambda: jax.block_until_ready(load()), args["condition"])
    except NotAvailable as e:
        return {"ok": False, "na": str(e)}
    except Exception as e:  # a CUDA peer that fails on the device: n/a (why)
        if contender not in peers.CUDA_PEERS:
            raise
        return {"ok": False, "na": f"{type(e).__name__}: {e}"[:300]}
    load_bench.verify(result, target, spec, home / "expected.npz")
    report |= {"ok": True, "checked": True, "bytes": sum(int(x.nbytes) for x in result.values()),
               "device": device_info()}
    if "stats" in extra:
        report["load_stats"] = dataclasses.asdict(extra["stats"])
    return report


def overlap_worker(args: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import orbax_safetensors as ost

    home, spec, target = checkpoint_and_target(args)
    path = str(home / "checkpoint")
    step = jax.jit(partial(forward, layers=spec["layers"]))

    def compile_step():
        return step.lower(target, jax.ShapeDtypeStruct(TOKENS, jnp.int32)).compile()

    def overlapped():
        loading = ost.async_load(path, target)
        compiled = compile_step()
        return jax.block_until_ready(loading.result()), compiled

    timed = {"compile": lambda: (None, compile_step()),
             "load": lambda: (jax.block_until_ready(ost.load(path, target)), None),
             "overlapped": overlapped}[args["mode"]]
    (params, compiled), report = common.timed_load(timed, args["condition"])
    report |= {"ok": True, "device": device_info()}
    if params is not None:
        load_bench.verify(params, target, spec, home / "expected.npz")
        report |= {"checked": True, **({"bytes": spec["bytes"]} if args["mode"] == "load" else {})}
    if params is not None and compiled is not None:  # the compiled step runs on what was loaded
        logits = np.asarray(compiled(params, jnp.zeros(TOKENS, jnp.int32)))
        if logits.shape != (*TOKENS, spec["vocab"]):
            raise AssertionError(f"the step gave logits of shape {logits.shape}")
    return report


WORKERS = {"load": load_worker, "overlap": overlap_worker}


# ---------------------------------------------------------------------------
# The parent.


def detect_platform() -> str:
    """``OST_BENCH_PLATFORM``, else the platform of JAX's first device here, asked in a child (a
    parent that started a backend would hold the device, and on a GPU most of its memory)."""
    if os.environ.get("OST_BENCH_PLATFORM"):
        return os.environ["OST_BENCH_PLATFORM"]
    if os.environ.get("JAX_PLATFORMS", "") in ("cpu", "cuda", "rocm", "tpu"):  # one platform, named
        return os.environ["JAX_PLATFORMS"]
    code = ("import json, jax; d = jax.devices()[0]; "
            "print(json.dumps([d.platform, d.client.platform_version]))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=common.WORKER_TIMEOUT)
    if done.returncode != 0:
        print(f"could not ask JAX for its devices, running on cpu: {done.stderr.strip()[-300:]}",
              file=sys.stderr)
        return "cpu"
    platform, version = json.loads(done.stdout.strip().splitlines()[-1])
    if platform == "gpu":
        return "rocm" if "rocm" in version.lower() else "cuda"
    return platform


def unavailable(contender: str) -> str | None:
    """Why a load contender cannot run here, as far as the parent can tell without running it."""
    if contender in peers.CUDA_PEERS and common.PLATFORM != "cuda":
        return f"needs a CUDA device; this run's devices are {common.PLATFORM}"
    if contender not in OURS_OPTIONS and not load_bench.available(contender):
        return "not installed: " + INSTALL.get(contender, "the `bench-peers` extra")
    return None


def page_cache_problem() -> str | None:
    """Why the page cache cannot be dropped here (not root), or None."""
    try:
        common.drop_page_cache()
    except OSError as e:
        return f"cannot drop the page cache: {e}"
    return None


def prepare_page_cache(page_cache: str, files: list[Path]) -> None:
    if page_cache == "cold":
        common.drop_page_cache()
    else:
        load_bench.warm_page_cache(files)


def run_in_worker(part: str, home: Path, files: list[Path], page_cache: str, **payload) -> dict:
    prepare_page_cache(page_cache, files)
    return common.run_worker(Path(__file__).resolve(), [json.dumps({"part": part, "home": str(home), **payload})])


def shown(result: dict) -> str:
    """One run, for the progress lines."""
    if "na" in result:
        return f"n/a ({result['na']})"

    def measured(r: dict) -> str:
        return (f"{r['seconds']:.2f} s" + (f", {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s" if r.get("bytes") else "")
                + (f", peak RSS {fmt_gb(r['peak_rss'])} GB" if "peak_rss" in r else "")
                + (" (disturbed, kept)" if r.get("disturbed") else ""))

    kept = bool(result.get("disturbed"))  # run_undisturbed counts the kept last attempt as discarded too
    return common.progress({**result, "discarded": result.get("discarded", 0) - kept}, measured)


def run_all(args) -> dict:
    """results[part][page cache or ""][contender or mode][condition] = [run, ...]; na[part][name] = why."""
    spec = model_spec(args.size_gb, load_bench.QUICK_MAX_SHARD_SIZE if args.quick else load_bench.MAX_SHARD_SIZE)
    save_spec = model_spec(args.size_gb, save_bench.QUICK_MAX_SHARD_SIZE if args.quick else save_bench.MAX_SHARD_SIZE)
    home = load_bench.ensure_checkpoint(Path(args.dir), spec)
    files = load_bench.checkpoint_files(home / "checkpoint")
    save_root = Path(args.save_dir)
    save_root.mkdir(parents=True, exist_ok=True)
    page_caches = [p for p in args.page_caches if p != "cold" or not args.page_cache_na]
    disk = {"buffered": [], "direct": []}
    if "cold" in page_caches:
        for way in disk:
            disk[way].append(common.disk_read_gbps(files, direct=way == "direct"))
    na = {"load": {c: why for c in args.load_contenders if (why := unavailable(c))}, "save": {}, "overlap": {}}
    results = {"load": {p: {c: {k: [] for k in CONDITIONS} for c in args.load_contenders} for p in page_caches},
               "save": {"": {c: {k: [] for k in CONDITIONS} for c in args.save_contenders}},
               "overlap": {p: {m: {k: [] for k in CONDITIONS} for m in MODES} for p in page_caches}}

    if "load" in args.parts and "ours" in args.load_contenders:  # ost.load alone: the load table's ours
        for page_cache in page_caches:
            results["overlap"][page_cache]["load"] = results["load"][page_cache]["ours"]
    overlap_modes = [m for m in MODES if m != "load" or not ("load" in args.parts and "ours" in args.load_contenders)]

    def measure(part: str, page_cache: str, name: str, condition: str, run, label: str) -> None:
        if name in na[part]:
            return
        result = run_undisturbed(run, args.attempts)
        if "na" in result or (not result["ok"] and name in peers.CUDA_PEERS):
            na[part][name] = result.get("na") or result["error"]  # the same on every later run
        else:
            results[part][page_cache][name][condition].append(result)
        print(f"[{label} {condition}] {name}: {shown(result)}", file=sys.stderr, flush=True)

    for repeat in range(args.repeats):
        order = args.conditions if repeat % 2 == 0 else args.conditions[::-1]
        counter = f"{repeat + 1}/{args.repeats}"
        for page_cache in page_caches if "load" in args.parts else ():
            for contender in args.load_contenders:
                for condition in order:
                    measure("load", page_cache, contender, condition, partial(
                        run_in_worker, "load", home, files, page_cache, contender=contender, condition=condition),
                        f"{counter} load, page cache {PAGE_CACHES[page_cache]}")
        for contender in args.save_contenders if "save" in args.parts else ():
            for condition in order:
                directory = save_root / f"run-{os.getpid()}-{repeat + 1}-{contender}-{condition}"
                measure("save", "", contender, condition, partial(
                    save_bench.run_one, SAVE_CONTENDERS[contender], condition, save_spec, directory),
                    f"{counter} save")
        for page_cache in page_caches if "overlap" in args.parts else ():
            for mode in overlap_modes:
                for condition in order:
                    measure("overlap", page_cache, mode, condition, partial(
                        run_in_worker, "overlap", home, files, page_cache, mode=mode, condition=condition),
                        f"{counter} overlap, page cache {PAGE_CACHES[page_cache]}")
    for runs in results["save"][""].values():  # bench/save.py's workers read two tensors back, or fail
        for r in (r for rs in runs.values() for r in rs if r["ok"] and "dd_seconds" not in r):
            r["checked"] = True
    for way, runs in disk.items():
        if runs:
            runs.append(common.disk_read_gbps(files, direct=way == "direct"))
    return {"spec": spec, "save_spec": save_spec, "files": files, "disk": disk, "results": results, "na": na}


# ---------------------------------------------------------------------------
# The tables.


def ok(runs: dict, condition: str) -> list[dict]:
    return [r for r in runs.get(condition, []) if r["ok"]]


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def gbps(runs: list[dict]) -> float | None:
    return median(runs, "bytes") / median(runs, "seconds") / 1e9 if runs and runs[0].get("bytes") else None


def cells(runs: dict, base: dict | None, disk: float | None = None) -> list[str]:
    """A row's measured cells: seconds, GB/s (and its share of the disk's ``disk`` GB/s) and × base
    (its median seconds over base's: above 1, base is faster), cold then warm each, and peak RSS
    cold / warm."""
    out = [spread([r["seconds"] for r in ok(runs, c)]) if ok(runs, c) else "—" for c in CONDITIONS]
    out += [(f"{rate:.2f}" + (f" ({100 * rate / disk:.0f}% of disk)" if disk else ""))
            if (rate := gbps(ok(runs, c))) else "—" for c in CONDITIONS]
    out += [f"{median(ok(runs, c), 'seconds') / median(ok(base, c), 'seconds'):.2f}"
            if base is not None and ok(runs, c) and ok(base, c) else "—" for c in CONDITIONS]
    peaks = [fmt_gb(median(ok(runs, c), "peak_rss")) if ok(runs, c) and "peak_rss" in ok(runs, c)[0] else "—"
             for c in CONDITIONS]
    return out + [" / ".join(peaks)]


def accounting(runs: dict) -> list[str]:
    """Checked runs (the result compared with the source) over kept runs; disturbed runs discarded
    (and kept: the last attempt's), failed runs."""
    every = [r for c in CONDITIONS for r in runs.get(c, [])]
    kept = [r for r in every if r["ok"]]
    checked = sum(bool(r.get("checked")) for r in kept)
    disturbed = sum(bool(r.get("disturbed")) for r in kept)  # run_undisturbed counts these in "discarded"
    discarded = f"{sum(r.get('discarded', 0) for r in every) - disturbed}" + (
        f" ({disturbed} kept)" if disturbed else "")
    failed = [r for r in every if not r["ok"]]
    if failed:
        discarded += f"; {len(failed)} failed: " + failed[0]["error"].replace("|", "/")
    return [f"{checked}/{len(kept)}" if checked else "—", discarded]


def row(labels: list[str], runs: dict, base: dict | None, na: str | None, width: int,
        disk: float | None = None) -> str:
    """A table row of ``width`` cells: n/a (why), failed (why), or its measured cells."""
    if na is not None:
        return "| " + " | ".join([*labels, f"n/a ({na.replace('|', '/')})"]) + " |" + " |" * (width - len(labels) - 1)
    if not any(ok(runs, c) for c in CONDITIONS):
        failed = [r for c in CONDITIONS for r in runs.get(c, [])]
        why = failed[0]["error"].replace("|", "/") if failed else "not run"
        return "| " + " | ".join([*labels, f"failed: {why}"]) + " |" + " |" * (width - len(labels) - 1)
    return "| " + " | ".join([*labels, *cells(runs, base, disk), *accounting(runs)]) + " |"


MEASURED = ("cold s | warm s | GB/s cold | GB/s warm | × ours cold | × ours warm | peak RSS cold / warm (GB) "
            "| checked | discarded")


def header(args, measured: dict, wall: float) -> list[str]:
    spec, files = measured["spec"], measured["files"]
    devices = [r["device"] for part in measured["results"].values() for by_name in part.values()
               for runs in by_name.values() for rs in runs.values() for r in rs if r["ok"] and "device" in r]
    device = (f"`{devices[0]['kind']}` ({devices[0]['platform']}, {devices[0]['version']}), the mesh: "
              f"`{devices[0]['name']}` alone ({devices[0]['visible']} visible)" if devices else "no worker reported one")
    disk = measured["disk"]
    return [
        f"### On an accelerator: {spec['bytes'] / 1e9:.2f} GB bf16 llama-like checkpoint into one "
        f"{devices[0]['kind'] if devices else common.PLATFORM} device, ours vs peers",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, whole benchmark {wall:.0f} s)",
        f"- device: {device}; `JAX_PLATFORMS={common.PLATFORM}`",
        f"- machine: {common.machine_line()}",
        f"- versions: {common.versions_line()}, {peer_versions()}",
        f"- code: {args.code}",
        f"- disk: {save_bench.disk_line(Path(args.dir))}; its own sequential read, page cache dropped: "
        + ("; ".join(f"{way} " + " and ".join(f"{g:.2f}" for g in runs) for way, runs in disk.items())
           + " GB/s (start and end of the run; buffered: `dd bs=64M`, direct: with `iflag=direct`)"
           if disk_gbps(disk) else f"n/a ({args.page_cache_na or 'the page cache was not dropped in this run'})"),
        f"- checkpoint: {len(load_bench.weight_map(home_of(files)))} tensors, {spec['bytes'] / 1e9:.3f} GB of bf16 "
        f"in {len(files)} file(s), llama-like (layers {spec['layers']}, hidden {spec['hidden']}, ffn {spec['ffn']}, "
        f"vocab {spec['vocab']}), HF sharded dir, `max_shard_size=\"{spec['max_shard_size']}\"`; the save's model "
        "has the same dims",
        f"- memory **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. Page cache "
        "**dropped**: `echo 3 > /proc/sys/vm/drop_caches` right before the run; **warm**: every file read "
        "right before the run.",
        f"- every run a fresh process; {args.repeats} run(s) of each, alternating; cells `median [min–max]` "
        "seconds; GB/s = tensor bytes / median seconds; *× ours*: the row's median over ours' (above 1: "
        "ours is faster); peak RSS: the worker's `VmHWM` over the timed region (host memory); *checked*: "
        "runs whose result was compared with the source (loads: names, shapes, dtypes, shardings and "
        "the first/last rows of 6 tensors against the values saved with the checkpoint; saves: two "
        "tensors read back) over runs kept; *discarded*: runs during which other processes used the "
        "CPU, run again.",
    ]


def disk_gbps(disk: dict) -> float | None:
    """The disk's own read in this run: the faster of its buffered and direct medians."""
    return max((statistics.median(runs) for runs in disk.values() if runs), default=None)


def home_of(files: list[Path]) -> Path:
    return files[0].parent


def peer_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def one(package: str) -> str:
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} not installed"
    return ", ".join(one(p) for p in ("torch", "runai-model-streamer", "fastsafetensors", "instanttensor"))


def load_table(args, measured: dict) -> list[str]:
    results, na, disk = measured["results"]["load"], measured["na"]["load"], measured["disk"]
    lines = ["", "#### Load into one device", "",
             f"| page cache | contender | {MEASURED} |", "|---|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for page_cache in args.page_caches:
        label = PAGE_CACHES[page_cache]
        by_contender = results.get(page_cache)
        for contender in args.load_contenders:
            if by_contender is None:  # not dropped: not root
                lines.append(row([label, contender], {}, None, args.page_cache_na, 11))
                continue
            lines.append(row([label, contender], by_contender[contender], by_contender.get("ours"),
                             na.get(contender), 11, disk_gbps(disk) if page_cache == "cold" else None))
    lines += ["", "Page cache dropped: GB/s and its share of the disk's own sequential read (measured in this "
              "run: the faster of the header's buffered and direct medians). Contenders: "
              + "; ".join(f"**{c}**: {LOAD_NOTES[c]}" for c in args.load_contenders) + "."]
    accounts = []
    for contender in (c for c in OURS_OPTIONS if c in args.load_contenders and c not in na):
        stats = [r["load_stats"] for by_contender in results.values() for runs in by_contender[contender].values()
                 for r in runs if r["ok"] and "load_stats" in r]
        if stats:  # the first kept run's LoadStats
            s = stats[0]
            accounts.append(f"**{contender}** read {fmt_gb(s['bytes_read'])} GB for {fmt_gb(s['bytes_needed'])} GB "
                            f"needed in {s['requests']} requests over {s['files']} file(s)"
                            + (f", staging peak {fmt_gb(s['staging_peak'])} GB of which "
                               f"{fmt_gb(s.get('staging_pinned', 0))} GB registered for DMA"
                               if "staging_peak" in s else ""))
    if accounts:
        lines += ["", "`ost.LoadStats` (a run each): " + "; ".join(accounts) + "."]
    return lines


def save_table(args, measured: dict) -> list[str]:
    results, na = measured["results"]["save"][""], measured["na"]["save"]
    spec = measured["save_spec"]
    lines = ["", "#### Save from device memory, durable (`os.sync()` included)", "",
             f"| contender | {MEASURED} |", "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for contender in args.save_contenders:
        base = results.get("ours") if contender != "dd" else None  # dd writes its own 1 GiB
        lines.append(row([contender], results[contender], base, na.get(contender), 10))
    lines += ["", f"The model: `bench/save.py`'s (same dims, `max_shard_size=\"{spec['max_shard_size']}\"`), "
              "made on the one device in each worker before the clock (its timed region: the save call(s) + "
              "`os.sync()`, from a process that `os.sync()`ed first). dd's row: 1 GiB of zeros, its own GB/s. "
              "Contenders: " + "; ".join(f"**{c}**: {SAVE_NOTES[c]}" for c in args.save_contenders) + "."]
    return lines


def checksums_table(args, measured: dict) -> list[str]:
    """Checked over unchecked, from the load and save runs."""
    pairs = [(f"load, page cache {PAGE_CACHES[p]}", measured["results"]["load"].get(p, {}), "ours_noverify")
             for p in args.page_caches] + [("save", measured["results"]["save"][""], "ours_nocrc")]
    lines = ["", "#### Block checksums on vs off", "",
             "| operation | checked cold s | unchecked cold s | cost cold | checked warm s | unchecked warm s | cost warm |",
             "|---|---|---|---:|---|---|---:|"]
    for label, by_contender, unchecked in pairs:
        if "ours" not in by_contender or unchecked not in by_contender:
            continue
        out = []
        for c in CONDITIONS:
            on, off = ok(by_contender["ours"], c), ok(by_contender[unchecked], c)
            out += [spread([r["seconds"] for r in on]) if on else "—", spread([r["seconds"] for r in off]) if off else "—",
                    f"**{median(on, 'seconds') / median(off, 'seconds') - 1:+.0%}**" if on and off else "—"]
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    lines += ["", "*cost*: the checked median over the unchecked one, minus 1. Checked: `ours` (loads verify "
              "every block checksum they read; saves write them); unchecked: `ost.LoadOptions(verify_checksums="
              "False)` / `ost.save(..., checksums=False)`."]
    return lines


def overlap_table(args, measured: dict) -> list[str]:
    results = measured["results"]["overlap"]
    lines = ["", "#### `ost.async_load` overlapping the compile of a llama-like step", "",
             f"| page cache | mode | {MEASURED} |", "|---|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for page_cache, by_mode in results.items():
        label = PAGE_CACHES[page_cache]
        for mode, name in MODES.items():
            lines.append(row([label, name], by_mode[mode], None, None, 11))
        hidden = []
        for c in CONDITIONS:
            alone = [ok(by_mode[m], c) for m in MODES]
            if all(alone):
                compile_s, load_s, both_s = (median(runs, "seconds") for runs in alone)
                saved = compile_s + load_s - both_s
                hidden.append(f"{saved:.2f} s, {100 * saved / min(compile_s, load_s):.0f}% of the shorter")
            else:
                hidden.append("—")
        lines.append(f"| {label} | **hidden**: compile + load − overlapped | " + " | ".join(hidden) + " |" + " |" * 7)
    lines += ["", f"The step: `bench/overlap.py`'s forward pass (every layer unrolled), `jax.jit(...).lower(target, "
              f"tokens {TOKENS}).compile()` for the loaded target; after the timed region the compiled step runs "
              "once on the loaded arrays (overlapped mode). `ost.load` alone: the load table's `ours` runs where "
              "this run has them (the same call in the same kind of worker). *hidden*: how much of the "
              "shorter of load and compile overlapping hid (100%: all of it; above 100% or below 0: the "
              "runs' own spread)."]
    return lines


def render(args, measured: dict, wall: float) -> str:
    lines = header(args, measured, wall)
    if "load" in args.parts:
        lines += load_table(args, measured)
    if "save" in args.parts:
        lines += save_table(args, measured)
    if "load" in args.parts or "save" in args.parts:
        lines += checksums_table(args, measured)
    if "overlap" in args.parts:
        lines += overlap_table(args, measured)
    return "\n".join(lines) + "\n"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--save-dir", default="/tmp/ost-bench-save",
                        help="where saves write (a fresh subdirectory per run, deleted after it; default %(default)s)")
    parser.add_argument("--size-gb", type=float, default=None,
                        help="checkpoint size (8 on an accelerator, 2 on CPU; 0.1 with --quick)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per contender and condition (%(default)s)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: load, save, overlap "
                        "(the checksums table comes from the load and save runs)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated, load's and save's (default: all); dd always runs with the saves")
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="memory: cold, warm")
    parser.add_argument("--page-cache", default="cold,warm", help="for loads: cold (dropped), warm")
    parser.add_argument("--attempts", type=int, default=3, help="runs in all while disturbed (%(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"a {QUICK_SIZE_GB} GB model: a smoke test")
    args = parser.parse_args()
    args.parts = common.listed(parser, args.parts, PARTS, "part")
    args.conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    args.page_caches = common.listed(parser, args.page_cache, PAGE_CACHES, "page cache")
    known = [*LOAD_CONTENDERS, *(c for c in SAVE_CONTENDERS if c not in LOAD_CONTENDERS)]
    chosen = common.listed(parser, args.contenders, known, "contender") if args.contenders else known
    args.load_contenders = [c for c in LOAD_CONTENDERS if c in chosen]
    args.save_contenders = [c for c in SAVE_CONTENDERS if c in chosen or c == "dd"]

    common.PLATFORM = os.environ["OST_BENCH_PLATFORM"] = detect_platform()  # the workers' JAX_PLATFORMS
    os.environ["OST_BENCH_DEVICES"] = "1"  # the workers' mesh: the first device alone
    args.size_gb = args.size_gb or (QUICK_SIZE_GB if args.quick else 2.0 if common.PLATFORM == "cpu" else 8.0)
    args.page_cache_na = page_cache_problem() if "cold" in args.page_caches else None
    args.code = save_bench.code_line()
    return args


def main() -> None:
    common.dispatch({"--worker": lambda payload: common.report_result(
                        WORKERS[json.loads(payload)["part"]](json.loads(payload)))},
                    arguments, run_all, render, "accelerator")


if __name__ == "__main__":
    main()

"""Load and save throughput through a local S3 server (moto), ours against its peers, in one run.

    .venv/bin/python bench/object_store.py                    # ~256 MB checkpoint, 1 repeat
    .venv/bin/python bench/object_store.py --size-mb 64       # a smoke test
    .venv/bin/python bench/object_store.py --repeats 3 --prefault-gb 10

What it measures: the wall time of moving a synthetic llama-like bf16 checkpoint
(75 tensors, the model of ``bench/load.py``; an HF sharded directory with
``model.safetensors.index.json``, written by ``ost.save(..., max_shard_size=...)``
and uploaded once, untimed, into a bucket) between an S3 server and
``jax.Array``s on host CPU devices, FSDP-sharded (2-D tensors ``P("x", None)``
over a 1-D mesh of 8 devices, 1-D tensors replicated). The server is
``python -m moto.server`` on a free 127.0.0.1 port (``tests/support/object_stores.py``),
one Python process on the same machine as the clients; everyone reaches it
through s3fs, configured by ``fsspec.config.conf`` here and the
``FSSPEC_S3_*`` environment variables in the workers.

Load contenders (the timed region is the load call + ``jax.block_until_ready``;
imports, backend start-up and building the target happen before, checking the
result after):

* ``ours``: ``ost.load("s3://bucket/ckpt", target)``, 1 process × 8 devices;
* ``download``: ``fs.get`` of the whole directory into a local temp dir, then
  ``safetensors.safe_open(f, framework="numpy").get_tensor(name)`` →
  ``jax.device_put(x, sharding)`` per tensor; the download is timed;
* ``orbax_layout``: Orbax's v1 ``SafetensorsLayout().load(epath.Path("s3://..."),
  abstract_state=target)`` (as ``bench/load.py`` calls it locally), awaited; n/a
  with its error if it cannot read the URL;
* ``ours_2proc``: ``ost.load`` in 2 processes × 4 devices joined by
  ``jax.distributed`` (``tests/support/multiprocess.py``), the FSDP mesh over all 8
  devices, so each process reads only its half. Each process starts its clock
  after a ``sync_global_devices`` barrier; the table shows the slowest process;
* ``download_2proc``: the naive multi-host user: every process downloads the
  whole directory, then builds its part (``jax.make_array_from_callback`` over
  ``safe_open(...).get_slice(name)``); slowest process.

Save contenders (1 process × 8 devices; the model made on device from a fixed
seed before the timed region; timed until the call returned / the future
resolved, i.e. until the checkpoint is committed in the bucket; two tensors are
read back and compared afterwards):

* ``save_ours``: ``ost.save("s3://...", params, max_shard_size=...)``;
* ``save_ours_async``: ``ost.async_save(...)`` → ``.result()``; "blocking" is
  how long ``async_save`` held the caller;
* ``save_orbax``: ``ocp.StandardCheckpointer().save("s3://...", params)`` +
  ``wait_until_finished()``; n/a with its error if Orbax cannot write there
  (the worker then also checks whether TensorStore's own ``s3`` kvstore driver
  reaches the server through ``{"driver": "s3", "endpoint": ...}``, and says so).

Every contender runs in its own fresh process(es), so peak RSS (``VmHWM``, see
``common.peak_rss``; the larger of the two processes for the 2-process rows) is
per contender; contenders alternate over ``--repeats`` and the table shows
medians. "server CPU" is the moto process's user+system CPU seconds during the
timed region, "client CPU" the worker's (the sum over processes for 2-process
rows): on a 2-CPU machine the server competes with the clients for the same
cores. ``--prefault-gb`` as in ``bench/load.py`` (parent side, before every
load run) and ``bench/save.py`` (worker side, before every timed save).

After the timed runs (unless ``--no-diagnose``) one extra, instrumented run of
``ours`` records every storage read (start, end, bytes, thread) and every S3
API call, and the parent times a few raw GETs against the server: the section
under the table says where ours spends its time.

Network model (``--bandwidth-mbps-per-connection``, ``--latency-ms``): raw moto
has neither a per-stream throughput cap nor per-request latency, unlike real
S3/GCS (~50-100 MB/s per TCP stream). With either flag, every load contender
(and the diagnosis run) reaches moto through ``tests/fault_proxy.FaultProxy``
(no faults, in this parent process), which paces each response body to that
many MB/s per client connection and waits that many ms before forwarding each
request; the upload of the checkpoint goes to moto directly. Saves are skipped
unless ``--save-contenders`` is given. "proxy CPU" is this parent's CPU over
the run (≈ the proxy's, as the parent otherwise just waits).

``--ranged-gets``: the server is ``bench/moto_ranged.py`` instead, moto with
ranged GETs answered in O(range) as S3 answers them (moto itself copies the
whole object for each one, under a per-object lock); whole-object GETs and
uploads are unchanged, so only contenders that read ranges gain.

Results go to stdout and to ``bench/results/object_store.md``
(``object_store_network.md`` with the network model; ``_ranged`` appended to
the name with ``--ranged-gets``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
import load as load_bench
import peers
import save as save_bench
from common import (
    BENCH_DIR,
    current_rss,
    fmt_gb,
    llama_shapes,
    machine_line,
    model_spec,
    peak_rss,
    prefault_memory,
    prefault_memory_in_child,
    publish,
    report_result,
    reset_peak_rss,
    versions_line,
)

LOAD_CONTENDERS = ("ours", "download", "orbax_layout", "runai_s3", "ours_2proc", "download_2proc")
SAVE_CONTENDERS = ("save_ours", "save_ours_async", "save_orbax")
MULTIPROCESS = {"ours_2proc": "ours", "download_2proc": "download_parts", "ours_2proc_traced": "ours_traced"}
MAX_SHARD_SIZE = "64MB"
CHECKPOINT_KEY = "ckpt"
MP_TARGET = "bench.object_store:multiprocess_load"  # bench/ imports as a namespace package
CONTENDER_NOTES = {
    "ours": "`ost.load(\"s3://…\", target)`, 1 process × 8 devices",
    "download": "`fs.get(dir, tmp, recursive=True)` → `safe_open(f, framework=\"numpy\").get_tensor(name)` "
                "→ `jax.device_put(x, sharding)`, download timed",
    "orbax_layout": "Orbax v1 `SafetensorsLayout().load(epath.Path(\"s3://…\"), abstract_state=target)`",
    "runai_s3": peers.CONTENDER_NOTES["runai_s3"] + " (optional: the `bench-peers` extra)",
    "ours_2proc": "`ost.load` in 2 processes × 4 devices (`jax.distributed`), FSDP over all 8; slowest process",
    "download_2proc": "every process `fs.get`s everything, then `jax.make_array_from_callback` over "
                      "`safe_open(...).get_slice(name)`; slowest process",
    "save_ours": "`ost.save(\"s3://…\", params, max_shard_size=…)`",
    "save_ours_async": "`ost.async_save(...)` → `.result()`; blocking = until `async_save` returned",
    "save_orbax": "`ocp.StandardCheckpointer().save(\"s3://…\", params)` + `.wait_until_finished()`",
}


# ---------------------------------------------------------------------------
# Clocks the workers read around their timed region.


class Clocks:
    """Wall time, this process's CPU time and the S3 server's CPU time, between start() and stop()."""

    def __init__(self, server_pid: int | None):
        self.server_pid = server_pid

    def server_cpu(self) -> float | None:
        if not self.server_pid:
            return None
        try:
            with open(f"/proc/{self.server_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def own_cpu() -> float:
        t = os.times()
        return t.user + t.system

    def start(self) -> None:
        self.server0, self.cpu0 = self.server_cpu(), self.own_cpu()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = self.own_cpu() - self.cpu0
        return self.seconds

    def stop_server(self) -> None:
        server1 = self.server_cpu()
        self.server = None if server1 is None or self.server0 is None else server1 - self.server0

    def report(self) -> dict:
        return {"seconds": self.seconds, "client_cpu": self.cpu, "server_cpu": getattr(self, "server", None)}


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300]


# ---------------------------------------------------------------------------
# Load contenders (in the workers). Each returns {name: jax.Array}.


def load_ours(url: str, target: dict, extra: dict):
    import dataclasses
    import orbax_safetensors as ost

    stats = ost.LoadStats()
    result = ost.load(url, target, stats=stats)
    extra["load_stats"] = dataclasses.asdict(stats)
    return result


def download(url: str, extra: dict) -> Path:
    """``fs.get`` of the whole checkpoint directory into a fresh temp dir (deleted after the run)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    local = Path(tempfile.mkdtemp(prefix="download-", dir=extra["scratch"]))
    extra["cleanup"] = lambda: shutil.rmtree(local, ignore_errors=True)
    started = time.perf_counter()
    fs.get(root.rstrip("/") + "/", str(local) + "/", recursive=True)
    extra["download_seconds"] = time.perf_counter() - started
    extra["bytes_downloaded"] = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    return local


def load_download(url: str, target: dict, extra: dict):
    return load_bench.load_safe_open(download(url, extra), target, extra)


def load_download_parts(url: str, target: dict, extra: dict):
    """Multi-host naive: everything downloaded, then each process builds only its devices' slices."""
    import jax
    from safetensors import safe_open

    local = download(url, extra)
    by_file: dict[str, list[str]] = {}
    for name, file in load_bench.weight_map(local).items():
        by_file.setdefault(file, []).append(name)
    result = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(local / file), framework="numpy") as f:
            for name in names:
                piece = f.get_slice(name)
                want = target[name]
                result[name] = jax.make_array_from_callback(
                    want.shape, want.sharding, lambda index, piece=piece: piece[index])
    return result


def load_ours_traced(url: str, target: dict, extra: dict):
    """``load_ours`` with every storage read and every S3 API call recorded (the diagnosis run)."""
    import s3fs
    from orbax_safetensors.storage.fsspec_storage import FsspecStorage

    reads: list[tuple[float, float, int, int]] = []
    calls: list[tuple[str, float]] = []
    lock = threading.Lock()
    original_read, original_call = FsspecStorage.read, s3fs.S3FileSystem._call_s3

    def read(self, path, offset, length):
        started = time.perf_counter()
        data = original_read(self, path, offset, length)
        with lock:
            reads.append((started, time.perf_counter(), len(data), threading.get_ident()))
        return data

    async def call_s3(self, method, *args, **kwargs):
        with lock:
            calls.append((method, time.perf_counter()))
        return await original_call(self, method, *args, **kwargs)

    FsspecStorage.read, s3fs.S3FileSystem._call_s3 = read, call_s3
    extra["trace"] = {"reads": reads, "calls": calls}
    try:
        return load_ours(url, target, extra)
    finally:
        FsspecStorage.read, s3fs.S3FileSystem._call_s3 = original_read, original_call


def prepare_load(loader: str) -> None:
    """Imports, before the clock (as in ``bench/load.py``): s3fs for everyone, and each loader's own."""
    import s3fs  # noqa: F401  (fsspec would import it at the first s3:// URL, inside the timed region)
    if loader.startswith("ours"):
        import orbax_safetensors  # noqa: F401
    elif loader in peers.LOADERS:
        peers.prepare(loader)
        peers.configure_runai_s3()
    elif loader == "orbax_layout":
        from etils import epath  # noqa: F401
        from orbax.checkpoint.experimental.v1._src.layout import safetensors_layout  # noqa: F401
    else:
        import safetensors  # noqa: F401


LOADERS = {"ours": load_ours, "download": load_download, "orbax_layout": load_bench.load_orbax_layout,
           "runai_s3": peers.load_runai_s3,
           "download_parts": load_download_parts, "ours_traced": load_ours_traced}


def trace_summary(trace: dict, started: float, seconds: float) -> dict:
    """Concurrency and latency of the recorded reads, relative to the load's clock."""
    reads = sorted(trace["reads"])
    calls: dict[str, int] = {}
    for method, _ in trace["calls"]:
        calls[method] = calls.get(method, 0) + 1
    if not reads:
        return {"calls": calls, "reads": 0}
    events = sorted([(s, 1) for s, _, _, _ in reads] + [(e, -1) for _, e, _, _ in reads])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    first, last = reads[0][0], max(e for _, e, _, _ in reads)
    busy = sum(e - s for s, e, _, _ in reads)
    latencies = sorted(e - s for s, e, _, _ in reads)
    data = [(s, e, n) for s, e, n, _ in reads if n >= 1 << 20]
    data_start = min((s for s, _, _ in data), default=first)
    data_end = max((e for _, e, _ in data), default=last)
    return {
        "calls": calls, "reads": len(reads), "bytes": sum(n for _, _, n, _ in reads),
        "first_call_at": min(t for _, t in trace["calls"]) - started if trace["calls"] else 0.0,
        "data_start_at": data_start - started, "data_end_at": data_end - started,
        "data_reads": len(data), "data_bytes": sum(n for _, _, n in data),
        "median_mb": statistics.median(n for _, _, n in data) / 1e6 if data else 0.0,
        "max_in_flight": peak, "threads": len({t for _, _, _, t in reads}),
        "mean_in_flight": busy / (last - first) if last > first else 0.0,
        "latency_median": latencies[len(latencies) // 2], "latency_max": latencies[-1],
        "data_latency_median": statistics.median(e - s for s, e, _ in data) if data else 0.0,
        "first_read_at": first - started, "last_read_end_at": last - started, "seconds": seconds,
    }


# ---------------------------------------------------------------------------
# Save contenders (in the workers).


def save_ours(url: str, params: dict, spec: dict, extra: dict) -> None:
    import dataclasses
    import orbax_safetensors as ost
    extra["save_stats"] = dataclasses.asdict(ost.save(url, params, max_shard_size=spec["max_shard_size"]))


def save_ours_async(url: str, params: dict, spec: dict, extra: dict) -> None:
    import dataclasses
    import orbax_safetensors as ost
    started = time.perf_counter()
    future = ost.async_save(url, params, max_shard_size=spec["max_shard_size"])
    extra["blocking_seconds"] = time.perf_counter() - started
    extra["save_stats"] = dataclasses.asdict(future.result())


def save_orbax(url: str, params: dict, spec: dict, extra: dict) -> None:
    checkpointer = extra.pop("checkpointer")
    started = time.perf_counter()
    checkpointer.save(url, params)
    extra["blocking_seconds"] = time.perf_counter() - started
    checkpointer.wait_until_finished()
    extra["close"] = checkpointer.close


SAVERS = {"save_ours": save_ours, "save_ours_async": save_ours_async, "save_orbax": save_orbax}


def tensorstore_s3_probe(url: str) -> str:
    """Whether TensorStore's own s3 kvstore driver reaches the server (for the n/a reason)."""
    endpoint = os.environ.get("FSSPEC_S3_ENDPOINT_URL")
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", os.environ.get("FSSPEC_S3_KEY", "test"))
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", os.environ.get("FSSPEC_S3_SECRET", "test"))
    try:
        import tensorstore as ts
        store = ts.KvStore.open({"driver": "s3", "bucket": bucket, "path": "tensorstore-probe/",
                                 "endpoint": endpoint, "aws_region": "us-east-1",
                                 "aws_credentials": {"type": "environment"}}).result()
        store.write("probe", b"ok").result()
        ok = store.read("probe").result().value == b"ok"
        store.delete_range(ts.KvStore.KeyRange()).result()
    except Exception as e:  # noqa: BLE001
        return f"TensorStore's s3 driver with endpoint={endpoint} failed too: {one_line(e)[:120]}"
    return (f"TensorStore's own s3 driver does reach the server (`{{\"driver\": \"s3\", \"endpoint\": "
            f"\"{endpoint}\"}}` round-trips), Orbax just never builds that spec" if ok
            else "TensorStore's s3 driver read back something else")


# ---------------------------------------------------------------------------
# Workers.


def verify_local(result: dict, target: dict, spec: dict, expected_file: Path) -> list[str]:
    """Names/shapes/dtypes/shardings, and the first/last rows this process holds; which rows it checked."""
    import jax
    import numpy as np

    if set(result) != set(target):
        raise AssertionError(f"result names differ from target: {sorted(set(result) ^ set(target))[:5]}")
    for name, want in target.items():
        got = result[name]
        if not isinstance(got, jax.Array) or got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: got {type(got).__name__} {got.shape} {got.dtype}")
        if not got.sharding.is_equivalent_to(want.sharding, len(want.shape)):
            raise AssertionError(f"{name}: got sharding {got.sharding}, want {want.sharding}")
    expected = np.load(expected_file)
    checked = set()
    for name in load_bench.checked_names(spec):
        rows = target[name].shape[0]
        for shard in result[name].addressable_shards:
            start, stop, _ = shard.index[0].indices(rows)
            data = np.asarray(shard.data).view(np.uint16)
            for part, covered, got in (("head", start == 0, data[:4]), ("tail", stop == rows, data[-4:])):
                if covered:
                    if not np.array_equal(got, expected[f"{name}/{part}"]):
                        raise AssertionError(f"{name}: {part} rows differ from the source")
                    checked.add(f"{name}/{part}")
    return sorted(checked)


def load_worker(args) -> None:
    home = Path(args.home)
    spec = json.loads((home / "spec.json").read_text())
    import jax

    orbax_scalars: dict[str, float] = {}
    if args.contender == "orbax_layout":
        jax.monitoring.register_scalar_listener(
            lambda event, value, **_: orbax_scalars.__setitem__(event, value)
            if event.startswith("/jax/orbax/read/safetensors/") else None)
    target = load_bench.build_target(spec, "fsdp")
    prepare_load(args.contender)
    extra: dict = {"scratch": args.scratch}
    clocks = Clocks(args.server_pid)

    baseline = current_rss()
    try:
        clocks.start()
        result = LOADERS[args.contender](args.url, target, extra)
        jax.block_until_ready(result)
        clocks.stop()
        clocks.stop_server()
        peak = peak_rss()
        load_bench.verify(result, target, spec, home / "expected.npz")
    except Exception as e:  # noqa: BLE001
        report_result({"ok": False, "error": one_line(e)})
        return
    finally:
        if "cleanup" in extra:
            extra["cleanup"]()
    report = {"ok": True, **clocks.report(), "bytes": sum(int(x.nbytes) for x in result.values()),
              "peak_rss": peak, "baseline_rss": baseline, "processes": 1}
    for key in ("load_stats", "download_seconds", "bytes_downloaded"):
        if key in extra:
            report[key] = extra[key]
    if "trace" in extra:
        report["trace"] = trace_summary(extra["trace"], clocks.t0, clocks.seconds)
    if orbax_scalars:
        report["orbax_read"] = {k.rsplit("/", 1)[1]: v for k, v in orbax_scalars.items()}
    report_result(report)


def multiprocess_load(args: dict) -> dict:
    """``run_multiprocess`` target: one process of a 2-process load; its clocks and checks."""
    import jax
    from jax.experimental import multihost_utils

    home = Path(args["home"])
    spec = json.loads((home / "spec.json").read_text())
    target = load_bench.build_target(spec, "fsdp")  # mesh_1d: all 8 devices of both processes
    prepare_load(args["loader"])
    extra: dict = {"scratch": args["scratch"]}
    clocks = Clocks(args["server_pid"] if jax.process_index() == 0 else None)
    baseline = current_rss()
    multihost_utils.sync_global_devices("object_store bench: start")
    try:
        clocks.start()
        result = LOADERS[args["loader"]](args["url"], target, extra)
        jax.block_until_ready(result)
        clocks.stop()
        peak = peak_rss()
        multihost_utils.sync_global_devices("object_store bench: end")
        clocks.stop_server()  # process 0: the server's CPU over the slowest process's load
        checked = verify_local(result, target, spec, home / "expected.npz")
    finally:
        if "cleanup" in extra:
            extra["cleanup"]()
    report = {"process": jax.process_index(), **clocks.report(), "peak_rss": peak, "baseline_rss": baseline,
              "bytes": sum(int(x.nbytes) for x in result.values()),
              "local_bytes": sum(int(s.data.nbytes) for x in result.values() for s in x.addressable_shards),
              "checked": checked}
    for key in ("load_stats", "download_seconds", "bytes_downloaded"):
        if key in extra:
            report[key] = extra[key]
    if "trace" in extra:
        report["trace"] = trace_summary(extra["trace"], clocks.t0, clocks.seconds)
    return report


def save_worker(args) -> None:
    spec = json.loads(args.spec)
    import jax

    params = save_bench.make_params(spec)
    import s3fs  # noqa: F401  (before the clock, as every other import)
    extra: dict = {}
    if args.contender == "save_orbax":
        import orbax.checkpoint as ocp
        extra["checkpointer"] = ocp.StandardCheckpointer()
        # Orbax treats "s3://b/x" as the relative local path "s3:/b/x" for TensorStore's file
        # driver (its `_sharding` file lands there): keep that out of the repository.
        os.chdir(tempfile.mkdtemp(prefix="orbax-cwd-", dir=args.scratch))
    else:
        import orbax_safetensors  # noqa: F401
    if args.prefault_gb:
        prefault_memory_in_child(args.prefault_gb)
    peak_reset = reset_peak_rss()
    clocks = Clocks(args.server_pid)
    baseline = current_rss()
    try:
        clocks.start()
        SAVERS[args.contender](args.url, params, spec, extra)
        clocks.stop()
        clocks.stop_server()
        peak = peak_rss()
    except Exception as e:  # noqa: BLE001
        error = one_line(e)
        if args.contender == "save_orbax":
            stray = [str(p) for p in Path.cwd().rglob("*") if p.is_file()]
            if stray:
                error += f"; it wrote {len(stray)} local file(s) under ./s3:/ instead"
            error += "; " + tensorstore_s3_probe(args.url)
        report_result({"ok": False, "error": error})
        return
    if "close" in extra:
        extra.pop("close")()
    import numpy as np
    import orbax_safetensors as ost
    names = save_bench.verified_names()
    if args.contender == "save_orbax":
        abstract = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for n, x in params.items()}
        with ocp.StandardCheckpointer() as checkpointer:
            got = checkpointer.restore(args.url, abstract)
    else:
        got = ost.load(args.url, {name: jax.ShapeDtypeStruct(params[name].shape, params[name].dtype)
                                  for name in names}, strict=False)
    for name in names:
        if not np.array_equal(np.asarray(got[name]).view(np.uint16), np.asarray(params[name]).view(np.uint16)):
            raise AssertionError(f"{name}: read back values differ from the source")
    report = {"ok": True, **clocks.report(), "bytes": sum(int(x.nbytes) for x in params.values()),
              "peak_rss": peak, "baseline_rss": baseline, "peak_reset": peak_reset, "processes": 1}
    for key in ("blocking_seconds", "save_stats"):
        if key in extra:
            report[key] = extra[key]
    report_result(report)


# ---------------------------------------------------------------------------
# The parent.


def run_load(contender: str, home: Path, url: str, args) -> dict:
    if args.prefault_gb:
        prefault_memory(args.prefault_gb)
    before = Clocks.own_cpu()
    result = _run_load(contender, home, url, args)
    if args.network:
        result["proxy_cpu"] = Clocks.own_cpu() - before
    return result


def _run_load(contender: str, home: Path, url: str, args) -> dict:
    if contender not in MULTIPROCESS:
        return common.run_worker(Path(__file__).resolve(), [
            "--contender", contender, "--home", str(home), "--url", url,
            "--scratch", str(args.scratch), "--server-pid", str(args.server_pid)])
    from tests.support.multiprocess import MultiProcessError, run_multiprocess
    try:
        results = run_multiprocess(
            MP_TARGET, num_processes=2, devices_per_process=4, timeout=common.WORKER_TIMEOUT,
            args={"loader": MULTIPROCESS[contender], "home": str(home), "url": url,
                  "scratch": str(args.scratch), "server_pid": args.server_pid})
    except MultiProcessError as e:
        lines = [l.strip() for l in str(e).splitlines() if "Error" in l or "Exception" in l]
        return {"ok": False, "error": (lines or [str(e).splitlines()[0]])[-1][:300]}
    values = [r.value for r in results]
    spec = json.loads((home / "spec.json").read_text())
    wanted = {f"{n}/{p}" for n in load_bench.checked_names(spec) for p in ("head", "tail")}
    missing = wanted - {c for v in values for c in v["checked"]}
    if missing:
        return {"ok": False, "error": f"rows never checked: {sorted(missing)[:3]}"}
    slowest = max(values, key=lambda v: v["seconds"])
    report = {"ok": True, "processes": 2, "per_process": values, "seconds": slowest["seconds"],
              "bytes": values[0]["bytes"], "peak_rss": max(v["peak_rss"] for v in values),
              "baseline_rss": max(v["baseline_rss"] for v in values),
              "client_cpu": sum(v["client_cpu"] for v in values), "server_cpu": values[0]["server_cpu"]}
    if "download_seconds" in values[0]:
        report["download_seconds"] = max(v["download_seconds"] for v in values)
        report["bytes_downloaded"] = sum(v["bytes_downloaded"] for v in values)
    return report


def run_save(contender: str, spec: dict, url: str, args) -> dict:
    try:
        return common.run_worker(Path(__file__).resolve(), [
            "--contender", contender, "--spec", json.dumps(spec), "--url", url,
            "--scratch", str(args.scratch), "--prefault-gb", repr(args.prefault_gb), "--server-pid", str(args.server_pid)])
    finally:
        import fsspec
        fs, root = fsspec.core.url_to_fs(url)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def server_probe(fs, root: str, files: list[Path]) -> dict:
    """Raw GETs from the parent: the server's cost of a whole object and of a small range of it."""
    biggest = max(files, key=lambda p: p.stat().st_size)
    path = f"{root}/{biggest.name}"
    size = biggest.stat().st_size
    fs.cat_file(path, start=0, end=1 << 20)  # connection warm-up

    def timed(fn, n=1):
        times = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    small = f"{root}/model.safetensors.index.json"
    return {
        "object_mb": size / 1e6,
        "whole_get": timed(lambda: fs.cat_file(path), 3),
        "range_1mib": timed(lambda: fs.cat_file(path, start=size // 2, end=size // 2 + (1 << 20)), 5),
        "range_32mb": timed(lambda: fs.cat_file(path, start=0, end=32_000_000), 3),
        "small_get": timed(lambda: fs.cat_file(small), 5),
    }


def median(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def cell(value: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def render(spec: dict, files: list[Path], results: dict, args, wall: float, diagnosis: dict) -> str:
    total = sum(p.stat().st_size for p in files)
    lines = [
        f"### Through S3 (moto on 127.0.0.1): {spec['bytes'] / 1e9:.3f} GB bf16 checkpoint, FSDP on 8 CPU devices",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}, {args.more_versions}",
        "- devices: 1-process rows: 1 process × 8 host CPU devices (`JAX_PLATFORMS=cpu`, "
        "`--xla_force_host_platform_device_count=8`); 2-process rows: 2 processes × 4 devices joined by "
        "`jax.distributed` on 127.0.0.1 (gloo); FSDP = 2-D tensors `P(\"x\", None)` over a 1-D mesh of "
        "all 8 devices, 1-D tensors replicated",
        f"- server: `{'bench/moto_ranged.py` (moto with ranged GETs in O(range))' if args.ranged_gets else 'python -m moto.server`'}"
        f" (one Python process) at {args.endpoint}, on the same machine, "
        f"sharing its {len(os.sched_getaffinity(0))} CPUs with the clients; clients via s3fs",
        f"- network model: {args.network or 'none (clients talk to moto directly)'}",
        f"- checkpoint: {len(llama_shapes(spec['hidden'], spec['ffn']))} tensors, "
        f"{spec['bytes'] / 1e9:.3f} GB of tensor data in {len(files)} files ({total / 1e9:.3f} GB), llama-like "
        f"(layers {spec['layers']}, hidden {spec['hidden']}, ffn {spec['ffn']}, vocab {spec['vocab']}), HF "
        f"sharded dir, `max_shard_size=\"{spec['max_shard_size']}\"`, uploaded once (untimed) to "
        f"`s3://<bucket>/{CHECKPOINT_KEY}`; downloads go to {args.scratch_disk}",
        f"- each run is a fresh process (or pair); contenders alternate; medians of {args.repeats} run(s). "
        "GB = 1e9 bytes; GB/s = tensor bytes / median seconds; \"ours ÷ this\" = this row's seconds over "
        "ours' (single process) seconds. Server CPU = moto's user+sys seconds over the timed region; client "
        "CPU = the worker's (2-process rows: both processes). Peak RSS = `VmHWM` after the timed region "
        "(2-process rows: the larger process)."
        + (" Proxy CPU = this parent's (the proxy's) user+sys seconds over the whole run." if args.network else "")
        + (f" `--prefault-gb {args.prefault_gb:g}`: touched and freed before every run." if args.prefault_gb else ""),
        "",
        "#### Load (timed: the load call + `block_until_ready`; downloads included)",
        "",
        "| contender | processes × devices | seconds (median) | GB/s | ours ÷ this | peak RSS (GB) "
        "| RSS growth (GB) | bytes read (GB) | requests | server CPU (s) | client CPU (s) "
        + ("| proxy CPU (s) " if args.network else "") + "| runs (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.network else "") + "---|",
    ]
    ours_ok = [r for r in results.get("ours", []) if r["ok"]]
    ours_s = median(ours_ok, lambda r: r["seconds"]) if ours_ok else None
    notes = []

    def failed_row(contender: str, runs: list[dict], width: int) -> str:
        failed = [r for r in runs if not r["ok"]]
        error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
        label = "FAILED" if contender.startswith(("ours", "save_ours")) else "n/a"
        return f"| {contender} | {label}: {error} |" + " |" * width

    for contender in args.contenders:
        runs = results[contender]
        ok = [r for r in runs if r["ok"]]
        if not ok:
            lines.append(failed_row(contender, runs, 11 if args.network else 10))
            continue
        seconds = median(ok, lambda r: r["seconds"])
        size = ok[0]["bytes"]
        ratio = f"{seconds / ours_s:.2f}" if ours_s else "n/a"
        middle = sorted(ok, key=lambda r: r["seconds"])[len(ok) // 2]
        if middle["processes"] == 2:
            shape = "2 × 4"
            per = middle["per_process"]
            if "load_stats" in per[0]:
                read = " + ".join(fmt_gb(v["load_stats"]["bytes_read"]) for v in per)
                requests = " + ".join(str(v["load_stats"]["requests"]) for v in per)
            else:
                read = " + ".join(fmt_gb(v["bytes_downloaded"]) for v in per)
                requests = "—"
            notes.append(f"  - {contender}: per process " + "; ".join(
                f"p{v['process']}: {v['seconds']:.2f} s, local shards {fmt_gb(v['local_bytes'])} GB"
                + (f", bytes_needed {fmt_gb(v['load_stats']['bytes_needed'])} GB, bytes_read "
                   f"{fmt_gb(v['load_stats']['bytes_read'])} GB, {v['load_stats']['requests']} requests"
                   if "load_stats" in v else f", download {v['download_seconds']:.2f} s")
                + f", peak RSS {fmt_gb(v['peak_rss'])} GB" for v in per))
        else:
            shape = "1 × 8"
            if "load_stats" in middle:
                s = middle["load_stats"]
                read, requests = fmt_gb(s["bytes_read"]), str(s["requests"])
                notes.append(f"  - {contender}: bytes_needed {fmt_gb(s['bytes_needed'])} GB, bytes_read "
                             f"{fmt_gb(s['bytes_read'])} GB, {s['requests']} requests, {s['files']} files, "
                             f"{s['tensors']} tensors")
            elif "bytes_downloaded" in middle:
                read, requests = fmt_gb(middle["bytes_downloaded"]), "—"
            elif "orbax_read" in middle:
                s = middle["orbax_read"]
                read, requests = fmt_gb(s.get("bytes_read", 0)), str(int(s.get("storage_reads", 0)))
            else:
                read = requests = "—"
        if "download_seconds" in middle and middle["processes"] == 1:
            notes.append(f"  - {contender}: download {middle['download_seconds']:.2f} s of "
                         f"{middle['seconds']:.2f} s ({fmt_gb(middle['bytes_downloaded'])} GB downloaded in all)")
        growth = median(ok, lambda r: r["peak_rss"] - r["baseline_rss"])
        server = cell(middle.get("server_cpu"))
        all_runs = ", ".join(f"{r['seconds']:.2f}" for r in ok)
        if len(ok) < len(runs):
            all_runs += f"; {len(runs) - len(ok)} failed: " + next(r["error"] for r in runs if not r["ok"])
        lines.append(f"| {contender} | {shape} | {seconds:.2f} | {size / seconds / 1e9:.2f} | {ratio} "
                     f"| {fmt_gb(median(ok, lambda r: r['peak_rss']))} | {fmt_gb(growth)} | {read} | {requests} "
                     f"| {server} | {middle['client_cpu']:.2f} "
                     + (f"| {cell(middle.get('proxy_cpu'))} " if args.network else "")
                     + f"| {all_runs.replace('|', '/')} |")

    def seconds_of(contender: str) -> float | None:
        ok = [r for r in results.get(contender, []) if r["ok"]]
        return median(ok, lambda r: r["seconds"]) if ok else None

    targets = []
    download_s, ours2_s, download2_s = seconds_of("download"), seconds_of("ours_2proc"), seconds_of("download_2proc")
    if "ours" in args.contenders and "download" in args.contenders:
        if ours_s and download_s:
            speedup = download_s / ours_s
            targets.append(f"- {'PASS' if speedup >= 1.5 else 'FAIL'}: single-process ours ≥ 1.5× download "
                           f"→ {speedup:.2f}× ({ours_s:.2f} s vs {download_s:.2f} s)")
        else:
            targets.append("- FAIL: single-process ours ≥ 1.5× download → not measured (a run failed)")
    if "ours_2proc" in args.contenders and "download" in args.contenders:
        if ours2_s and download_s:
            speedup = download_s / ours2_s
            line = (f"- {'PASS' if speedup >= 2 else 'FAIL'}: 2-process ours ≥ 2× download (single process) "
                    f"→ {speedup:.2f}× ({ours2_s:.2f} s vs {download_s:.2f} s)")
            if download2_s:
                line += f"; vs download_2proc: {download2_s / ours2_s:.2f}× ({download2_s:.2f} s)"
            targets.append(line)
        else:
            targets.append("- FAIL: 2-process ours ≥ 2× download → not measured (a run failed)")

    save_rows = [c for c in args.save_contenders]
    if save_rows:
        save_ours_ok = [r for r in results.get("save_ours", []) if r["ok"]]
        base = median(save_ours_ok, lambda r: r["seconds"]) if save_ours_ok else None
        lines += [
            "",
            "#### Save (1 process × 8 devices; timed: until the checkpoint is committed in the bucket)",
            "",
            "| contender | seconds (median) | GB/s | blocking (s) | save_ours ÷ this | peak RSS (GB) "
            "| RSS growth (GB) | bytes written (GB) | requests | server CPU (s) | client CPU (s) | runs (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for contender in save_rows:
            runs = results[contender]
            ok = [r for r in runs if r["ok"]]
            if not ok:
                lines.append(failed_row(contender, runs, 10))
                continue
            seconds = median(ok, lambda r: r["seconds"])
            middle = sorted(ok, key=lambda r: r["seconds"])[len(ok) // 2]
            blocking = median(ok, lambda r: r.get("blocking_seconds", r["seconds"]))
            s = middle.get("save_stats")
            all_runs = ", ".join(f"{r['seconds']:.2f}" for r in ok)
            lines.append(
                f"| {contender} | {seconds:.2f} | {ok[0]['bytes'] / seconds / 1e9:.2f} | {blocking:.2f} "
                f"| {cell(seconds / base if base else None)} | {fmt_gb(median(ok, lambda r: r['peak_rss']))} "
                f"| {fmt_gb(median(ok, lambda r: r['peak_rss'] - r['baseline_rss']))} "
                f"| {fmt_gb(s['bytes_written']) if s else '—'} | {s['requests'] if s else '—'} "
                f"| {cell(middle.get('server_cpu'))} | {middle['client_cpu']:.2f} | {all_runs} |")
            if s:
                notes.append(f"  - {contender}: bytes_written {fmt_gb(s['bytes_written'])} GB, {s['requests']} "
                             f"requests, {s['files']} files, blocking {middle.get('blocking_seconds', seconds):.2f} s")

    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}"
                                             for c in [*args.contenders, *save_rows]) + "."]
    if notes:
        lines += ["", "Reads, writes and downloads (median run):", *notes]
    if targets:
        lines += ["", "Targets:", *targets]
    if set(diagnosis) - {"ranged_gets"}:
        lines += ["", "Where ours spends its time on S3 (one extra instrumented `ours` run, not in the table):",
                  *diagnosis_lines(diagnosis)]
    return "\n".join(lines) + "\n"


def trace_lines(label: str, t: dict, client_cpu: float, server_cpu: float | None) -> list[str]:
    calls = ", ".join(f"{k} {v}" for k, v in sorted(t["calls"].items()))
    window = t["data_end_at"] - t["data_start_at"]
    return [
        f"- {label}: {t['seconds']:.2f} s wall; {t['reads']} storage reads ({fmt_gb(t['bytes'])} GB), "
        f"{t['data_reads']} of them ≥ 1 MiB ({fmt_gb(t['data_bytes'])} GB, median {t['median_mb']:.1f} MB); "
        f"S3 API calls: {calls}",
        f"  - timeline: first S3 call (s3fs creates its session in it) at {t['first_call_at']:.2f} s, first "
        f"read at {t['first_read_at']:.2f} s, "
        f"data reads from {t['data_start_at']:.2f} s to {t['data_end_at']:.2f} s "
        f"({fmt_gb(t['data_bytes'] / window) if window > 0 else '—'} GB/s over that window), "
        f"returned {t['seconds'] - t['last_read_end_at']:.2f} s after the last read",
        f"  - parallelism: {t['threads']} reader threads, at most {t['max_in_flight']} reads in flight, "
        f"{t['mean_in_flight']:.1f} on average over the I/O window; read latency median "
        f"{t['latency_median'] * 1e3:.0f} ms (≥ 1 MiB reads: {t['data_latency_median'] * 1e3:.0f} ms), "
        f"max {t['latency_max'] * 1e3:.0f} ms",
        f"  - CPU over the timed region: client {client_cpu:.2f} s ({client_cpu / t['seconds']:.2f} cores), "
        "server " + (f"{server_cpu:.2f} s ({server_cpu / t['seconds']:.2f} cores)"
                     if server_cpu is not None else "—"),
    ]


def diagnosis_lines(d: dict) -> list[str]:
    out = []
    single = d.get("single")
    if single and single.get("ok") and single.get("trace", {}).get("reads"):
        out += trace_lines("1 process × 8 devices", single["trace"], single["client_cpu"], single["server_cpu"])
    elif single:
        out.append(f"- 1-process instrumented run: {single.get('error', 'no reads recorded')}")
    multi = d.get("multi")
    if multi and multi.get("ok"):
        for v in multi["per_process"]:
            if v.get("trace", {}).get("reads"):
                out += trace_lines(f"2 processes × 4 devices, process {v['process']}", v["trace"], v["client_cpu"],
                                   v["server_cpu"] if v["process"] == 0 else None)
    elif multi:
        out.append(f"- 2-process instrumented run: {multi.get('error')}")
    p = d.get("probe")
    if p:
        out.append(
            f"- the server alone (raw s3fs GETs from the parent, one at a time): whole {p['object_mb']:.0f} MB "
            f"object {p['whole_get']:.2f} s ({p['object_mb'] / 1e3 / p['whole_get']:.2f} GB/s); a 32 MB range of "
            f"it {p['range_32mb'] * 1e3:.0f} ms; a 1 MiB range of it {p['range_1mib'] * 1e3:.0f} ms; the small index "
            f"object {p['small_get'] * 1e3:.0f} ms. "
            + ("Ranged GETs here read only their bytes (`bench/moto_ranged.py`), as S3's do"
               if d.get("ranged_gets") else
               "moto answers a ranged GET by reading the whole object and slicing it (`FakeKey.value`, "
               "under the key's lock), so every range request costs the server O(object size); S3 itself "
               "does not (`--ranged-gets` serves them in O(range))"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256, help="checkpoint size in MB (%(default)g)")
    parser.add_argument("--max-shard-size", default=MAX_SHARD_SIZE,
                        help="HF shard size of the checkpoint (%(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per contender (%(default)s); medians")
    parser.add_argument("--contenders", default=",".join(LOAD_CONTENDERS), help="load contenders")
    parser.add_argument("--save-contenders", default=None,
                        help=f"save contenders ('' for none; default {','.join(SAVE_CONTENDERS)}, "
                        "none with a network model)")
    parser.add_argument("--dir", default="/tmp/ost-bench-object-store",
                        help="local checkpoint cache and download scratch (%(default)s)")
    parser.add_argument("--prefault-gb", type=float, default=0.0,
                        help="touch and free this many GB before every run (VMs with free page reporting)")
    parser.add_argument("--bandwidth-mbps-per-connection", type=float, default=None,
                        help="network model: cap each client connection's response bytes at this many MB/s "
                        "(1e6 bytes/s) through a FaultProxy in front of moto (off)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="network model: add this many ms before each request is forwarded (%(default)g)")
    parser.add_argument("--ranged-gets", action="store_true",
                        help="serve ranged GETs in O(range), as S3 does (bench/moto_ranged.py)")
    parser.add_argument("--no-diagnose", action="store_true", help="skip the instrumented run of ours")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.contender in SAVERS:
            save_worker(args)
        else:
            load_worker(args)
        return

    args.contenders = [c for c in args.contenders.split(",") if c]
    bandwidth, latency = args.bandwidth_mbps_per_connection, args.latency_ms
    args.network = ", ".join(
        ([f"{bandwidth:g} MB/s per connection"] if bandwidth else [])
        + ([f"{latency:g} ms per request"] if latency else []))
    if args.network:
        args.network += " (FaultProxy in front of moto for every load contender; upload direct)"
    if args.save_contenders is None:
        args.save_contenders = "" if args.network else ",".join(SAVE_CONTENDERS)
    args.save_contenders = [c for c in args.save_contenders.split(",") if c]
    for c in args.contenders:
        if c not in LOAD_CONTENDERS:
            parser.error(f"unknown load contender {c!r}; choose from {', '.join(LOAD_CONTENDERS)}")
    missing = [c for c in args.contenders if c in peers.LOADERS and not peers.installed(c)]
    if missing:
        print(f"left out (package not installed): {', '.join(missing)}", file=sys.stderr)
        args.contenders = [c for c in args.contenders if c not in missing]
    for c in args.save_contenders:
        if c not in SAVE_CONTENDERS:
            parser.error(f"unknown save contender {c!r}; choose from {', '.join(SAVE_CONTENDERS)}")

    started = time.perf_counter()
    sys.path.insert(0, str(BENCH_DIR.parent))  # tests/ (the S3 server, the multi-process launcher)
    import psutil
    from importlib.metadata import version
    from tests.support.object_stores import object_store_server

    args.more_versions = ", ".join(f"{p} {version(p)}" for p in ("s3fs", "fsspec", "moto", "tensorstore"))
    spec = model_spec(args.size_mb / 1e3, args.max_shard_size)
    root_dir = Path(args.dir)
    home = load_bench.ensure_checkpoint(root_dir, spec)
    checkpoint = home / "checkpoint"
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    args.scratch = root_dir / "scratch"
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.scratch_disk = save_bench.disk_line(args.scratch)

    server = [str(BENCH_DIR / "moto_ranged.py"), "{port}"] if args.ranged_gets else None
    with object_store_server("s3", server) as (bucket, env):
        os.environ.update(env)  # the workers (common.run_worker, run_multiprocess) inherit it
        args.endpoint = env["FSSPEC_S3_ENDPOINT_URL"]
        servers = [p for p in psutil.Process().children() if "moto" in " ".join(p.cmdline())]
        args.server_pid = servers[0].pid if servers else 0
        import fsspec
        fs, bucket_root = fsspec.core.url_to_fs(bucket)
        url = f"{bucket}/{CHECKPOINT_KEY}"
        print(f"uploading {len(files)} files ({sum(p.stat().st_size for p in files) / 1e9:.2f} GB) to {url} ...",
              file=sys.stderr, flush=True)
        fs.put([str(p) for p in files], [f"{bucket_root}/{CHECKPOINT_KEY}/{p.name}" for p in files])
        proxy = None
        if args.network:  # from here on, everyone but the untimed probe goes through the proxy
            from tests.support.fault_proxy import FaultProxy
            proxy = FaultProxy(args.endpoint, latency=latency / 1e3,
                               bandwidth_per_connection=bandwidth * 1e6 if bandwidth else None).start()
            os.environ["FSSPEC_S3_ENDPOINT_URL"] = proxy.url
            fsspec.config.conf["s3"] = {**fsspec.config.conf.get("s3", {}), "endpoint_url": proxy.url}
            print(f"network model: {args.network}; proxy at {proxy.url}", file=sys.stderr, flush=True)

        results: dict[str, list[dict]] = {c: [] for c in [*args.contenders, *args.save_contenders]}
        for repeat in range(args.repeats):
            for contender in args.contenders:
                result = run_load(contender, home, url, args)
                results[contender].append(result)
                shown = (f"{result['seconds']:.2f} s, {result['bytes'] / result['seconds'] / 1e9:.2f} GB/s, "
                         f"peak RSS {fmt_gb(result['peak_rss'])} GB" if result["ok"] else "failed: " + result["error"])
                if "proxy_cpu" in result:
                    shown += f", proxy CPU {result['proxy_cpu']:.2f} s"
                print(f"[load {repeat + 1}/{args.repeats}] {contender}: {shown}", file=sys.stderr, flush=True)
            for contender in args.save_contenders:
                result = run_save(contender, spec, f"{bucket}/save-{repeat + 1}-{contender}", args)
                results[contender].append(result)
                shown = (f"{result['seconds']:.2f} s, {result['bytes'] / result['seconds'] / 1e9:.2f} GB/s, "
                         f"peak RSS {fmt_gb(result['peak_rss'])} GB" if result["ok"] else "failed: " + result["error"])
                print(f"[save {repeat + 1}/{args.repeats}] {contender}: {shown}", file=sys.stderr, flush=True)

        diagnosis: dict = {"ranged_gets": args.ranged_gets}
        if not args.no_diagnose:
            diagnosis["single"] = run_load("ours_traced", home, url, args)
            if "ours_2proc" in args.contenders:
                diagnosis["multi"] = run_load("ours_2proc_traced", home, url, args)
            try:
                diagnosis["probe"] = server_probe(fs, f"{bucket_root}/{CHECKPOINT_KEY}", files)
            except Exception as e:  # noqa: BLE001
                print(f"server probe failed: {one_line(e)}", file=sys.stderr)
        shutil.rmtree(args.scratch, ignore_errors=True)
        if proxy is not None:
            proxy.close()

    table = render(spec, files, results, args, time.perf_counter() - started, diagnosis)
    publish(table, ("object_store_network" if args.network else "object_store")
            + ("_ranged" if args.ranged_gets else "") + ".md")


if __name__ == "__main__":
    main()

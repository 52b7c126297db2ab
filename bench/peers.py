"""Optional peers for ``bench/load.py``, ``bench/object_store.py`` and ``bench/accelerator.py``: Run:ai Model
Streamer, fastsafetensors and (CUDA only) InstantTensor.

    pip install -e '.[test,bench-peers]'      # torch==2.13.0, runai-model-streamer[s3]==0.17.0, fastsafetensors==0.5.0
    pytest tests/benchmarks/test_bench_peers.py          # every peer on a tiny checkpoint, bitwise (local and S3)

Each loader has the contract of the contenders in ``bench/load.py``: it takes the
checkpoint (a local HF-sharded directory with ``model.safetensors.index.json``, or for
``load_runai_s3`` an ``s3://bucket/prefix`` holding the same files), ``target`` (name ->
``jax.ShapeDtypeStruct`` with ``.sharding``) and ``extra`` (a dict the loader may write
notes into), and returns ``{name: jax.Array}`` with exactly ``target[name].sharding``,
via ``jax.device_put(host_array, sharding)``. ``LOADERS``, ``PACKAGES`` and
``CONTENDER_NOTES`` below are meant to be merged into those of ``bench/load.py``
(``PACKAGES`` names the module whose absence makes ``available()`` skip the peer), and
``prepare(contender)`` called where the harness imports a contender's package before the
clock (torch and the libraries' lazy imports: ~2 s that would otherwise be timed).

Each peer uses its library's documented fastest path for whole safetensors files, with
the library's default concurrency:

* ``runai``: ``SafetensorsStreamer().stream_files(files)`` over every file of the
  index, then ``get_tensors()``; tensors arrive in completion order, each is handed
  to ``jax.device_put`` as it arrives (so the copy into the device buffers overlaps
  the streamer's reads). Defaults, as 0.17 logs them with ``RUNAI_STREAMER_LOG_LEVEL=DEBUG``:
  ``RUNAI_STREAMER_CONCURRENCY`` 16 workers (8 for object storage), 2 MiB file-system
  blocks, 8 MiB object-storage ranges, ``RUNAI_STREAMER_MEMORY_LIMIT`` unlimited, and
  file-system strategy ``io_uring_direct`` (O_DIRECT: the page cache is bypassed, so a
  warm cache does not help it); ``owned=True`` (each yielded tensor owns its slot of the
  ring, no clone needed). Run:ai yields ``torch.Tensor``s (CPU), never numpy.
* ``runai_s3``: the same over ``s3://`` URLs (the ``runai-model-streamer-s3`` plugin,
  AWS C++ SDK). The file list comes from the library's own listing
  (``FileStreamer.list_files``) and the index it reads with ``FileStreamer``; the
  server is configured the way the Run:ai docs say for S3-compatible stores
  (``runai_s3_env``): ``AWS_ENDPOINT_URL``, ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``,
  ``AWS_EC2_METADATA_DISABLED=true``, and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_DEFAULT_REGION. (``RUNAI_STREAMER_S3_ENDPOINT``, seen in some deployments, is
  not read by 0.17: its library knows ``AWS_ENDPOINT_URL`` and
  ``RUNAI_STREAMER_OVERRIDE_ENDPOINT_URL``.)
* ``fastsafetensors``: ``SafeTensorsFileLoader(None, "cpu", nogds=True)``,
  ``add_filenames({0: files})``, ``copy_files_to_device()`` (all files read in
  parallel by its ``pread`` workers into one host buffer per file), then
  ``get_tensor(name)`` per tensor (a zero-copy ``torch.Tensor`` view owning its
  buffer). Defaults: ``max_threads=16``, ``bbuf_size_kb=16 MiB``, O_DIRECT unless the
  file system is a network one (``FASTSAFETENSORS_ODIRECT``). The whole checkpoint is
  resident in host memory before the first ``device_put`` (its design: read
  everything, then instantiate lazily).
* ``fastsafetensors_gpu`` (``bench/accelerator.py``): the same with
  ``SafeTensorsFileLoader(None, "cuda:<i>", nogds=True)``: its ``pread`` workers fill a
  pinned bounce buffer that it copies into one GPU buffer per file (GPUDirect Storage is
  not tried: it needs cuFile and ``nvidia-fs``); ``get_tensor`` gives torch CUDA tensors
  that own their memory, handed to JAX without a copy (``torch_to_jax``).
* ``instanttensor`` (``bench/accelerator.py``; InstantTensor 0.2.x, ``pip install
  instanttensor``, not in the ``bench-peers`` extra): ``safe_open(files,
  framework="pt", device=<i>)`` over every file of the index, then ``tensors()``:
  its own I/O backend (io_uring or AIO with O_DIRECT on a disk) into a GPU ring buffer,
  each yielded tensor a torch CUDA clone that owns its memory (the default ``copy=True``),
  handed to JAX by ``torch_to_jax``. CUDA devices only (its ``safe_open`` refuses any
  other); it refuses files whose ``format`` metadata is not ``"pt"`` (ours write ``"pt"``).

The two CUDA peers raise (in ``prepare`` or the loader) where torch sees no CUDA device or
the target's device is not a CUDA one; ``bench/accelerator.py`` reports that as "n/a".
Torch's caching allocator and XLA's share the GPU: a worker running them starts JAX with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (XLA would otherwise reserve 75 % of the memory).

bf16 without copies: torch tensors cannot go through ``Tensor.numpy()`` as bf16
(numpy has no bf16), so ``torch_to_numpy`` reinterprets the bits:
``t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)`` (and uint8 for the fp8
types). All three steps are views of the same memory (the self-test checks the
pointer). ``jax.device_put`` on the CPU then aliases a host array whose address is
64-byte aligned (no copy at all, even for ``P()`` on 8 devices, which then share one
buffer) and copies one that is not. fastsafetensors' tensors are aligned; Run:ai's sit at
their file offset modulo 64 (its ring keeps addresses congruent to file offsets for
O_DIRECT), so unless the data section starts at a multiple of 64, every tensor is copied
(8 times when replicated).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

INDEX = "model.safetensors.index.json"

CONTENDER_NOTES = {
    "runai": "Run:ai Model Streamer `SafetensorsStreamer().stream_files(files)` → `get_tensors()` "
             "(torch) → bf16 bit view as numpy → `jax.device_put(x, sharding)` as each tensor arrives; "
             "library defaults (16 reader threads)",
    "runai_s3": "Run:ai Model Streamer over `s3://` (runai-model-streamer-s3, AWS C++ SDK), same path; "
                "library defaults (8 reader threads, 8 MiB ranges)",
    "fastsafetensors": "fastsafetensors `SafeTensorsFileLoader(None, \"cpu\", nogds=True)` → "
                       "`copy_files_to_device()` → `get_tensor(name)` (torch view) → bf16 bit view as "
                       "numpy → `jax.device_put(x, sharding)`; library defaults (16 threads)",
    "fastsafetensors_gpu": "fastsafetensors `SafeTensorsFileLoader(None, \"cuda:i\", nogds=True)` → "
                           "`copy_files_to_device()` (pinned bounce buffer → GPU) → `get_tensor(name)` "
                           "(torch CUDA tensor) → `jax.dlpack.from_dlpack` → `jax.device_put(x, sharding)`",
    "instanttensor": "InstantTensor `safe_open(files, framework=\"pt\", device=i)` → `tensors()` (torch CUDA "
                     "tensors, owning copies; its default backend and buffer) → `jax.dlpack.from_dlpack` → "
                     "`jax.device_put(x, sharding)`",
}
# The module whose absence makes bench/load.py's available() skip the peer. runai_s3
# needs the streamer too: runai-model-streamer[s3] installs both.
PACKAGES = {
    "runai": "runai_model_streamer",
    "runai_s3": "runai_model_streamer_s3",
    "fastsafetensors": "fastsafetensors",
    "fastsafetensors_gpu": "fastsafetensors",
    "instanttensor": "instanttensor",
}
# The peers that read into CUDA memory themselves.
CUDA_PEERS = ("fastsafetensors_gpu", "instanttensor")


# ---------------------------------------------------------------------------
# Shared helpers.


def weight_map(checkpoint: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index (or the single file's header); as in bench/load.py."""
    index = checkpoint / INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    with open(checkpoint / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: "model.safetensors" for name in header if name != "__metadata__"}


def _files_for(names_to_files: dict[str, str], target: dict) -> tuple[list[str], bool]:
    """The files holding the target's tensors (sorted), and whether the target is all of the checkpoint."""
    missing = set(target) - set(names_to_files)
    if missing:
        raise KeyError(f"not in the checkpoint: {sorted(missing)[:5]}")
    files = sorted({names_to_files[name] for name in target})
    return files, len(target) == len(names_to_files)


def torch_to_numpy(tensor):
    """The CPU torch tensor's memory as a numpy array of the same dtype, without a copy.

    bf16 and the fp8 types have no numpy dtype of their own: the tensor is viewed as
    unsigned integers of the same width, exported with ``.numpy()`` (shares memory),
    and viewed as the ml_dtypes type.
    """
    import ml_dtypes
    import torch

    by_bits = {torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16)}
    for torch_name, ml_name in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
                                ("float8_e4m3fnuz", "float8_e4m3fnuz"), ("float8_e5m2fnuz", "float8_e5m2fnuz"),
                                ("float8_e8m0fnu", "float8_e8m0fnu")):
        if hasattr(torch, torch_name) and hasattr(ml_dtypes, ml_name):
            by_bits[getattr(torch, torch_name)] = (torch.uint8, getattr(ml_dtypes, ml_name))
    if tensor.dtype in by_bits:
        carrier, dtype = by_bits[tensor.dtype]
        return tensor.view(carrier).numpy().view(dtype)
    return tensor.numpy()


def torch_to_jax(tensor):
    """A torch CUDA tensor as a ``jax.Array`` on the same GPU, sharing its memory (DLPack);
    the array keeps the tensor alive."""
    import jax.dlpack

    return jax.dlpack.from_dlpack(tensor)


def cuda_index(target: dict) -> int:
    """Torch's index of the CUDA device the target's arrays start on (its lowest-numbered
    device; ``device_put`` spreads them from there); raises unless that is a CUDA device."""
    device = min((d for want in target.values() for d in want.sharding.device_set), key=lambda d: d.id)
    if device.platform != "gpu" or "rocm" in device.client.platform_version.lower():
        raise RuntimeError(f"needs a CUDA device; the target's is {device.platform} "
                           f"({device.client.platform_version})")
    return device.local_hardware_id


# ---------------------------------------------------------------------------
# Run:ai Model Streamer.


def load_runai(checkpoint: Path, target: dict, extra: dict) -> dict:
    """Every file of the index through one ``SafetensorsStreamer.stream_files``, device_put as tensors arrive."""
    checkpoint = Path(checkpoint)
    files, everything = _files_for(weight_map(checkpoint), target)
    return _runai_stream([str(checkpoint / f) for f in files], None if everything else target, target, extra)


def _runai_stream(paths: list[str], names, target: dict, extra: dict) -> dict:
    import jax
    from runai_model_streamer import SafetensorsStreamer

    result = {}
    with SafetensorsStreamer() as streamer:
        # tensor_names=None (the whole files) unless the target is a subset.
        streamer.stream_files(paths, tensor_names=None if names is None else list(names))
        for name, tensor in streamer.get_tensors():
            if name in target:
                result[name] = jax.device_put(torch_to_numpy(tensor), target[name].sharding)
        extra["runai_unaligned_copies"] = streamer.unaligned_copies
        extra["runai_bytes"] = streamer.total_size
    missing = set(target) - set(result)
    if missing:
        raise KeyError(f"Run:ai streamed no tensor named {sorted(missing)[:5]}")
    return result


def runai_s3_env(endpoint: str, key: str = "testing", secret: str = "testing",
                 region: str = "us-east-1") -> dict[str, str]:
    """The environment the Run:ai S3 plugin needs for an S3-compatible server at ``endpoint``.

    From the Run:ai docs (docs/src/usage.md, "Streaming from S3 compatible storage",
    and docs/src/env-vars.md): the endpoint in ``AWS_ENDPOINT_URL`` (mandatory for a
    non-AWS server), path-style URLs (``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``;
    virtual-hosted ones would put the bucket in the host name), and
    ``AWS_EC2_METADATA_DISABLED=true`` (else the AWS SDK probes the EC2 metadata
    service for a region first, a few seconds). Credentials come from the AWS default
    chain, here the environment (the streamer's default is no boto3 session,
    ``RUNAI_STREAMER_NO_BOTO3_SESSION=1``).
    """
    return {"AWS_ENDPOINT_URL": endpoint, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": region, "AWS_REGION": region}


def configure_runai_s3(endpoint: str | None = None) -> None:
    """Sets ``runai_s3_env`` in this process (endpoint and addressing always; credentials unless set).

    The endpoint is ``endpoint``, else ``AWS_ENDPOINT_URL``, else ``FSSPEC_S3_ENDPOINT_URL``
    (how bench/object_store.py hands the server to its workers); its key and secret
    likewise fall back to ``FSSPEC_S3_KEY`` / ``FSSPEC_S3_SECRET``. Call it before the
    timed region: the S3 client reads the environment when a streamer first opens it.
    """
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("FSSPEC_S3_ENDPOINT_URL")
    if not endpoint:
        raise ValueError("no S3 endpoint: pass extra['s3_endpoint'] or set AWS_ENDPOINT_URL")
    env = runai_s3_env(endpoint, os.environ.get("FSSPEC_S3_KEY", "testing"),
                       os.environ.get("FSSPEC_S3_SECRET", "testing"))
    for name in ("AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "AWS_EC2_METADATA_DISABLED"):
        os.environ[name] = env.pop(name)
    for name, value in env.items():
        os.environ.setdefault(name, value)


def load_runai_s3(url_prefix: str, target: dict, extra: dict) -> dict:
    """``load_runai`` over ``s3://bucket/prefix``: listing and index read with the streamer's own client."""
    from runai_model_streamer import FileChunks, FileStreamer

    # An S3-compatible server (extra["s3_endpoint"], AWS_ENDPOINT_URL or bench/object_store.py's
    # FSSPEC_S3_ENDPOINT_URL) gets the documented settings; with none, AWS S3 and its defaults.
    if extra.get("s3_endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("FSSPEC_S3_ENDPOINT_URL"):
        configure_runai_s3(extra.get("s3_endpoint"))
    prefix = url_prefix.rstrip("/") + "/"  # the C++ listing wants the trailing slash
    with FileStreamer() as files_streamer:
        listed = dict(files_streamer.list_files(prefix, is_recursive=False))
        index = prefix + INDEX
        if index in listed:
            files_streamer.stream_files([FileChunks.contiguous(0, index, 0, [listed[index]])])
            raw = b"".join(bytes(buffer.numpy()) for _, _, buffer in files_streamer.get_chunks())
            names_to_files = json.loads(raw)["weight_map"]
        elif prefix + "model.safetensors" in listed:
            names_to_files = None  # one file: stream it whole
        else:
            raise FileNotFoundError(f"neither {INDEX} nor model.safetensors under {prefix}")
    if names_to_files is None:
        return _runai_stream([prefix + "model.safetensors"], None, target, extra)
    files, everything = _files_for(names_to_files, target)
    return _runai_stream([prefix + f for f in files], None if everything else target, target, extra)


# ---------------------------------------------------------------------------
# fastsafetensors.


def load_fastsafetensors(checkpoint: Path, target: dict, extra: dict, device: str = "cpu") -> dict:
    """``SafeTensorsFileLoader`` on ``device`` without GDS; every file of the index in one ``copy_files_to_device``."""
    import jax
    from fastsafetensors import SafeTensorsFileLoader

    checkpoint = Path(checkpoint)
    files, everything = _files_for(weight_map(checkpoint), target)
    to_jax = torch_to_numpy if device == "cpu" else torch_to_jax  # CUDA tensors: handed over in place
    loader = SafeTensorsFileLoader(None, device, nogds=True)
    try:
        loader.add_filenames({0: [str(checkpoint / f) for f in files]})
        if not everything:
            wanted = set(target)
            loader.set_tensor_filter(lambda name: name in wanted)
        buffers = loader.copy_files_to_device()
        try:
            result = {name: jax.device_put(to_jax(buffers.get_tensor(name)), want.sharding)
                      for name, want in target.items()}
        finally:
            buffers.close()  # the tensors (and so the arrays viewing them) keep their memory alive
    finally:
        loader.close()
    return result


def load_fastsafetensors_gpu(checkpoint: Path, target: dict, extra: dict) -> dict:
    """``load_fastsafetensors`` onto the target's CUDA device (its bounce buffer, then GPU buffers)."""
    return load_fastsafetensors(checkpoint, target, extra, device=f"cuda:{cuda_index(target)}")


def load_instanttensor(checkpoint: Path, target: dict, extra: dict) -> dict:
    """InstantTensor's ``safe_open`` over every file of the index onto the target's CUDA device."""
    import jax
    from instanttensor import safe_open

    checkpoint = Path(checkpoint)
    files, everything = _files_for(weight_map(checkpoint), target)
    result = {}
    with safe_open([str(checkpoint / f) for f in files], framework="pt", device=cuda_index(target),
                   tensor_filter=None if everything else sorted(target),
                   tensor_name_match_mode="exact") as f:
        for name, tensor in f.tensors():  # owning clones (copy=True, the default)
            result[name] = jax.device_put(torch_to_jax(tensor), target[name].sharding)
    missing = set(target) - set(result)
    if missing:
        raise KeyError(f"InstantTensor yielded no tensor named {sorted(missing)[:5]}")
    return result


LOADERS = {"runai": load_runai, "runai_s3": load_runai_s3, "fastsafetensors": load_fastsafetensors,
           "fastsafetensors_gpu": load_fastsafetensors_gpu, "instanttensor": load_instanttensor}


def installed(contender: str) -> bool:
    """Whether the peer can run here: its package, the streamer for runai_s3, and torch."""
    import importlib.util

    needed = [PACKAGES[contender], "torch"] + (["runai_model_streamer"] if contender == "runai_s3" else [])
    return all(importlib.util.find_spec(module) is not None for module in needed)


def prepare(contender: str) -> None:
    """Imports a peer needs, for the harness to do before the clock (as bench/load.py does for its own).

    ``importlib.import_module(PACKAGES[contender])`` is not enough here: fastsafetensors
    imports torch only when its first loader is built (~2 s on this machine, inside the
    timed region), and ``runai_model_streamer_s3`` does not import the streamer or torch.
    """
    import ml_dtypes  # noqa: F401
    import torch

    if contender in CUDA_PEERS:
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        torch.empty(1, device="cuda")  # torch's CUDA context, before the clock too
    if contender in ("runai", "runai_s3"):
        import runai_model_streamer  # noqa: F401
        if contender == "runai_s3":
            import runai_model_streamer_s3  # noqa: F401
    elif contender in ("fastsafetensors", "fastsafetensors_gpu"):
        from fastsafetensors.frameworks import get_framework_op

        get_framework_op("pytorch")  # the torch adapter, which the first loader would import
    elif contender == "instanttensor":
        import instanttensor  # noqa: F401
    else:
        raise KeyError(contender)

"""Interop with torch DCP and transformers (the `interop` extra; skipped without it)."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.multiprocess import free_port
from tests.support.sharding_cases import sources
from tests.support.tolerances import assert_within, causal_lm_reference

pytestmark = pytest.mark.slow  # the torch peer

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

_MODULE = "tests.multiprocess.test_parallel_save_multiprocess"


def _torch_values():
    """The shared sources that torch DCP handles (it has no zero-size chunks)."""
    return {n: v for n, v in sources().items() if v.size > 0}


def _to_torch(value):
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(value))


def _to_numpy(tensor, like):
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(like.dtype)
    return tensor.numpy()


def test_torch_dcp_reads_our_distributed_layout(multiprocess, tmp_path):
    path = tmp_path / "distributed"
    multiprocess(f"{_MODULE}:_child_save", num_processes=2, devices_per_process=4,
                 args={"path": str(path), "scenario": "mesh_2d", "layout": "distributed"})
    values = {**_torch_values(), "host.counter": np.arange(7, dtype=np.int64)}
    state = {n: torch.zeros(v.shape, dtype=_to_torch(v).dtype) for n, v in values.items()}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)), no_dist=True)
    for name, value in values.items():
        np.testing.assert_array_equal(_to_numpy(state[name], value), value, err_msg=name)


_DCP_SAVER = textwrap.dedent("""
    import os, sys, numpy as np, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    sys.path.insert(0, os.environ["REPO"])
    from tests.integrations.test_interop_torch import _to_torch, _torch_values
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {n: distribute_tensor(_to_torch(v), mesh, [Shard(0)]) for n, v in _torch_values().items()
             if v.ndim and v.shape[0] % dist.get_world_size() == 0}
    writer = dcp.HuggingFaceStorageWriter(
        sys.argv[1], save_distributed=True, fqn_to_index_mapping={n: 1 for n in state})
    dcp.save(state, storage_writer=writer)
    dist.destroy_process_group()
""")


def _run_dcp_saver(path, attempts=3):
    """Two torch ranks (gloo) saving with DCP, on a fresh port and directory per attempt.

    The saver is torch alone (none of our code runs in it), and gloo ranks on one machine
    occasionally die at start-up or teardown ("address already in use", or a C++
    "terminate called without an active exception" seen once in a CI run), so a failed
    attempt is retried; every attempt's output is in the error if all fail.
    """
    repo = str(REPO)
    failures = []
    for attempt in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        port = free_port()
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _DCP_SAVER, str(path)],
                env={**os.environ, "REPO": repo, "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(2)]
        outputs = [child.communicate(timeout=180)[0] for child in children]
        if all(child.returncode == 0 for child in children):
            return
        failures.append(f"attempt {attempt + 1}: exit codes {[c.returncode for c in children]}\n"
                        + "\n".join(outputs))
    raise AssertionError("torch DCP saver failed:\n" + "\n".join(failures))


def test_torch_dcp_save_distributed_output_loads_and_consolidates(tmp_path):
    path = tmp_path / "dcp"
    _run_dcp_saver(path)
    files = sorted(os.listdir(path))
    assert files[0].startswith("shard-00001-model-") and any(f.startswith("shard-00002") for f in files)
    values = {n: v for n, v in _torch_values().items() if v.ndim and v.shape[0] % 2 == 0}
    restored = ost.load(path)
    assert sorted(restored) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    ost.consolidate(path, tmp_path / "hf", max_shard_size=200_000)
    ost.save(tmp_path / "reference", values, max_shard_size=200_000)
    for name in os.listdir(tmp_path / "reference"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


def test_transformers_loads_our_hf_checkpoint_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    weights = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    ost.save(tmp_path / "llama", weights, max_shard_size=20_000)  # several shards + index
    config.save_pretrained(tmp_path / "llama")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    for name, tensor in loaded.state_dict().items():  # what transformers read: bit for bit
        np.testing.assert_array_equal(tensor.numpy(), weights[name], err_msg=name)
    tokens = np.arange(12).reshape(2, 6) % 64
    expected, atol = causal_lm_reference(model, tokens)
    # The same weights through the same kernels, whose rounding may still follow the buffers' alignment.
    assert_within(causal_lm_reference(loaded, tokens)[0], expected, atol, "logits")

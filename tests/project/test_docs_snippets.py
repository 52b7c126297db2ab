"""Every python snippet of docs/ runs as written, on 1 and 8 CPU devices.

A page's snippets run in order in a fresh interpreter (one for every page), in an empty
directory of the page's own, sharing one namespace as a reader following the page would. The names a page takes from its reader (the
model's ``params``, an ``abstract_params`` target, a ``train_step``) are given by ``_READER``,
on tiny arrays; checkpoints a page names (``hf-ckpt/``, ``Qwen3-8B/``) are made first. The few
snippets that need what CI has not (a bucket, the Hub, MaxText's own code) are listed in
``_NOT_RUN`` with the test that runs the same calls; a new snippet must be run or listed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import REPO

pytestmark = pytest.mark.slow  # fresh interpreters importing JAX
_PAGES = ["concepts.md", "migration.md", "models.md", "orbax.md", "storage.md"]
_NOT_RUN = {
    ("concepts.md", 1): "a gs:// bucket (tests/storage/test_object_store.py: the same load against a GCS emulator)",
    ("models.md", 1): "MaxText's own modules (tests/families/test_maxtext_mapping.py runs it in MaxText's venv)",
    ("models.md", 3): "a DeepSeek-V3 release (tests/families/test_deepseek_mapping.py: the same calls, a small one)",
    ("models.md", 4): "DeepSeek-V3 and Kimi-K2 releases (tests/benchmarks/test_bench_quantized.py and "
                      "tests/families/test_compressed_tensors.py: the same calls, small ones)",
    ("models.md", 5): "a MaxText training state (tests/integrations/test_maxtext_orbax.py: the same manager calls)",
    ("storage.md", 0): "an S3 endpoint (tests/storage/test_object_store.py: the same calls against moto)",
    ("storage.md", 1): "the Hugging Face Hub (tests/storage/test_hf_hub.py: the same calls against a stand-in)",
}

# What the pages take from their reader: a model's params and optimizer state on a mesh, their
# abstract twins, a step, and an HF checkpoint of the params at hf-ckpt/.
_READER = """
import asyncio, json, os
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import orbax_safetensors as ost

mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
params = {"embed": jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16),
                                  NamedSharding(mesh, P("x"))),
          "bias": jax.device_put(jnp.ones((16,)), NamedSharding(mesh, P()))}
opt_state = opt = {"mu": jax.tree.map(jnp.zeros_like, params)}
abstract_params = target = sharded_abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
abstract_opt_state = jax.tree.map(ocp.utils.to_shape_dtype_struct, opt_state)
batch_spec = jax.ShapeDtypeStruct((8, 64), jnp.float32)
num_steps, step = 3, 1

def train_step(params, other):
    return jax.tree.map(lambda x: x * 0.5, params), other

ost.save("hf-ckpt/", params)
path = epath.Path(os.path.abspath("hf-ckpt"))
"""

# Checkpoints a page loads by name, made as `hf download` would leave them (tiny, random).
_CHECKPOINTS = """
import torch, transformers
torch.manual_seed(0)
tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tiny)).save_pretrained("Qwen3-8B")
transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny)).save_pretrained("Llama-3.1-8B")
"""

_PAGE_SETUP = {"concepts.md": 'ost.save("ckpt/", params)', "models.md": _CHECKPOINTS}

# Runs each page in its own directory and namespace, its snippets in order, with top-level await
# allowed (as in a notebook cell): one interpreter for every page, as importing JAX is most of it.
_RUNNER = """
import ast, asyncio, inspect, json, os, sys
for page, snippets in json.loads(sys.argv[1]):
    os.makedirs(page)
    os.chdir(page)
    namespace = {"__name__": "__main__"}
    for label, source in snippets:
        code = compile(source, label, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            asyncio.run(result)
        print("ran", label, flush=True)
    os.chdir("..")
"""


def _snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "docs" / page).read_text(), re.S)


def test_every_snippet_is_run_or_says_why_not():
    for page, index in _NOT_RUN:
        assert index < len(_snippets(page)), f"{page} has no snippet {index} any more"


@pytest.mark.parametrize("devices", [1, 8])
def test_the_snippets_of_every_page_run_as_written(tmp_path, devices):
    pytest.importorskip("torch")  # the checkpoints models.md loads are made by transformers
    pytest.importorskip("transformers")
    pages = []
    for page in _PAGES:
        setup = [("reader", _READER)] + ([("checkpoints", _PAGE_SETUP[page])] if page in _PAGE_SETUP else [])
        pages.append((page, setup + [(f"{page}[{i}]", s) for i, s in enumerate(_snippets(page))
                                     if (page, i) not in _NOT_RUN]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    result = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(pages)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-1500:]}\n{result.stderr[-4000:]}"
    assert result.stdout.count("ran ") == sum(len(snippets) for _, snippets in pages), result.stdout

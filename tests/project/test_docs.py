"""The docs say what the code does: generated reference current, snippets valid, links live."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from tests.support import REPO
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_api_reference_is_generated_from_the_current_code():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "api_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_python_snippets_compile_and_links_resolve(doc):
    text = doc.read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        # Top-level ``await`` as in an async REPL or notebook cell.
        compile(block, f"{doc.name}[python block {i}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_the_orbax_v1_migration_example_reads_the_same_arrays(tmp_path):
    """docs/migration.md: Orbax's layout in a v1 context, ``ost.load`` and ``ost.SafetensorsLayout``
    give the same arrays for the same abstract tree."""
    mesh = jax.make_mesh((8,), ("x",))
    values = {"embed": np.arange(64 * 16, dtype=np.float32).reshape(64, 16),
              "bias": np.arange(16, dtype=np.float32)}
    ost.save(tmp_path / "hf-ckpt", values, max_shard_size=2000)
    abstract = {"embed": jax.ShapeDtypeStruct((64, 16), np.float32,
                                              sharding=NamedSharding(mesh, P("x", None))),
                "bias": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P()))}
    with ocp.v1.Context(checkpoint_layout=ocp.v1.options.CheckpointLayout.SAFETENSORS):
        theirs = ocp.v1.load(tmp_path / "hf-ckpt", abstract)
    ours = ost.load(tmp_path / "hf-ckpt", abstract)
    async def through_the_layout():
        return await (await ost.SafetensorsLayout().load(epath.Path(tmp_path / "hf-ckpt"),
                                                         abstract_state=abstract))
    layout = asyncio.run(through_the_layout())
    for name, value in values.items():
        for result in (theirs, ours, layout):
            np.testing.assert_array_equal(np.asarray(result[name]), value, err_msg=name)
            assert result[name].sharding == abstract[name].sharding


@pytest.mark.slow  # two fresh interpreters importing JAX
@pytest.mark.parametrize("devices", [1, 8])
def test_the_readme_tour_runs_as_written(tmp_path, devices):
    tour = (REPO / "README.md").read_text().split("## API tour", 1)[1]
    code = re.search(r"```python\n(.*?)```", tour, re.S).group(1)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "save ckpt/: " in result.stderr and "load ckpt/: " in result.stderr  # progress=True

"""Executes colab/orbax_safetensors_quickstart.ipynb top to bottom, offline, on CPU.

The kernel is this interpreter (a kernelspec written to a temp dir points at
``sys.executable``), so the notebook imports the checkout under test and nothing
is fetched. Its install cell installs only when ``orbax_safetensors`` is not
importable; here it is, so the cell runs and reports that it skipped pip (asserted
below). Run with 8 CPU devices (2-D mesh) and with 1 (the 1-device fallback).
"""

import json
import os
import re
import sys

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from tests.support import REPO

pytestmark = pytest.mark.slow  # a notebook run in a kernel

REPO_ROOT = str(REPO)
NOTEBOOK = os.path.join(REPO_ROOT, "colab", "orbax_safetensors_quickstart.ipynb")


def _kernel(tmp_path, device_count):
    """A KernelManager for this interpreter with a CPU-only JAX of ``device_count`` devices."""
    kernels = tmp_path / "kernels"
    (kernels / "ost-test").mkdir(parents=True)
    bin_dir = os.path.dirname(sys.executable)  # the venv's console scripts (orbax-safetensors)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "orbax_safetensors test", "language": "python",
        "env": {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={device_count}",
            "JAX_PLATFORMS": "cpu",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join(
                p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
            "IPYTHONDIR": str(tmp_path / "ipython"),
        },
    }
    (kernels / "ost-test" / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    return KernelManager(kernel_name="ost-test", kernel_spec_manager=specs,
                         connection_file=str(tmp_path / "kernel-connection.json"))


def _stdout(cell):
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_notebook_is_stored_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    # The first code cell is the (guarded) install.
    assert "%pip install" in code[0].source and "orbax_safetensors" in code[0].source


@pytest.mark.parametrize("device_count", [8, 1])
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch, device_count):
    pytest.importorskip("flax")  # the `examples` extra, as for examples/flax_train.py
    pytest.importorskip("optax")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    workdir = tmp_path / "work"
    workdir.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=_kernel(tmp_path, device_count), timeout=120, startup_timeout=60,
        allow_errors=False, resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError, with the traceback, if any cell fails

    out = "\n".join(_stdout(c) for c in nb.cells if c.cell_type == "code")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "error"]
    assert not errors, errors

    # The install cell ran its guard and left pip alone (the package is the checkout).
    assert "orbax_safetensors is already installed" in out
    assert f"{REPO_ROOT}{os.sep}orbax_safetensors{os.sep}__init__.py" in out, (
        "the kernel imported orbax_safetensors from somewhere else than this checkout")

    mesh = {8: "mesh {'data': 2, 'model': 4}", 1: "mesh {'data': 1}"}[device_count]
    assert f"{device_count} cpu device(s) in 1 process(es); {mesh}" in out, out[:2000]
    spec = r"(?:P|PartitionSpec)"  # how jax prints a PartitionSpec depends on its version
    saved, restored = {8: (r"'data', 'model'", r"'model', 'data'"),
                       1: (r"'data', None", r"None, 'data'")}[device_count]
    # A kernel as initialised, then saved and restored with its mesh axes swapped.
    assert re.search(rf"\['Dense_1'\]\['kernel'\]\s+\(64, 64\)\s+{spec}\({saved}\)", out), out
    assert re.search(rf"\['Dense_1'\]\['kernel'\]\s+saved {spec}\({saved}\)\s+"
                     rf"restored {spec}\({restored}\)", out), out

    assert "kept steps: [1, 2]" in out
    assert "restored step 2 under transposed shardings: all 6 tensors equal" in out
    assert re.search(rf"under {spec}\(\) as bfloat16: all 6 tensors equal", out)

    step_dir = workdir / "checkpoints" / "quickstart" / "2"
    params_dir = step_dir / "params"
    assert sorted(os.listdir(workdir / "checkpoints" / "quickstart")) == ["1", "2"]
    shards = sorted(f for f in os.listdir(params_dir) if f.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(params_dir)
    for name in shards + ["model.safetensors.index.json"]:
        assert re.search(rf"{re.escape(name)}  \(\d+ bytes\)", out), name  # the listing cell
    assert re.search(r"__metadata__: \{.*'step': '2'", out)
    assert f"verify: ok=True, kind hf sharded, {len(shards)} files, 6 tensors" in out
    # The CLI, run from the notebook through subprocess: inspect's table, verify's summary.
    assert "$ orbax-safetensors inspect " in out and "$ orbax-safetensors verify " in out
    assert re.search(r"Dense_1\.kernel\s+float32\s+\(64, 64\)\s+16\.38 KB\s+model-0000", out)
    assert re.search(rf"6 tensors, [\d.]+ KB in {len(shards)} file\(s\)", out)
    assert re.search(rf"^ok: hf sharded, {len(shards)} file\(s\), 6 tensors", out, re.M)
    assert "safetensors.safe_open reads the same values as the JAX params" in out

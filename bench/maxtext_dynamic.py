"""MaxText's ``safetensors_dynamic`` load, with Orbax's layout and with ours, against our mapped load.

Runs in the MaxText 0.2.5 venv (Python 3.12; ``tests/families/test_maxtext_mapping.py`` builds it and,
run as a script, prints its python)::

    MAXTEXT_PY=$(.venv/bin/python tests/families/test_maxtext_mapping.py)
    $MAXTEXT_PY bench/maxtext_dynamic.py               # ~1.04 GB checkpoint, 3 repeats, cold and warm
    $MAXTEXT_PY bench/maxtext_dynamic.py --quick       # ~0.045 GB, 1 repeat: a smoke test

What it measures: the wall time and peak memory of filling MaxText's scanned Llama-3.1 params
tree from one synthetic llama-like bf16 HF checkpoint (the one ``bench/scanned.py`` writes and
caches under ``--dir``: an HF sharded directory with its index and ``config.json``), on 8 host
CPU devices, three ways:

* ``dynamic_orbax``: MaxText's own ``source_checkpoint_layout="safetensors_dynamic"`` path,
  ``checkpoint_conversion/utils/load_dynamic.py``'s ``load_safetensors_dynamic_state``: under
  ``ocp.v1.Context(checkpoint_layout=SAFETENSORS)``, ``ocp.v1.pytree_metadata`` and
  ``ocp.v1.load_pytree`` of the whole HF state, every tensor sharded over all devices
  (``construct_maximal_shardings``), then MaxText's hooks per leaf on device (transposes, RoPE
  halves to pairs, the query scale in float32, layers stacked at axis 1, ``device_put`` to the
  leaf's sharding), with Orbax's ``SafetensorsLayout``;
* ``dynamic_ours``: the same call with ``ost.install_orbax_layout()`` in force;
* ``mapped``: ``ost.load(dir, target, mapping=ost.mappings.maxtext("llama3.1", config,
  scan_layers=True))``: each leaf read from the files straight into its shards.

MaxText's path reads its HF config table (``HF_MODEL_CONFIGS["llama3.1-8b"]``, the real 8B's
sizes): the checkpoint's ``config.json`` is put there, as ``tests/support/maxtext_child.py`` does, and its
pyconfig is built from the same ``config.json`` (``tests/maxtext_child.maxtext_overrides``).
Targets are ``bench/scanned.py``'s: MaxText's logical axis rules resolved on a mesh
``("fsdp", "tensor")`` of (2, 4) (``--shardings fsdp`` for (8, 1)). Method as in
``bench/scanned.py``: a fresh worker process per run, cold and warm (``common.CONDITION_NOTES``),
the checkpoint in the page cache before every run, runs alternating, disturbed runs discarded
and run again; timed: the load call plus ``block_until_ready`` (imports, MaxText's pyconfig
and the target built before). Every run's tree is checked afterwards: names, shapes, dtypes,
shardings, and several leaves bitwise against MaxText's host recipe (``scanned.verify``; for
MaxText's path with XLA's flush of subnormals to zero: its query scale runs on device, and the
synthetic weights, uniform bit patterns, hold values that the scale makes subnormal).

Results go to stdout and ``bench/results/maxtext_dynamic.md`` (``-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
import scanned
from common import CONDITION_NOTES, machine_line, publish, report_result, versions_line
from load import checkpoint_files

CONTENDERS = ("dynamic_orbax", "dynamic_ours", "mapped")
BASELINE = "dynamic_orbax"
MODEL_NAME = "llama3.1-8b"  # MaxText's model whose yml, layers and conversion tables are used
CONTENDER_NOTES = {
    "dynamic_orbax": "MaxText 0.2.5 `load_dynamic.load_safetensors_dynamic_state(dir, target, config)` "
                     "with Orbax's `SafetensorsLayout`",
    "dynamic_ours": "the same with `ost.install_orbax_layout()`",
    "mapped": f'`ost.load(dir, target, mapping=ost.mappings.maxtext("{scanned.FAMILY}", config, '
              "scan_layers=True))`",
}


def maxtext_config(checkpoint: Path, sharding: str):
    """MaxText's pyconfig for the checkpoint's model (its ``config.json``) on the bench's mesh."""
    from maxtext.configs import pyconfig
    from tests.support.maxtext_child import maxtext_overrides

    hf = json.loads((checkpoint / "config.json").read_text())
    overrides = maxtext_overrides(scanned.FAMILY, MODEL_NAME, hf, True, 16, tempfile.mkdtemp(prefix="mt-out-"))
    overrides.update(dtype="bfloat16", weight_dtype="bfloat16", ici_fsdp_parallelism=scanned.MESHES[sharding][0],
                     ici_tensor_parallelism=scanned.MESHES[sharding][1])
    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return pyconfig.initialize(["", base_yml] + [f"{k}={v}" for k, v in overrides.items()])


def load_dynamic(checkpoint: Path, target: dict, extra: dict):
    from maxtext.checkpoint_conversion.utils import load_dynamic as dynamic

    _, restored = dynamic.load_safetensors_dynamic_state(str(checkpoint), target, extra["config"])
    return restored["params"]


def load_mapped(checkpoint: Path, target: dict, extra: dict):
    import orbax_safetensors as ost

    return ost.load(str(checkpoint), target, mapping=extra["mapping"])


LOADERS = {"dynamic_orbax": load_dynamic, "dynamic_ours": load_dynamic, "mapped": load_mapped}


def worker(args) -> None:
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText: stubs instead of Google Cloud clients
    home = Path(args.home)
    spec = json.loads((home / "spec.json").read_text())
    checkpoint = home / "checkpoint"
    import jax

    import orbax_safetensors as ost

    target = scanned.build_target(spec, args.sharding, True)
    extra: dict = {}
    if args.contender == "mapped":
        hf = json.loads((checkpoint / "config.json").read_text())
        extra["mapping"] = ost.mappings.maxtext(scanned.FAMILY, hf, scan_layers=True)
    else:  # MaxText's imports (tens of seconds) before the clock
        import transformers
        from maxtext.checkpoint_conversion.utils import hf_model_configs, load_dynamic  # noqa: F401

        extra["config"] = maxtext_config(checkpoint, args.sharding)
        hf_model_configs.HF_MODEL_CONFIGS[MODEL_NAME] = transformers.AutoConfig.from_pretrained(checkpoint)
        ost.install_orbax_layout(args.contender == "dynamic_ours")
    loader = LOADERS[args.contender]
    result, measured = common.timed_load(
        lambda: jax.block_until_ready(loader(checkpoint, target, extra)), args.condition)
    scanned.verify(result, target, spec, True, checkpoint, flushed=args.contender != "mapped")
    report_result({"ok": True, **measured, "bytes": spec["bytes"]})


def render(spec: dict, files: list[Path], results: dict, args, wall: float) -> str:
    loaded = spec["bytes"]
    lines = [
        f"### MaxText's safetensors_dynamic load (Orbax's layout, ours) vs `ost.load` with the "
        f"MaxText mapping, {loaded / 1e9:.2f} GB bf16 Llama checkpoint, 8 CPU devices",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}",
        f"- checkpoint: `bench/scanned.py`'s, {len(scanned.hf_shapes(spec))} tensors, "
        f"{loaded / 1e9:.3f} GB in {len(files)} files (llama-like GQA, layers {spec['layers']}, hidden "
        f"{spec['hidden']}, heads {spec['heads']}/{spec['kv_heads']}, vocab {spec['vocab']}), in the "
        "page cache before every run; target: MaxText's scanned tree, bf16, on a mesh "
        f"`(\"fsdp\", \"tensor\")` of {', '.join(f'{s} = {scanned.MESHES[s]}' for s in args.shardings)}",
        f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. A fresh "
        f"process per run, {args.repeats} of each, alternating; cells `median [min–max]` seconds; "
        "timed: the load call + `block_until_ready`; a run others disturbed is run again, up to 4 "
        "times (*discarded*; *kept*: still disturbed at the 4th); every result checked (names, "
        "shapes, dtypes, shardings, several leaves bitwise against MaxText's host recipe)",
        f"- *÷ {BASELINE}*: the row's median over MaxText's path with Orbax's layout (below 1: "
        "faster). RSS (cold, medians): peak = the worker's `VmHWM` over the timed region; growth = "
        "(peak − RSS before the load) ÷ the bytes loaded (1.00: nothing held but the result)",
    ]
    lines += scanned.table(results, args, loaded, BASELINE, CONTENDER_NOTES)
    return "\n".join(lines) + "\n"


def main() -> None:
    args = scanned.arguments(__doc__.splitlines()[0], CONTENDERS, shardings="tp", repeats=3)
    if args.worker:
        worker(args)
        return
    started = time.perf_counter()
    home = scanned.ensure_checkpoint(Path(args.dir), scanned.QUICK if args.quick else scanned.FULL)
    spec = json.loads((home / "spec.json").read_text())
    files = checkpoint_files(home / "checkpoint")
    results = scanned.run_all(args, Path(__file__).resolve(), home, files, spec["bytes"])
    publish(render(spec, files, results, args, time.perf_counter() - started),
            "maxtext_dynamic-quick.md" if args.quick else "maxtext_dynamic.md")


if __name__ == "__main__":
    main()

"""Runs MaxText 0.2.5's own ``checkpoint_conversion/to_maxtext.py`` on tiny Hugging Face checkpoints,
as a user would: ``python -m maxtext.checkpoint_conversion.to_maxtext base.yml model_name=...
scan_layers=... base_output_directory=OUT --hf_model_path HF_DIR --save_dtype float32
--lazy_load_tensors true``; several conversions in one process, since importing the converter
alone takes about 20 s.

Run with the MaxText venv's Python (3.12), never imported by pytest::

    $MAXTEXT_VENV/bin/python tests/support/maxtext_to_maxtext.py JOBS.json RESULTS.json

``JOBS.json``: a list of ``{"hf_dir", "family", "out", "scan_layers", "save_dtype"[,
"simulated_cpu_devices_count"]}`` (the last passed on to to_maxtext.py where given);
``RESULTS.json``: ``{out: {"seconds": ...}}`` or ``{out: {"error": ..., "traceback": ...}}`` per
job, in order, each written as soon as it is known (a crash leaves the ones before).

Two things a real model would not need: pyconfig overrides for the tiny sizes
(``override_model_config=True``, ``base_emb_dim``, ...: ``maxtext_child.maxtext_overrides``, the
ones MaxText's forward runs under in ``tests/support/maxtext_child.py``), and the checkpoint's own
``config.json`` in MaxText's table ``HF_MODEL_CONFIGS[model_name]``: to_maxtext.py builds its
``PARAM_MAPPING`` (layer and expert counts) from that table, which holds the real model's config,
not from ``--hf_model_path``. Each job writes MaxText's checkpoint to ``OUT/0/items``.
"""

import argparse
import json
import os
import runpy
import sys
import time
import traceback


def convert(hf_dir: str, family: str, out: str, scan_layers: bool, save_dtype: str,
            simulated_cpu_devices_count: int | None = None) -> None:
    """One run of to_maxtext.py's ``__main__`` (the modules it imports are imported once)."""
    import transformers
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.configs import pyconfig

    from tests.support.maxtext_child import maxtext_model_name, maxtext_overrides

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    model_name = maxtext_model_name(family, hf_config)
    HF_MODEL_CONFIGS[model_name] = transformers.AutoConfig.from_pretrained(hf_dir)
    overrides = maxtext_overrides(family, model_name, hf_config, scan_layers, seq_len=16, out_dir=out)
    overrides.pop("enable_checkpointing")  # the converter saves through its own checkpoint manager
    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    sys.argv = ["to_maxtext.py", base_yml, *(f"{k}={v}" for k, v in overrides.items()),
                f"--hf_model_path={hf_dir}", f"--save_dtype={save_dtype}", "--lazy_load_tensors=true"]
    if simulated_cpu_devices_count is not None:
        sys.argv.append(f"--simulated_cpu_devices_count={simulated_cpu_devices_count}")
    runpy.run_module("maxtext.checkpoint_conversion.to_maxtext", run_name="__main__", alter_sys=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jobs", help="JSON: [{hf_dir, family, out, scan_layers, save_dtype}, ...]")
    p.add_argument("results", help="JSON written: {out: {seconds} or {error, traceback}}")
    args = p.parse_args(argv)
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText: stubs instead of Google Cloud clients
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.support.maxtext_child
    with open(args.jobs) as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        start = time.perf_counter()
        try:
            convert(**job)
            results[job["out"]] = {"seconds": round(time.perf_counter() - start, 1)}
        except Exception as e:  # noqa: BLE001 -- reported per job; the next one still runs
            results[job["out"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        with open(args.results, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

"""Runs MaxText 0.2.5's own ``checkpoint_conversion/to_maxtext.py`` on a tiny Hugging Face checkpoint,
as a user would: ``python -m maxtext.checkpoint_conversion.to_maxtext base.yml model_name=...
scan_layers=... base_output_directory=OUT --hf_model_path HF_DIR --save_dtype float32
--lazy_load_tensors true``.

Run with the MaxText venv's Python (3.12), never imported by pytest::

    $MAXTEXT_VENV/bin/python tests/maxtext_to_maxtext.py --hf-dir HF_DIR --family llama3.1 \\
        --out OUT [--no-scan-layers] [--save-dtype float32]

Two things a real model would not need: pyconfig overrides for the tiny sizes
(``override_model_config=True``, ``base_emb_dim``, ...: ``maxtext_child.maxtext_overrides``, the
ones MaxText's forward runs under in ``tests/maxtext_child.py``), and the checkpoint's own
``config.json`` in MaxText's table ``HF_MODEL_CONFIGS[model_name]``: to_maxtext.py builds its
``PARAM_MAPPING`` (layer and expert counts) from that table, which holds the real model's config,
not from ``--hf_model_path``. Writes MaxText's checkpoint to ``OUT/0/items``.
"""

import argparse
import json
import os
import runpy
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--family", required=True, help="ost.mappings.maxtext's family: llama3.1, qwen3, mixtral")
    p.add_argument("--out", required=True, help="base_output_directory: the checkpoint goes to OUT/0/items")
    p.add_argument("--no-scan-layers", dest="scan_layers", action="store_false")
    p.add_argument("--save-dtype", default="float32")
    args = p.parse_args(argv)
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText: stubs instead of Google Cloud clients
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.maxtext_child

    import transformers
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.configs import pyconfig

    from tests.maxtext_child import maxtext_model_name, maxtext_overrides

    with open(os.path.join(args.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    model_name = maxtext_model_name(args.family, hf_config)
    HF_MODEL_CONFIGS[model_name] = transformers.AutoConfig.from_pretrained(args.hf_dir)
    overrides = maxtext_overrides(args.family, model_name, hf_config, args.scan_layers, seq_len=16, out_dir=args.out)
    overrides.pop("enable_checkpointing")  # the converter saves through its own checkpoint manager
    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    sys.argv = ["to_maxtext.py", base_yml, *(f"{k}={v}" for k, v in overrides.items()),
                f"--hf_model_path={args.hf_dir}", f"--save_dtype={args.save_dtype}", "--lazy_load_tensors=true"]
    runpy.run_module("maxtext.checkpoint_conversion.to_maxtext", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

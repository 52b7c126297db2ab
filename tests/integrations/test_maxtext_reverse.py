"""The reverse of MaxText 0.2.5's own converter: ``to_maxtext.py`` itself
(``tests/support/maxtext_to_maxtext.py``, ``--save_dtype float32 --lazy_load_tensors``, on the 4
simulated CPU devices MaxText's own runs here take, rather than its default 16: the checkpoint still
comes in chunks of axis 0, and each conversion compiles for a quarter of the devices) writes each
family's checkpoint, scanned and unscanned, and ``ost.convert`` takes it back to Hugging Face's form
through ``ost.mappings.maxtext``: the original tensors byte for byte (float32: MaxText's query scale
1/sqrt(head_dim) is a power of two here) and transformers' logits. Where ``to_maxtext.py`` itself
fails, a strict xfail names the failure (``REVERSE_KNOWN``).

The tiny models and the MaxText venv are ``tests/families/test_maxtext_mapping.py``'s; a file of
its own, so that its conversions run beside ``tests/integrations/test_maxtext_convert.py``'s.

    python -m pytest tests/integrations/test_maxtext_reverse.py -m slow -s
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

import orbax_safetensors as ost
from tests.families.test_maxtext_mapping import (  # noqa: F401 -- maxtext_python, hf_checkpoints: fixtures
    CASES,
    CHILD_TIMEOUT,
    DEVICES,
    KNOWN,
    MAXTEXT_CONVERTER_BUGS,
    MAXTEXT_CONVERTER_FAILS,
    MAXTEXT_FORWARD_BUGS,
    NO_CONVERTER,
    PIP_TIMEOUT,
    TOKENS,
    VARIANTS,
    _clean_env,
    case_params,
    hf_checkpoints,
    maxtext_python,
    selected_cases,
    transformers_logits,
)
from tests.integrations.test_maxtext_convert import _differing, _json, _mapping, _tensors
from tests.support import REPO
from tests.support.maxtext_child import TOWERS
from tests.support.tolerances import assert_within

pytestmark = pytest.mark.slow

TO_MAXTEXT = os.path.join(REPO, "tests", "support", "maxtext_to_maxtext.py")


def to_maxtext_timeout(jobs: int) -> int:
    """Seconds for one to_maxtext.py process of ``jobs`` conversions: its import, then about
    35 s each on a loaded 2-core machine (a tiny model's conversion is mostly MaxText's fixed
    cost), with room to spare."""
    return CHILD_TIMEOUT + 60 * jobs


PROCESSES = 2  # to_maxtext.py processes at once: each converts on one core at a time


def run_to_maxtext(python, jobs, work, **options):
    """MaxText's own to_maxtext.py on each of ``jobs`` ({key: (case, hf_dir, scan)}), float32, on
    ``DEVICES`` simulated CPU devices (``options``: more of each job's keys or other values for
    them, ``tests/support/maxtext_to_maxtext.py``'s), the jobs
    dealt out to ``PROCESSES`` processes that run at once (the conversions are independent, and
    each process pays MaxText's import once): {key: (its base_output_directory, None or its
    error)}."""
    outs = {key: os.path.join(work, f"out{i}") for i, key in enumerate(jobs)}
    shares = [list(jobs)[k::PROCESSES] for k in range(PROCESSES)]
    started, start = [], time.perf_counter()
    for k, share in enumerate(s for s in shares if s):
        jobs_path, results_path = (os.path.join(work, f"{what}{k}.json") for what in ("jobs", "results"))
        with open(jobs_path, "w") as f:
            json.dump([dict(hf_dir=jobs[key][1], family=CASES[jobs[key][0]][0], out=outs[key], scan_layers=jobs[key][2],
                            save_dtype="float32", **{"simulated_cpu_devices_count": DEVICES, **options})
                       for key in share], f)
        process = subprocess.Popen([python, TO_MAXTEXT, jobs_path, results_path], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=_clean_env())
        started.append((share, results_path, process))
    found = {}
    for share, results_path, process in started:
        try:
            output, _ = process.communicate(timeout=max(1.0, to_maxtext_timeout(len(share)) -
                                                        (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        print(f"\nto_maxtext.py, {len(share)} conversions: {time.perf_counter() - start:.1f} s, exit {process.returncode}")
        results = _json(results_path) if os.path.exists(results_path) else {}
        lost = f"no result (exit {process.returncode}):\n{output[-4000:]}"
        found.update({key: (outs[key], results[outs[key]].get("traceback") if outs[key] in results else lost)
                      for key in share})
    return found


# to_maxtext.py itself stops with "Shape mismatch" where its stacking contradicts MaxText's tree.
REVERSE_KNOWN = {**{key: ("xfail", f"MaxText 0.2.5's to_maxtext.py cannot convert it: {sorted(leaves)} "
                               "(Shape mismatch)") for key, leaves in MAXTEXT_CONVERTER_BUGS.items()},
                 **{(case, v): ("skip", "MaxText 0.2.5 has no converter (to_maxtext.py) for it")
                    for case in NO_CONVERTER for v in VARIANTS},
                 # Its Gemma 3 converter reads the multimodal config (config["text_config"]): it
                 # stops with KeyError 'text_config' on a text-only Gemma3ForCausalLM checkpoint.
                 **{("gemma3", v): ("xfail", "MaxText 0.2.5's to_maxtext.py converts Gemma 3 only as the "
                                             "multimodal model (KeyError 'text_config' on a text-only one)")
                    for v in VARIANTS},
                 # Likewise its Qwen3.5 tables (QWEN3_5_MAXTEXT_TO_HF_PARAM_MAPPING reads
                 # config["text_config"], names model.language_model.…): the case is the text model.
                 **{("qwen3.5", v): ("xfail", "MaxText 0.2.5's to_maxtext.py converts Qwen3.5 only as the "
                                              "multimodal release (KeyError 'text_config' on a text-only one)")
                    for v in VARIANTS},
                 # QWEN3_VL_MAXTEXT_TO_HF_PARAM_MAPPING fuses the experts for unscanned layers only.
                 ("qwen3-vl-moe", "scan"): ("xfail", "MaxText 0.2.5's to_maxtext.py cannot convert a scanned "
                                                     "Qwen3-VL-MoE: " + MAXTEXT_CONVERTER_FAILS[("qwen3-vl-moe", "scan")]),
                 # Its DeepSeek tables name the router bias params-…-gate-bias; its model holds it in
                 # the MoEBiasVar collection, so to_maxtext.py stops ("missing keys: MoEBiasVar-…").
                 **{(case, v): ("xfail", "MaxText 0.2.5's to_maxtext.py cannot convert DeepSeek-V3 or V3.2: "
                                         "its tables miss the MoEBiasVar router bias")
                    for case in ("deepseek3", "deepseek3.2") for v in VARIANTS},
                 # DeepSeek-V2 has no router bias, but scanned, to_maxtext.py takes every key holding
                 # "MoeBlock" (DeepSeekMoeBlock_0's router and shared experts too) for an unscanned
                 # expert stack, stacks its layers at axis 0 and its hook cannot reshape them.
                 **{(case, "scan"): ("xfail", "MaxText 0.2.5's to_maxtext.py cannot convert a scanned DeepSeek: "
                                              "it stacks DeepSeekMoeBlock_0's router and shared experts as "
                                              "experts (cannot reshape)") for case in ("deepseek2", "deepseek2-236b")},
                 # MaxText's forward is not run here: its known forward bugs do not apply.
                 **{key: mark for key, mark in KNOWN.items() if key[0] not in MAXTEXT_FORWARD_BUGS}}


@pytest.fixture(scope="module")
def to_maxtext_outputs(request, maxtext_python, hf_checkpoints, tmp_path_factory):
    """to_maxtext.py's checkpoint of every (case, variant) the reverse test runs, or its error."""
    jobs = {(case, v): (case, hf_checkpoints[case][0], v == "scan") for case in selected_cases(
        request, "test_transformers_loads_our_reverse_of_to_maxtext", REVERSE_KNOWN)
            for v in VARIANTS if REVERSE_KNOWN.get((case, v), ("run",))[0] != "skip"}
    return run_to_maxtext(maxtext_python, jobs, str(tmp_path_factory.mktemp("to_maxtext")))


@pytest.mark.timeout(PIP_TIMEOUT + to_maxtext_timeout(2 * len(CASES)))  # a first run builds the venv, then converts all
@pytest.mark.parametrize(("case", "variant"), list(case_params(REVERSE_KNOWN)))
def test_transformers_loads_our_reverse_of_to_maxtext(to_maxtext_outputs, hf_checkpoints, tmp_path, case, variant):
    hf_dir, reference, atol = hf_checkpoints[case]
    out, error = to_maxtext_outputs[case, variant]
    if error is not None:
        pytest.fail(f"MaxText's to_maxtext.py failed:\n{error[-4000:]}")
    ost.convert(out, tmp_path / "hf", mapping=_mapping(case, hf_dir, variant == "scan"))
    shutil.copy(os.path.join(hf_dir, "config.json"), tmp_path / "hf")
    towers = TOWERS.get(CASES[case][0], ())  # MaxText's text model holds none of a multimodal release's towers
    expected = {name: t for name, t in _tensors(hf_dir).items() if not name.startswith(towers)}
    assert not _differing(_tensors(tmp_path / "hf"), expected)  # float32: exact
    logits, _, _ = transformers_logits(str(tmp_path / "hf"), TOKENS, case)
    assert_within(logits, reference, atol, err_msg=f"{case} {variant}")


class NoHandlerForLazyWeights(AssertionError):
    """to_maxtext.py failed to save because Orbax has no handler for its train state's leaves."""


@pytest.fixture(scope="module")
def one_device_to_maxtext(maxtext_python, hf_checkpoints, tmp_path_factory):
    """to_maxtext.py (its default ``lazy_load_tensors``) on one simulated CPU device, llama3.1 unscanned."""
    case = "llama3.1"
    return run_to_maxtext(maxtext_python, {case: (case, hf_checkpoints[case][0], False)},
                          str(tmp_path_factory.mktemp("to_maxtext_one_device")), simulated_cpu_devices_count=1)[case]


@pytest.mark.timeout(PIP_TIMEOUT + to_maxtext_timeout(1))
@pytest.mark.xfail(strict=True, raises=NoHandlerForLazyWeights,
                   reason="MaxText 0.2.5's to_maxtext.py promotes its lazily loaded weights to JAX arrays only when "
                          "simulated_cpu_devices_count > 1 (utils.save_weights_to_checkpoint); on one device they stay "
                          "host values, and orbax-checkpoint 0.12.8 has no handler for the TrainState holding them "
                          "(NoEntryError)")
def test_to_maxtext_saves_lazily_loaded_weights_on_one_device(one_device_to_maxtext):
    """The ``lazy_load_tensors=True`` save (to_maxtext.py's CLI default) that fails with orbax-checkpoint
    0.12.8: only with one simulated device, where the weights are not made JAX arrays; with its
    default 16, or the 4 of every other to_maxtext.py run here, it saves."""
    _, error = one_device_to_maxtext
    if error is not None and "NoEntryError" in error and "TrainState" in error:
        raise NoHandlerForLazyWeights(error.strip().splitlines()[-1][:400])
    assert error is None, error[-4000:]

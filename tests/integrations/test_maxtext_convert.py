"""``ost.convert`` with ``ost.mappings.maxtext`` against MaxText 0.2.5 itself.

The tiny models, the MaxText venv and the child are ``tests/families/test_maxtext_mapping.py``'s:

* **MaxText restores our conversion**: for every family, scanned and unscanned, ``ost.convert(hf_dir,
  dst, mapping=..., dtype="float32")`` writes MaxText's form and MaxText's own
  ``checkpointing.load_params_from_path(dst/0/items, ...)`` (what ``load_parameters_path`` does)
  restores it into its abstract sharded params (child ``--loader converted``): its forward gives
  transformers' logits, every tensor equals MaxText's own converter's, and ``ost.save`` through the
  mapping gives back the checkpoint's bytes. In bfloat16 (``--loader converted-bf16``, llama3.1): the
  converter's tensors rounded to bfloat16 exactly, and the logits of transformers run in float32 on
  the bfloat16-rounded weights (the checkpoint saved in bfloat16), within the float32 tolerance
  (``tests/support/tolerances.py``): the rounding of the weights is the only difference, and it is in the
  reference too. A bfloat16 checkpoint round trips HF -> MaxText form -> HF byte for byte.
* **2 processes = 1 process**: two ``jax.distributed`` processes convert HF -> MaxText form and back;
  the Orbax checkpoint holds the same arrays and metadata, the HF files are byte-identical. When one
  process fails (a source missing on its host, a read failing mid-conversion), the other fails
  promptly too and nothing is left at the destination.

The reverse of MaxText's own converter is ``tests/integrations/test_maxtext_reverse.py``.

    python -m pytest tests/integrations/test_maxtext_convert.py -m slow -s
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as ost
from tests.families.test_maxtext_mapping import (  # noqa: F401 -- maxtext_python, hf_checkpoints: fixtures
    CASES,
    CHILD_TIMEOUT,
    KNOWN,
    PIP_TIMEOUT,
    TOKENS,
    VARIANTS,
    assert_child_result,
    case_params,
    complete_child_run,
    hf_checkpoints,
    maxtext_python,
    selected_cases,
    transformers_logits,
    write_checkpoint,
)

pytestmark = pytest.mark.slow

BF16_CASE = "llama3.1"
_MODULE = "tests.integrations.test_maxtext_convert"


def _mapping(case, hf_dir, scan):
    with open(os.path.join(hf_dir, "config.json")) as f:
        return ost.mappings.maxtext(CASES[case][0], json.load(f), scan_layers=scan)


def _tensors(directory):
    """{name: (dtype, shape, bytes)} of every tensor of an HF directory."""
    import glob

    from safetensors.numpy import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update({n: (str(a.dtype), a.shape, a.tobytes()) for n, a in load_file(path).items()})
    return out


def _differing(ours, theirs):
    return sorted(set(ours) ^ set(theirs)) + sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])


def bf16_copy(hf_dir, directory):
    """The checkpoint at ``hf_dir`` saved again by transformers in bfloat16."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


# --- MaxText restores our conversion ---------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_results(request, maxtext_python, hf_checkpoints, tmp_path_factory):
    checkpoints = {case: hf_checkpoints[case]
                   for case in selected_cases(request, "test_maxtext_restores_our_conversion")}
    return complete_child_run(maxtext_python, checkpoints, str(tmp_path_factory.mktemp("child")), "converted")


@pytest.mark.timeout(PIP_TIMEOUT + CHILD_TIMEOUT)  # a first run builds the venv
@pytest.mark.parametrize(("case", "variant"), list(case_params(KNOWN)))
def test_maxtext_restores_our_conversion(converted_results, case, variant):
    assert_child_result(converted_results, case, variant)


@pytest.fixture(scope="module")
def bf16_checkpoint(hf_checkpoints, tmp_path_factory):
    """(float32 hf_dir, its bfloat16 copy, transformers' float32 logits on the bfloat16 weights, atol)."""
    hf_dir = hf_checkpoints[BF16_CASE][0]
    bf16_dir = bf16_copy(hf_dir, str(tmp_path_factory.mktemp("bf16") / BF16_CASE))
    logits, atol, _ = transformers_logits(bf16_dir, TOKENS, BF16_CASE)
    return hf_dir, bf16_dir, logits, atol


@pytest.fixture(scope="module")
def converted_bf16_results(maxtext_python, bf16_checkpoint, tmp_path_factory):
    hf_dir, _, logits, atol = bf16_checkpoint
    return complete_child_run(maxtext_python, {BF16_CASE: (hf_dir, logits, atol)},
                              str(tmp_path_factory.mktemp("child")), "converted-bf16")


@pytest.mark.timeout(PIP_TIMEOUT + CHILD_TIMEOUT)
@pytest.mark.parametrize("variant", VARIANTS)
def test_maxtext_restores_our_bfloat16_conversion(converted_bf16_results, variant):
    assert_child_result(converted_bf16_results, BF16_CASE, variant, round_trip=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_round_trips_through_maxtexts_form_byte_for_byte(bf16_checkpoint, tmp_path, variant):
    _, bf16_dir, _, _ = bf16_checkpoint
    mapping = _mapping(BF16_CASE, bf16_dir, variant == "scan")
    ost.convert(bf16_dir, tmp_path / "maxtext", mapping=mapping, dtype="bfloat16")
    ost.convert(tmp_path / "maxtext", tmp_path / "hf", mapping=mapping)
    assert not _differing(_tensors(tmp_path / "hf"), _tensors(bf16_dir))


# --- 2 processes = 1 process -----------------------------------------------------------------------

# Stacked layers and experts (MoE); plain; hybrid attention (linear-attention layers scanned inside
# blocks of full-attention ones, experts and a shared expert).
MULTIPROCESS_CASES = [("qwen3-moe", "scan"), ("llama3.1", "unscan"), ("qwen3-next", "scan")]


def _child_convert(args):
    """Every process converts with the same arguments (but ``args["src_on"]``: per process)."""
    src = args.get("src_on", {}).get(str(jax.process_index()), args["src"])
    with open(os.path.join(args["hf_dir"], "config.json")) as f:
        mapping = ost.mappings.maxtext(args["family"], json.load(f), scan_layers=args["scan"])
    start = time.perf_counter()
    try:
        ost.convert(src, args["dst"], mapping=mapping, dtype=args.get("dtype"))
    except Exception as e:  # noqa: BLE001 -- reported: the test wants every process's outcome
        return {"error": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def _orbax_arrays(path):
    """{key path: numpy array} of everything in MaxText's form at ``path``, restored by Orbax."""
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(path, "0", "items"))
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(restored)[0]}


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize(("case", "variant"), MULTIPROCESS_CASES, ids=[f"{c}-{v}" for c, v in MULTIPROCESS_CASES])
def test_two_processes_convert_as_one_does(multiprocess, tmp_path, case, variant):
    hf_dir = write_checkpoint(case, str(tmp_path / "hf"))
    args = {"hf_dir": hf_dir, "family": CASES[case][0], "scan": variant == "scan", "dtype": "float32"}
    mapping = _mapping(case, hf_dir, args["scan"])
    ost.convert(hf_dir, tmp_path / "mt1", mapping=mapping, dtype="float32")
    ost.convert(tmp_path / "mt1", tmp_path / "hf1", mapping=mapping)

    results = multiprocess(f"{_MODULE}:_child_convert", num_processes=2, devices_per_process=2,
                           args={**args, "src": hf_dir, "dst": str(tmp_path / "mt2")})
    assert [r.value["error"] for r in results] == [None, None], [r.value for r in results]
    ours, one = _orbax_arrays(tmp_path / "mt2"), _orbax_arrays(tmp_path / "mt1")
    assert sorted(ours) == sorted(one)
    for name in one:
        assert ours[name].dtype == one[name].dtype and np.array_equal(ours[name], one[name]), name
    assert _json(tmp_path / "mt2" / "0" / "items" / "_METADATA") == _json(tmp_path / "mt1" / "0" / "items" / "_METADATA")

    results = multiprocess(f"{_MODULE}:_child_convert", num_processes=2, devices_per_process=2,
                           args={**args, "src": str(tmp_path / "mt1"), "dst": str(tmp_path / "hf2"), "dtype": None})
    assert [r.value["error"] for r in results] == [None, None], [r.value for r in results]
    names = sorted(os.listdir(tmp_path / "hf1"))
    assert sorted(os.listdir(tmp_path / "hf2")) == names
    for name in names:
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf1" / name).read_bytes(), name


def _child_convert_with_a_read_failing_on_process_1(args):
    """Process 1's reads of tensor data fail with EIO (its headers read fine): mid-conversion."""
    import errno

    from orbax_safetensors.storage.local import LocalSnapshot

    if jax.process_index() == 1:
        def failing(self, path, offset, buffers):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        LocalSnapshot.read_scatter = failing  # a checkpoint is read through its snapshot
    return _child_convert(args)


@pytest.mark.parametrize("failure", ["missing-source", "read-error"])
def test_a_process_failing_mid_conversion_fails_its_peer_promptly_and_leaves_nothing(
        multiprocess, tmp_path, failure):
    case = "qwen3-moe"
    hf_dir = write_checkpoint(case, str(tmp_path / "hf"))
    dst = tmp_path / "out" / "maxtext"
    args = {"hf_dir": hf_dir, "family": CASES[case][0], "scan": True, "dtype": "float32", "src": hf_dir,
            "dst": str(dst)}
    target = f"{_MODULE}:_child_convert"
    if failure == "missing-source":
        args["src_on"] = {"1": str(tmp_path / "not-here")}
    else:
        target = f"{_MODULE}:_child_convert_with_a_read_failing_on_process_1"
    results = [r.value for r in multiprocess(target, num_processes=2, devices_per_process=2, args=args, timeout=60)]
    print(results)
    assert all(r["error"] for r in results), results
    assert all(r["seconds"] < 30 for r in results), results  # the peer did not wait for a timeout
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # no staging left either

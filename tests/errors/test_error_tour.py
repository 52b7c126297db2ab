"""A tour of errors: the bad inputs a newcomer hits through the public API, each refused with
one line that names what is wrong and what to do (``ost.Error``, the file where there is one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost

TREE = {"a": np.zeros((4, 3), np.float32)}


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


def _llama_tensors(layers: int) -> dict[str, np.ndarray]:
    """A Llama-shaped checkpoint's tensors (hidden 16, 2 KV heads of 4 query heads, vocab 64)."""
    tensors = {"model.embed_tokens.weight": _zeros(64, 16), "lm_head.weight": _zeros(64, 16),
               "model.norm.weight": _zeros(16)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        tensors.update({
            f"{layer}.input_layernorm.weight": _zeros(16),
            f"{layer}.post_attention_layernorm.weight": _zeros(16),
            f"{layer}.self_attn.q_proj.weight": _zeros(16, 16),
            f"{layer}.self_attn.k_proj.weight": _zeros(8, 16),
            f"{layer}.self_attn.v_proj.weight": _zeros(8, 16),
            f"{layer}.self_attn.o_proj.weight": _zeros(16, 16),
            f"{layer}.mlp.gate_proj.weight": _zeros(32, 16),
            f"{layer}.mlp.up_proj.weight": _zeros(32, 16),
            f"{layer}.mlp.down_proj.weight": _zeros(16, 32),
        })
    return tensors


def _orbax_item(directory: Path) -> Path:
    """What ``ocp.StandardCheckpointer().save`` writes, by name (the engine looks at names only)."""
    directory.mkdir(parents=True)
    for name in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt"):
        (directory / name).write_bytes(b"{}")
    (directory / "ocdbt.process_0").mkdir()
    (directory / "d").mkdir()
    return directory


def _truncate(path: Path, by: int = 100) -> int:
    data = path.read_bytes()
    path.write_bytes(data[:-by])
    return len(data)


LIMIT = 300  # characters a message may take, besides the paths the caller gave


def _one_line(error: BaseException, tmp: Path | None = None) -> str:
    message = str(error)
    assert isinstance(error, ost.Error), repr(error)
    assert "\n" not in message, message
    own = message.replace(str(tmp), "") if tmp is not None else message
    assert len(own) < LIMIT, (len(own), message)
    return message


# --- a mapping without its config ----------------------------------------------------------


def test_a_family_mapping_without_config_says_to_pass_it_once(tmp_path):
    ost.save(tmp_path / "c", _llama_tensors(layers=2))
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(tmp_path / "c", mapping=ost.mappings.llama())
    message = _one_line(raised.value)
    assert "ost.mappings.llama() needs the model's config to split heads (heads, kv_heads, head_dim)" in message
    assert "pass it, ost.mappings.llama(config)" in message
    assert "in 8 tensors, e.g. model.layers_0.self_attn." in message  # q, k, v, o of 2 layers
    assert message.count("needs the model's config") == 1
    assert "strict=" not in message  # no target: nothing strict= could change


def test_deepseek_without_config_names_its_own_head_sizes(tmp_path):
    hf_families = pytest.importorskip("tests.support.hf_families")
    pytest.importorskip("transformers")
    hf_families.tiny_model("deepseek_v3", str(tmp_path / "c"), dtype="bfloat16")
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(tmp_path / "c", mapping=ost.mappings.deepseek_v3())
    message = _one_line(raised.value)
    assert ("ost.mappings.deepseek_v3() needs the model's config to split heads "
            "(heads, qk_head_dim, kv_head_dim, v_head_dim): pass it, ost.mappings.deepseek_v3(config)"
            in message)


def test_a_mapped_target_that_does_not_fit_still_offers_strict(tmp_path):
    ost.save(tmp_path / "c", _llama_tensors(layers=1))
    target = {"model": {"norm": {"scale": _zeros(16)}}}
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(tmp_path / "c", target, mapping=ost.mappings.llama())
    assert str(raised.value).startswith('target does not map to the checkpoint (pass strict="target"')


def test_the_config_loads_what_its_absence_refused(tmp_path):
    ost.save(tmp_path / "c", _llama_tensors(layers=1))
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16}
    loaded = ost.load(tmp_path / "c", mapping=ost.mappings.llama(config))
    assert loaded["model.layers_0.self_attn.k_proj.kernel"].shape == (16, 2, 4)


# --- a truncated file ----------------------------------------------------------------------


def test_a_truncated_file_is_called_truncated_by_load_and_verify(tmp_path):
    path = tmp_path / "model.safetensors"
    ost.save(path, {"a": np.zeros((100, 10), np.float32)})
    size = _truncate(path)
    expected = (f"is truncated: it has {size - 100} bytes, its header needs {size} "
                "(an interrupted download or copy? fetch it again)")
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path)
    assert expected in _one_line(raised.value) and str(path) in str(raised.value)
    for where in (path, tmp_path):
        report = ost.verify(where)
        assert [(p.file, p.message) for p in report.problems] == [(str(path), expected)]


def test_a_file_cut_inside_its_header_is_truncated_too(tmp_path):
    path = tmp_path / "model.safetensors"
    ost.save(path, TREE)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ost.SafetensorsError, match="is truncated: it has 20 bytes, its header needs"):
        ost.load(path)


# --- an Orbax checkpoint -------------------------------------------------------------------


def _convert_hint(path: Path) -> str:
    return (f"is an Orbax checkpoint, not safetensors: convert it with `orbax-safetensors convert "
            f"{path} <dst>` (ost.convert)")


@pytest.mark.parametrize("where", ["item", "step", "root"])
def test_an_orbax_checkpoint_is_named_with_its_conversion(tmp_path, where):
    _orbax_item(tmp_path / "root" / "3" / "default")
    (tmp_path / "root" / "3" / "_CHECKPOINT_METADATA").unlink(missing_ok=True)
    path = {"item": tmp_path / "root" / "3" / "default", "step": tmp_path / "root" / "3",
            "root": tmp_path / "root"}[where]
    for call in (ost.load, ost.metadata):
        with pytest.raises(ost.SafetensorsError) as raised:
            call(path)
        assert _convert_hint(path) in _one_line(raised.value)
    assert [p.message for p in ost.verify(path).problems] == [_convert_hint(path)]


def test_what_orbax_writes_is_recognised(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "item", TREE)
    checkpointer.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "managed") as manager:
        manager.save(0, args=ocp.args.StandardSave(TREE))
        manager.wait_until_finished()
    for path in (tmp_path / "item", tmp_path / "managed", tmp_path / "managed" / "0"):
        with pytest.raises(ost.SafetensorsError, match="is an Orbax checkpoint, not safetensors"):
            ost.load(path)


def test_a_directory_of_other_files_is_not_taken_for_orbax(tmp_path):
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(ost.SafetensorsError, match="no model.safetensors.index.json") as raised:
        ost.load(tmp_path / "other")
    assert "Orbax" not in str(raised.value)


# --- the tour ------------------------------------------------------------------------------


def _missing(tmp: Path):
    return lambda: ost.load(tmp / "nowhere"), ["nowhere", "does not exist", "check the path"]


def _file_for_directory(tmp: Path):
    (tmp / "weights.bin").write_bytes(b"x" * 16)
    return lambda: ost.load(tmp / "weights.bin"), ["weights.bin", "not a checkpoint directory", "pass"]


def _fifo_for_shard(tmp: Path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    (tmp / "c").mkdir()
    ost.save(tmp / "c" / "model-00001-of-00002.safetensors", TREE)
    os.mkfifo(tmp / "c" / "model-00002-of-00002.safetensors")
    return lambda: ost.load(tmp / "c"), ["model-00002-of-00002.safetensors", "FIFO"]


def _truncated(tmp: Path):
    ost.save(tmp / "model.safetensors", TREE)
    _truncate(tmp / "model.safetensors", 8)
    return lambda: ost.load(tmp / "model.safetensors"), ["model.safetensors", "truncated", "fetch it again"]


def _half_a_shard_set(tmp: Path):
    (tmp / "c").mkdir()
    ost.save(tmp / "c" / "model-00001-of-00002.safetensors", TREE)
    return lambda: ost.load(tmp / "c"), ["model-00002-of-00002.safetensors", "fetch the missing shards"]


def _orbax_to_load(tmp: Path):
    _orbax_item(tmp / "orbax")
    return lambda: ost.load(tmp / "orbax"), ["orbax", "convert", "ost.convert"]


def _orbax_to_metadata(tmp: Path):
    _orbax_item(tmp / "orbax")
    return lambda: ost.metadata(tmp / "orbax"), ["orbax", "convert", "ost.convert"]


def _mapping_without_config(tmp: Path):
    ost.save(tmp / "c", _llama_tensors(layers=12))
    return (lambda: ost.load(tmp / "c", mapping=ost.mappings.llama()),
            ["ost.mappings.llama(config)", "pass", "in 48 tensors"])


def _target_shape_differs(tmp: Path):
    ost.save(tmp / "c", TREE)
    return (lambda: ost.load(tmp / "c", {"a": np.zeros((4, 4), np.float32)}),
            ["checkpoint (4, 3), target (4, 4)", "pass", "strict=False"])


def _bad_casting(tmp: Path):
    return lambda: ost.LoadOptions(casting="wrong"), ["casting", "same_kind", "'wrong'"]


def _max_shard_size_on_a_file(tmp: Path):
    return (lambda: ost.save(tmp / "m.safetensors", TREE, max_shard_size=100),
            ["m.safetensors", "save to a directory", "drop max_shard_size"])


def _save_over_a_checkpoint(tmp: Path):
    ost.save(tmp / "c", TREE)
    return lambda: ost.save(tmp / "c", TREE), ["already holds a checkpoint", "overwrite=True"]


def _bare_array(tmp: Path):
    return lambda: ost.save(tmp / "c", np.zeros(3)), ["bare array", "put it in a dict"]


def _config_of_a_string(tmp: Path):
    return lambda: ost.save(tmp / "c", TREE, config="x"), ["config=", "a dict", "not str"]


def _empty_file(tmp: Path):
    (tmp / "model.safetensors").write_bytes(b"")
    return lambda: ost.load(tmp / "model.safetensors"), ["model.safetensors", "is 0 bytes", "fetch it again"]


def _orbax_step_to_metadata(tmp: Path):
    _orbax_item(tmp / "run" / "100" / "items")
    return lambda: ost.metadata(tmp / "run"), ["run", "is an Orbax checkpoint", "orbax-safetensors convert"]


def _mapping_by_name(tmp: Path):
    ost.save(tmp / "c", TREE)
    return lambda: ost.load(tmp / "c", mapping="llama"), ["mapping=", "ost.mappings.llama(config)", "not str"]


def _misspelt_dtype(tmp: Path):
    return lambda: ost.mappings.llama(dtype="flaot32"), ["'flaot32' is not a dtype", "'float32'"]


def _convert_misspelt_dtype(tmp: Path):
    ost.save(tmp / "c", TREE)
    return (lambda: ost.convert(tmp / "c", tmp / "o", mapping=ost.Mapping([ost.Rule("a", "b")]),
                                dtype="flaot32"),
            ["dtype='flaot32'", "float32 or bfloat16", "pass one of them"])


def _convert_missing_source(tmp: Path):
    return lambda: ost.convert(tmp / "nowhere", tmp / "o"), ["nowhere", "does not exist", "check the path"]


def _unknown_family(tmp: Path):
    return lambda: ost.mappings.by_name("lama", {}), ["no shipped mapping 'lama'", "choose", "llama"]


def _unknown_strict(tmp: Path):
    ost.save(tmp / "c", TREE)
    return lambda: ost.load(tmp / "c", TREE, strict="loose"), ["strict", '"target"', "'loose'"]


TOUR: dict[str, Callable[[Path], tuple[Callable[[], object], list[str]]]] = {
    "missing path": _missing,
    "file where a directory is expected": _file_for_directory,
    "FIFO where a shard belongs": _fifo_for_shard,
    "truncated file": _truncated,
    "half a shard set without index": _half_a_shard_set,
    "Orbax checkpoint to load": _orbax_to_load,
    "Orbax checkpoint to metadata": _orbax_to_metadata,
    "mapping without config": _mapping_without_config,
    "target of another shape": _target_shape_differs,
    "unknown casting": _bad_casting,
    "max_shard_size on a file": _max_shard_size_on_a_file,
    "save over a checkpoint": _save_over_a_checkpoint,
    "bare array as the tree": _bare_array,
    "convert to a misspelt dtype": _convert_misspelt_dtype,
    "convert a missing source": _convert_missing_source,
    "config of the wrong type": _config_of_a_string,
    "empty file": _empty_file,
    "Orbax root to metadata": _orbax_step_to_metadata,
    "mapping by name": _mapping_by_name,
    "misspelt dtype": _misspelt_dtype,
    "unknown model family": _unknown_family,
    "unknown strict": _unknown_strict,
}


@pytest.mark.parametrize("case", list(TOUR))
def test_tour_of_errors(tmp_path, case):
    call, words = TOUR[case](tmp_path)
    with pytest.raises(ost.Error) as raised:
        call()
    message = _one_line(raised.value, tmp_path)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# --- the tour, on the command line ---------------------------------------------------------


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp)


def _llama_with_config(tmp: Path, config: dict) -> str:
    ost.save(tmp / "hf", _llama_tensors(layers=1))
    (tmp / "hf" / "config.json").write_text(json.dumps(config))
    return str(tmp / "hf")


# Each: (arguments, given the test's directory; words the one line on stderr must hold).
CLI_TOUR: dict[str, Callable[[Path], tuple[list[str], list[str]]]] = {
    "inspect a missing path": lambda tmp: (["inspect", "nowhere"], ["'nowhere'", "does not exist", "check the path"]),
    "inspect a file for a directory": lambda tmp: (
        (tmp / "w.bin").write_bytes(b"x" * 16) and ["inspect", "w.bin"], ["w.bin", "not a checkpoint directory"]),
    "inspect a truncated file": lambda tmp: (
        (ost.save(tmp / "m.safetensors", TREE), _truncate(tmp / "m.safetensors", 8))
        and ["inspect", "m.safetensors"], ["m.safetensors", "is truncated", "fetch it again"]),
    "inspect an Orbax checkpoint": lambda tmp: (
        _orbax_item(tmp / "o") and ["inspect", "o"], ["orbax-safetensors convert o <dst>", "ost.convert"]),
    "convert --dtype float64": lambda tmp: (
        ["convert", "a", "b", "--mapping", "llama", "--dtype", "float64"],
        ["--dtype", "'float64'", "float32", "bfloat16", "--help"]),
    "convert an unknown model family": lambda tmp: (
        ["convert", _llama_with_config(tmp, {"model_type": "llama"}), "out", "--mapping", "lama"],
        ["no shipped mapping 'lama'", "llama"]),
    "convert with no config for the mapping": lambda tmp: (
        ost.save(tmp / "hf", TREE) and ["convert", str(tmp / "hf"), "out", "--mapping", "llama"],
        ["--mapping llama needs the model's Hugging Face config", "--hf-config"]),
    "convert a missing source": lambda tmp: (["convert", "nowhere", "out"], ["'nowhere'", "does not exist"]),
    "convert over a checkpoint": lambda tmp: (
        (ost.save(tmp / "a", TREE), ost.save(tmp / "b", TREE)) and ["convert", "a", "b"],
        ["already exists", "--overwrite"]),
    "an unknown command": lambda tmp: (["inspcet", "x"], ["invalid choice: 'inspcet'", "--help"]),
}


@pytest.mark.parametrize("case", list(CLI_TOUR))
def test_tour_of_errors_on_the_command_line(tmp_path, case):
    args, words = CLI_TOUR[case](tmp_path)
    result = _run(tmp_path, *args)
    assert result.returncode != 0 and result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    line = result.stderr.rstrip("\n")
    assert len(line.replace(str(tmp_path), "")) < LIMIT, line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.parametrize("case", ["truncated", "Orbax"])
def test_verify_on_the_command_line_names_the_problem(tmp_path, case):
    if case == "truncated":
        ost.save(tmp_path / "c", TREE)
        _truncate(tmp_path / "c" / "model.safetensors", 8)
        expected = f"file {str(tmp_path / 'c' / 'model.safetensors')!r}: is truncated: it has "
    else:
        _orbax_item(tmp_path / "c")
        expected = "file 'c': is an Orbax checkpoint, not safetensors: convert it with `orbax-safetensors convert c <dst>`"
    result = _run(tmp_path, "verify", "c")
    assert result.returncode == 1 and result.stderr == ""
    assert result.stdout.splitlines()[0].startswith(expected), result.stdout

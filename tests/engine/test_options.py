"""Options are checked when they are built, each error naming its option: a value out of range
used to fail deep inside a load ("size must be positive"), or to be taken (``threads=0``,
``max_gap=-5``; a 1-byte ``chunk_bytes`` made a 6 MB load take a minute)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import numpy as np
import pytest

import orbax_safetensors as ost


@pytest.mark.parametrize("options, message", [
    ({"chunk_bytes": 0}, r"LoadOptions.chunk_bytes: size must be positive, got 0"),
    ({"chunk_bytes": 1}, r"LoadOptions.chunk_bytes must be at least 4096 bytes \(each chunk is one "),
    ({"chunk_bytes": "1KB"}, r"LoadOptions.chunk_bytes must be at least 4096 bytes"),
    ({"memory_budget": 0}, r"LoadOptions.memory_budget: size must be positive"),
    ({"memory_budget": "lots"}, r"LoadOptions.memory_budget: invalid size 'lots'"),
    ({"threads": 0}, r"LoadOptions.threads must be at least 1, got 0"),
    ({"threads": -1}, r"LoadOptions.threads must be at least 1, got -1"),
    ({"threads": 1.5}, r"LoadOptions.threads must be an int, not 1.5"),
    ({"threads": True}, r"LoadOptions.threads must be an int, not True"),
    ({"max_gap": -5}, r"LoadOptions.max_gap must be at least 0, got -5"),
    ({"max_gap": "16KB"}, r"LoadOptions.max_gap must be an int"),
    ({"max_overread": 0.5}, r"LoadOptions.max_overread must be at least 1.0, got 0.5"),
    ({"max_overread": float("nan")}, r"LoadOptions.max_overread must be at least 1.0"),
    ({"verify_checksums": "no"}, r"LoadOptions.verify_checksums must be True or False, not 'no'"),
    ({"reshard_thin_shards": 1}, r"LoadOptions.reshard_thin_shards must be True or False"),
])
def test_load_options_are_checked_when_built_naming_the_option(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ost.LoadOptions(**options)


def test_load_options_store_sizes_as_ints_and_keep_what_they_accept(tmp_path):
    options = ost.LoadOptions(memory_budget="2GB", chunk_bytes="4KiB", max_gap=0, threads=np.int64(2),
                              max_overread=1)
    assert (options.memory_budget, options.chunk_bytes, options.threads) == (2 * 10**9, 4096, 2)
    assert ost.LoadOptions() == ost.LoadOptions(memory_budget=10**9)
    ost.save(tmp_path / "c", {"w": np.arange(6000, dtype=np.float32)})
    stats = ost.LoadStats()
    loaded = ost.load(tmp_path / "c", options=options, stats=stats)
    np.testing.assert_array_equal(loaded["w"], np.arange(6000, dtype=np.float32))
    assert stats.requests == 6  # 24000 bytes in 4 KiB chunks


@pytest.mark.parametrize("call", ["consolidate", "convert"])
@pytest.mark.parametrize("kwargs, message", [
    ({"block_bytes": 0}, "block_bytes: size must be positive, got 0"),
    ({"max_shard_size": "5 lots"}, "max_shard_size: invalid size '5 lots'"),
    ({"overwrite": "yes"}, "overwrite must be True or False, not 'yes'"),
])
def test_consolidate_and_convert_options_are_checked_before_anything_is_read(tmp_path, call, kwargs,
                                                                             message):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(ost, call)(tmp_path / "nothing here", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- one shape: options= or keywords
# Every entry point takes its options as one value (options=) or as that value's fields given as
# keywords, resolved at the entry by one function; a keyword replaces that field of options=.

def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _tree():
    rng = np.random.default_rng(0)
    return {f"layer{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(6)}


def test_save_and_async_save_keywords_are_their_options(tmp_path):
    tree = _tree()
    keywords = dict(max_shard_size=20_000, metadata={"step": "3"}, checksums=False, memory_budget="2MB")
    ost.save(tmp_path / "keywords", tree, **keywords)
    ost.save(tmp_path / "options", tree, options=ost.SaveOptions(**keywords))
    ost.async_save(tmp_path / "async-keywords", tree, **keywords).result()
    ost.async_save(tmp_path / "async-options", tree, options=ost.SaveOptions(**keywords)).result()
    expected = _files(tmp_path / "keywords")
    assert len(expected) > 2  # sharded under the index: the size was taken
    for other in ("options", "async-keywords", "async-options"):
        assert _files(tmp_path / other) == expected, other


def test_load_and_async_load_keywords_are_their_options(tmp_path):
    tree = _tree()
    ost.save(tmp_path / "c", tree)
    target = {"layer0": {"w": np.zeros((64, 32), np.float64)}}
    keywords = dict(strict="target", memory_budget="1MB", chunk_bytes="4KiB", threads=2)
    results, requests = [], []
    for call, how in [(ost.load, "keywords"), (ost.load, "options"),
                      (ost.async_load, "keywords"), (ost.async_load, "options")]:
        stats = ost.LoadStats()
        given = keywords if how == "keywords" else {"options": ost.LoadOptions(**keywords)}
        result = call(tmp_path / "c", target, stats=stats, **given)
        results.append(result if call is ost.load else result.result())
        requests.append(stats.requests)
    for result in results:
        np.testing.assert_array_equal(result["layer0"]["w"], tree["layer0.w"])
    assert len(set(requests)) == 1 and requests[0] == 64 * 32 * 4 // 4096  # 4 KiB chunks every time


def test_consolidate_keywords_are_its_options(tmp_path):
    ost.save(tmp_path / "d", _tree(), layout="distributed")
    ost.consolidate(tmp_path / "d", tmp_path / "keywords", max_shard_size=20_000, block_bytes="4KB")
    ost.consolidate(tmp_path / "d", tmp_path / "options",
                    options=ost.ConsolidateOptions(max_shard_size=20_000, block_bytes="4KB"))
    assert len(_files(tmp_path / "keywords")) > 2
    assert _files(tmp_path / "keywords") == _files(tmp_path / "options")


def test_convert_keywords_are_its_options(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    ost.save(tmp_path / "st", _tree())
    ost.convert(tmp_path / "st", tmp_path / "orbax")
    ost.convert(tmp_path / "orbax", tmp_path / "keywords", max_shard_size=20_000, memory_budget="64KB")
    ost.convert(tmp_path / "orbax", tmp_path / "options",
                options=ost.ConvertOptions(max_shard_size=20_000, memory_budget="64KB"))
    assert len(_files(tmp_path / "keywords")) > 2
    assert _files(tmp_path / "keywords") == _files(tmp_path / "options")
    loaded = ost.load(tmp_path / "options")
    for name, value in _tree().items():
        np.testing.assert_array_equal(loaded[name], value)


def test_a_keyword_replaces_that_field_of_the_options_and_keeps_the_others(tmp_path):
    tree = _tree()
    options = ost.SaveOptions(max_shard_size=10**9, metadata={"run": "a"}, checksums=False)
    ost.save(tmp_path / "c", tree, options=options, max_shard_size=20_000)
    written = ost.metadata(tmp_path / "c")
    assert len(set(f for files in written.files.values() for f in files)) > 1  # the keyword's size
    assert written.metadata["run"] == "a"  # the options' other fields stand
    assert "crc32c.blocks" not in str(written.metadata)

    ost.save(tmp_path / "small", {"w": np.zeros(3, np.float32)})
    with pytest.raises(ost.MissingTensorError):  # options= strict, as given
        ost.load(tmp_path / "small", {"w": np.zeros(3), "x": np.zeros(1)}, options=ost.LoadOptions())
    with pytest.warns(ost.SkippedLeavesWarning):  # the keyword over it
        loaded = ost.load(tmp_path / "small", {"w": np.zeros(3), "x": np.zeros(1)},
                          options=ost.LoadOptions(threads=1), strict=False)
    assert loaded["w"].dtype == np.float64


def test_a_keyword_over_options_rederives_what_depends_on_it(tmp_path):
    """What a field derives from another follows a keyword given over ``options=``: the
    config.json a save writes drops ``quantization_config`` through a dequantizing mapping,
    and a conversion's block size follows its memory budget."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16,
              "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 1, "vocab_size": 8, "head_dim": 8,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    plain = ost.SaveOptions(config=config)
    assert b"quantization_config" in plain.config_json
    dequantizing = ost.mappings.llama(config)
    assert dequantizing.quantization is not None
    from orbax_safetensors.engine.core.options import with_shorthand
    assert b"quantization_config" not in with_shorthand(
        ost.SaveOptions, plain, {"mapping": dequantizing}).config_json
    pytest.importorskip("orbax.checkpoint")
    default = ost.ConvertOptions()
    assert default.unit_bytes == 10**9 // 32  # a 32nd of the budget, under 64 MB
    assert with_shorthand(ost.ConvertOptions, default, {"memory_budget": "32MB"}).unit_bytes == 10**6


CALLS = {
    "save": lambda p, **kw: ost.save(p / "c", {"w": np.zeros(3)}, **kw),
    "async_save": lambda p, **kw: ost.async_save(p / "c", {"w": np.zeros(3)}, **kw),
    "load": lambda p, **kw: ost.load(p / "nothing", **kw),
    "async_load": lambda p, **kw: ost.async_load(p / "nothing", **kw),
    "consolidate": lambda p, **kw: ost.consolidate(p / "nothing", p / "out", **kw),
    "convert": lambda p, **kw: ost.convert(p / "nothing", p / "out", **kw),
}
OPTIONS = {"save": "SaveOptions", "async_save": "SaveOptions", "load": "LoadOptions",
           "async_load": "LoadOptions", "consolidate": "ConsolidateOptions", "convert": "ConvertOptions"}


@pytest.mark.parametrize("call", CALLS)
def test_an_unknown_keyword_is_named_with_the_ones_there_are(tmp_path, call):
    with pytest.raises(ost.ArgumentTypeError) as raised:
        CALLS[call](tmp_path, max_shard=10, progress=False)
    message = str(raised.value)
    assert "unexpected keyword argument 'max_shard':" in message and "'progress'" not in message
    options = getattr(ost, OPTIONS[call])
    assert all(f.name in message for f in dataclasses.fields(options) if f.init)
    assert isinstance(raised.value, TypeError)
    assert not (tmp_path / "c").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("call", CALLS)
def test_options_of_another_operation_are_refused(tmp_path, call):
    other = ost.ConsolidateOptions() if OPTIONS[call] != "ConsolidateOptions" else ost.SaveOptions()
    with pytest.raises(ost.ArgumentTypeError, match=f"options= takes an ost.{OPTIONS[call]}, not"):
        CALLS[call](tmp_path, options=other)


@pytest.mark.parametrize("keywords, options", [
    ("SaveKeywords", "SaveOptions"), ("LoadKeywords", "LoadOptions"),
    ("ConsolidateKeywords", "ConsolidateOptions"), ("ConvertKeywords", "ConvertOptions")])
def test_each_operations_keywords_are_its_options_fields(keywords, options):
    """The keywords are declared once per operation (a ``TypedDict`` for both twins'
    ``**shorthand``, so that type checkers see them); they must be the options' fields."""
    pytest.importorskip("orbax.checkpoint")
    from orbax_safetensors.engine.loading import options as load_options
    from orbax_safetensors.engine.saving import options as save_options
    from orbax_safetensors.integrations import orbax_convert

    declared = next(getattr(m, keywords) for m in (load_options, save_options, orbax_convert)
                    if hasattr(m, keywords))
    fields = {f.name for f in dataclasses.fields(getattr(ost, options)) if f.init}
    assert set(typing.get_type_hints(declared)) == fields
    for call, kind in OPTIONS.items():
        if kind == options:
            parameters = inspect.signature(getattr(ost, call)).parameters
            assert str(parameters["shorthand"].annotation) == f"Unpack[{keywords}]", call
            assert parameters["options"].annotation == f"{options} | None", call


def test_async_save_bounds_its_transfers_off_accelerators(tmp_path, monkeypatch):
    """``async_save`` copies every accelerator shard before it returns; its ``memory_budget``
    bounds the transfers under way at once. CPU arrays stand in for HBM shards
    (``host_shards.on_accelerator`` says yes for them), as in ``test_device_copies``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from orbax_safetensors.engine.saving import host_shards

    monkeypatch.setattr(host_shards, "on_accelerator", lambda data: isinstance(data, jax.Array))
    tree = _tree()
    mesh = jax.make_mesh((8,), ("x",))
    arrays = {n: jax.device_put(x, NamedSharding(mesh, P("x"))) for n, x in tree.items()}
    shard = 64 * 32 * 4 // 8
    peaks = {}
    for budget in (1, 3 * shard, "1GB"):
        stats = ost.async_save(tmp_path / str(budget), arrays, memory_budget=budget).result()
        peaks[budget] = stats.copied_peak
        loaded = ost.load(tmp_path / str(budget))
        for name, value in tree.items():
            np.testing.assert_array_equal(loaded[name], value)
    assert peaks[1] == shard  # one at a time: a shard bigger than the budget goes alone
    assert 2 * shard <= peaks[3 * shard] <= 3 * shard
    assert peaks["1GB"] == 6 * 8 * shard  # all at once where all fit
    with pytest.raises(ValueError, match="memory_budget: size must be positive"):
        ost.async_save(tmp_path / "bad", arrays, memory_budget=0)


def test_sizes_reach_the_write_plan_as_ints(tmp_path, monkeypatch):
    """Sizes are parsed where the call is made, once; the planner takes bytes."""
    from orbax_safetensors.engine.saving import save as save_module
    from orbax_safetensors.engine.streams import consolidate as consolidate_module

    seen = []
    for module in (save_module, consolidate_module):
        real = module.plan_hf_checkpoint

        def spy(specs, *, max_shard_size, real=real, **kwargs):
            seen.append(max_shard_size)
            return real(specs, max_shard_size=max_shard_size, **kwargs)

        monkeypatch.setattr(module, "plan_hf_checkpoint", spy)
    ost.save(tmp_path / "c", _tree(), max_shard_size="20KB")
    ost.async_save(tmp_path / "a", _tree(), options=ost.SaveOptions(max_shard_size="20KB")).result()
    ost.consolidate(tmp_path / "c", tmp_path / "d", max_shard_size="20KB")
    assert seen == [20_000] * 3 and all(type(size) is int for size in seen)
    from orbax_safetensors.planning import plan_hf_checkpoint
    with pytest.raises(TypeError):
        plan_hf_checkpoint([], max_shard_size="20KB")


def test_orbax_arguments_take_options_too(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    tree = {"w": np.zeros(3, np.float32)}
    given = ost.SafetensorsSave(tree, options=ost.SaveOptions(max_shard_size="1GB", checksums=False),
                                max_shard_size="2GB")
    assert given.save_options == ost.SaveOptions(max_shard_size="2GB", checksums=False)
    assert ost.SafetensorsSave(tree).save_options == ost.SaveOptions()
    with pytest.raises(ValueError, match="max_shard_size: invalid size"):
        ost.SafetensorsSave(tree, options=ost.SaveOptions(), max_shard_size="lots")
    restore = ost.SafetensorsRestore(options=ost.LoadOptions(strict=False, threads=2), strict="target")
    assert restore.load_options == ost.LoadOptions(strict="target", threads=2)
    assert ost.SafetensorsRestore().load_options == ost.LoadOptions()

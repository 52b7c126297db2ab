"""``ost.convert(src, dst, mapping=...)``: Hugging Face ↔ a mapped tree's Orbax checkpoint.

What the conversion writes must be what a sharded ``ost.load`` through the same mapping gives,
bit for bit (MaxText's form for ``ost.mappings.maxtext``, a plain PyTree for our Flax-style
families), whatever the chunk and block sizes; the way back must give the checkpoint's tensor
data byte for byte; a Flax tree converted by us must compute transformers' logits. The MaxText
side itself (``load_params_from_path`` and MaxText's forward on our output, our reverse of
``to_maxtext.py``'s) is in ``tests/integrations/test_maxtext_convert.py``; the memory bound in
``test_memory_is_bounded_by_the_budget``.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_safetensors as ost
from orbax_safetensors.engine import flatten_with_names
from orbax_safetensors.planning import Transform, box_shape, full_box, intersect
from tests.support import REPO
from tests.support import hf_families
from tests.support.tolerances import assert_within

transformers = pytest.importorskip("transformers")
_REPO = str(REPO)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("llama") / "hf")
    hf_families.tiny_model("llama", directory, dtype="bfloat16")
    return directory


def _stored(directory) -> dict[str, np.ndarray]:
    import safetensors.numpy

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= safetensors.numpy.load_file(os.path.join(directory, name))
    return out


def _restored(item) -> dict[str, np.ndarray]:
    tree = ocp.PyTreeCheckpointHandler().restore(epath.Path(item))
    names, leaves, _ = flatten_with_names(tree)
    return {n: np.asarray(v) for n, v in zip(names, leaves)}


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unscan"])
@pytest.mark.parametrize("block_bytes", [None, 700], ids=["default", "tiny-blocks"])
def test_maxtext_form_is_what_a_mapped_load_gives_and_comes_back_byte_for_byte(hf_dir, tmp_path, scan,
                                                                                block_bytes):
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    mapping = ost.mappings.maxtext("llama3.1", config, scan_layers=scan)
    stats = ost.convert(hf_dir, tmp_path / "mt", mapping=mapping, dtype="float32", block_bytes=block_bytes,
                        progress=False)
    assert (stats.source_format, stats.target_format) == ("safetensors", "orbax")
    # MaxText's form: to_maxtext.py's step 0, the params under params.params beside the step.
    assert sorted(os.listdir(tmp_path / "mt")) == ["0"]
    step = tmp_path / "mt" / "0"
    assert {"_CHECKPOINT_METADATA", "items"} <= set(os.listdir(step))
    assert json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"] == {
        "items": "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"}
    restored = _restored(step / "items")
    assert restored.pop("step") == 0
    expected = ost.load(hf_dir, mapping=mapping)  # bfloat16 leaves; float32 where scaled
    assert sorted(restored) == sorted(f"params.params.{n}" for n in expected)
    for name, value in expected.items():
        got = restored[f"params.params.{name}"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(value).astype(np.float32), err_msg=name)
    # Each chunk holds one layer of a scanned leaf (layers at axis 1), and at most block_bytes.
    if scan and block_bytes:
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step / "items")).tree
        query = meta["params"]["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
        chunk = tuple(query.storage.chunk_shape)
        assert chunk[1] == 1 and np.prod(chunk) * 4 <= block_bytes, chunk

    back = ost.convert(tmp_path / "mt", tmp_path / "back", mapping=mapping, dtype="bfloat16",
                       block_bytes=block_bytes, progress=False)
    assert (back.source_format, back.target_format) == ("orbax", "safetensors")
    original, returned = _stored(hf_dir), _stored(tmp_path / "back")
    assert sorted(returned) == sorted(original)
    for name, value in original.items():  # bfloat16 -> float32 (scaled, permuted) -> bfloat16: exact
        assert returned[name].dtype == value.dtype and returned[name].tobytes() == value.tobytes(), name


def test_flax_tree_converted_computes_transformers_logits(hf_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    mapping = ost.mappings.llama(config, scan_layers=True)
    ost.convert(hf_dir, tmp_path / "flax", mapping=mapping, dtype="float32", block_bytes=1000, progress=False)
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(os.path.abspath(tmp_path / "flax"))
    logits = hf_families.forward("llama", config, tree, hf_families.TOKENS, scan_layers=True)
    reference, atol = hf_families.reference_logits(hf_dir, hf_families.TOKENS)
    assert_within(np.asarray(logits), reference, atol, "logits")
    ost.convert(tmp_path / "flax", tmp_path / "back", mapping=mapping, dtype="bfloat16", progress=False)
    original, returned = _stored(hf_dir), _stored(tmp_path / "back")
    assert {n: v.tobytes() for n, v in returned.items()} == {n: v.tobytes() for n, v in original.items()}


def test_cli_converts_with_a_named_mapping_both_ways(hf_dir, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", "convert", *args],
                              capture_output=True, text=True, timeout=300, cwd=_REPO)

    done = cli(hf_dir, str(tmp_path / "mt"), "--mapping", "maxtext:llama3.1", "--dtype", "float32", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["target_format"] == "orbax"
    missing = cli(str(tmp_path / "mt"), str(tmp_path / "hf"), "--mapping", "maxtext:llama3.1")
    assert missing.returncode != 0 and "--hf-config" in missing.stderr  # no config.json beside MaxText's
    back = cli(str(tmp_path / "mt"), str(tmp_path / "hf"), "--mapping", "maxtext:llama3.1",
               "--hf-config", os.path.join(hf_dir, "config.json"), "--dtype", "bfloat16")
    assert back.returncode == 0, back.stderr
    assert {n: v.tobytes() for n, v in _stored(tmp_path / "hf").items()} == \
        {n: v.tobytes() for n, v in _stored(hf_dir).items()}
    unknown = cli(hf_dir, str(tmp_path / "x"), "--mapping", "maxtext:gpt2")
    assert unknown.returncode != 0 and "no MaxText mapping for 'gpt2'" in unknown.stderr
    assert not os.path.exists(tmp_path / "x")


def test_clear_errors_and_nothing_left_behind(hf_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with pytest.raises(ost.ArgumentError, match="dtype= needs a mapping"):
        ost.convert(hf_dir, tmp_path / "plain", dtype="float32")
    with pytest.raises(ost.ArgumentError, match="memory_budget"):
        ost.convert(hf_dir, tmp_path / "plain", memory_budget=0)
    with pytest.raises(ost.MappingError):  # a Qwen3 mapping asks for q/k norms this model lacks
        ost.convert(hf_dir, tmp_path / "wrong", mapping=ost.mappings.maxtext("qwen3", config))
    assert sorted(os.listdir(tmp_path)) == []
    mapping = ost.mappings.maxtext("llama3.1", config)
    ost.convert(hf_dir, tmp_path / "mt", mapping=mapping, progress=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ost.convert(hf_dir, tmp_path / "mt", mapping=mapping, progress=False)
    before = _restored(tmp_path / "mt" / "0" / "items")

    # A read failing midway (a damaged source) leaves the old checkpoint whole and no junk.
    broken = tmp_path / "broken"
    ost.save(broken, ost.load(hf_dir))  # with block checksums, which transformers does not write
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-1000] + bytes(1000))  # the last tensor's bytes
    with pytest.raises(ost.ChecksumError):
        ost.convert(broken, tmp_path / "mt", mapping=mapping, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["broken", "mt"]
    after = _restored(tmp_path / "mt" / "0" / "items")
    assert all(np.array_equal(after[n], v) for n, v in before.items())

    # A directory of the user's own files is never replaced, even with overwrite; the error says
    # what makes it no MaxText checkpoint (a file of theirs, no step 0/), and the file stays.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"is not an Orbax checkpoint \('notes.txt', 'no 0/'\)"):
        ost.convert(hf_dir, tmp_path / "mine", mapping=mapping, overwrite=True, progress=False)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


# (config field, a value the 2-layer tiny llama does not have, what the checkpoint holds)
_MISFIT = [("num_hidden_layers", 1, 2), ("num_hidden_layers", 3, 2), ("hidden_size", 32, 64),
           ("intermediate_size", 48, 96), ("vocab_size", 100, 128)]


def test_a_config_the_checkpoint_does_not_fit_is_refused_naming_the_field_both_ways(hf_dir, tmp_path):
    """Rules map names and split heads; they do not count layers or check sizes. Was: a
    config of 1 or 3 layers (or another hidden, MLP or vocabulary size) converted a 2-layer
    checkpoint silently, and MaxText (or transformers, on the way back) failed at restore."""
    right = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    ost.convert(hf_dir, tmp_path / "mt", mapping=ost.mappings.maxtext("llama3.1", right), progress=False)
    for field, value, holds in _MISFIT:
        config = {**right, field: value}
        said = rf"config's {field} is {value}\b.*\b{holds}\b"
        for mapping in (ost.mappings.maxtext("llama3.1", config), ost.mappings.for_config(config)):
            with pytest.raises(ost.MappingError, match=said):
                ost.convert(hf_dir, tmp_path / "out", mapping=mapping, progress=False)
            with pytest.raises(ost.MappingError, match=said):
                ost.load(hf_dir, mapping=mapping)
        with pytest.raises(ost.MappingError, match=said):
            ost.convert(tmp_path / "mt", tmp_path / "out", mapping=ost.mappings.maxtext("llama3.1", config),
                        progress=False)
        assert sorted(os.listdir(tmp_path)) == ["mt"], field


# A config field of each MoE family and a value its tiny checkpoint does not fit. DeepSeek's layer
# after the last is its multi-token-prediction layer (num_nextn_predict_layers 1), left out: one
# layer too few is a config that fits.
_MOE_MISFIT = [("mixtral", "num_local_experts", 3), ("qwen3_moe", "num_local_experts", 3),
               ("qwen3_moe", "moe_intermediate_size", 48), ("deepseek_v3", "n_routed_experts", 4),
               ("deepseek_v3", "moe_intermediate_size", 16), ("deepseek_v3", "num_hidden_layers", 4)]


@pytest.mark.parametrize("family,field,value", _MOE_MISFIT)
def test_an_moe_config_the_checkpoint_does_not_fit_is_refused(tmp_path, family, field, value):
    """An MoE config of another expert count or size than the checkpoint's converted silently."""
    directory = str(tmp_path / "hf")
    hf_families.tiny_model(family, directory)
    right = transformers.AutoConfig.from_pretrained(directory).to_dict()
    config = {**right, field: value}
    maxtext = {"mixtral": "mixtral", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek3"}[family]
    said = rf"config's {field} is {value}\b.*\b{right[field]}\b"
    for mapping in (ost.mappings.maxtext(maxtext, config), ost.mappings.for_config(config)):
        with pytest.raises(ost.MappingError, match=said):
            ost.convert(directory, tmp_path / "out", mapping=mapping, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("seed", range(3))
def test_tree_box_covers_the_stored_box(seed):
    """``Transform.tree_box`` is the smallest tree box whose stored values cover a stored box:
    ``to_stored`` of it covers the box, on random boxes of a RoPE-permuted, split, transposed
    kernel (MaxText's query) and of a merged one (its output kernel)."""
    rng = np.random.default_rng(seed)
    from orbax_safetensors.planning import Rule

    query = Rule("q", "t", transpose=(1, 0), split={1: ("heads", "head_dim")},
                 permute={-1: "halves_to_interleaved"}, scale=0.25).resolve(
        stored_shape=(4 * 8, 6), dims={"heads": 4, "head_dim": 8})
    out = Rule("o", "t", transpose=(1, 0), split={0: ("heads", "head_dim")}).resolve(
        stored_shape=(6, 4 * 8), dims={"heads": 4, "head_dim": 8})
    for transform in (query, out):
        assert isinstance(transform, Transform)
        stored = rng.standard_normal(transform.stored_shape).astype(np.float32)
        tree = transform.apply(stored)
        for _ in range(50):
            box = tuple(tuple(sorted(rng.choice(s + 1, 2, replace=False))) for s in transform.stored_shape)
            own = transform.tree_box(box)
            data = tree[tuple(slice(a, b) for a, b in own)]
            filled = np.full(box_shape(box), np.nan, np.float32)
            for part_box, values in transform.to_stored(own, data):
                part = intersect(part_box, box)
                if part is not None:
                    filled[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(part, box))] = \
                        values[tuple(slice(a - p0, b - p0) for (a, b), (p0, _) in zip(part, part_box))]
            np.testing.assert_allclose(filled, stored[tuple(slice(a, b) for a, b in box)], rtol=1e-6,
                                       atol=0)
        assert transform.tree_box(full_box(transform.stored_shape)) == full_box(transform.tree_shape)


_MEASURE = r"""
import json, sys
import orbax_safetensors as ost

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

src, dst, budget, config = sys.argv[1:5]
mapping = ost.mappings.maxtext("llama3.1", json.load(open(config)), scan_layers=True)
ost.convert(src, dst, mapping=mapping, dtype="float32" if "mt" in dst else "bfloat16", memory_budget=budget,
            progress=False)  # warm up the imports and threads before the baseline
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux VmHWM reset")
def test_memory_is_bounded_by_the_budget(tmp_path):
    """A 445 MB bfloat16 llama-shaped checkpoint (scanned: every output leaf stacks all layers)
    to MaxText's float32 form (890 MB) and back, with a 64 MB budget: the peak RSS above the
    interpreter's stays within 1.5 budgets, far below the model, both ways.

    glibc's malloc raises its mmap threshold as big blocks are freed (up to 32 MB), after which
    blocks of a few MB (a 64 MB budget's) come from per-thread arenas that keep them resident:
    measured here ~140 MB the way back, ~50-60 MB with the threshold pinned at 1 MB (as below)
    or two arenas. At the default 1 GB budget blocks are 32 MB and mmapped anyway."""
    config = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
              "intermediate_size": 4096, "num_hidden_layers": 12, "vocab_size": 16384,
              "tie_word_embeddings": False}
    rng = np.random.default_rng(0)
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    tensors = {"model.embed_tokens.weight": (16384, hidden), "lm_head.weight": (16384, hidden),
               "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": (1024, hidden), p + "self_attn.k_proj.weight": (512, hidden),
                    p + "self_attn.v_proj.weight": (512, hidden), p + "self_attn.o_proj.weight": (hidden, 1024),
                    p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
                    p + "mlp.down_proj.weight": (hidden, mlp), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)}
    values = {n: rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16) for n, s in tensors.items()}
    total = sum(v.nbytes for v in values.values())
    ost.save(tmp_path / "hf", values, max_shard_size="100MB")
    del values
    (tmp_path / "config.json").write_text(json.dumps(config))
    budget = 64 << 20
    script = _MEASURE + r"""
import shutil
shutil.rmtree(dst)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = status("VmRSS")
ost.convert(src, dst, mapping=mapping, dtype="float32" if "mt" in dst else "bfloat16", memory_budget=budget,
            progress=False)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""
    peaks = {}
    for src, dst in ((tmp_path / "hf", tmp_path / "mt"), (tmp_path / "mt", tmp_path / "back")):
        done = subprocess.run([sys.executable, "-c", script, str(src), str(dst), str(budget),
                               str(tmp_path / "config.json")], capture_output=True, text=True, timeout=600,
                              cwd=_REPO, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                              "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
        assert done.returncode == 0, done.stderr[-3000:]
        numbers = json.loads(done.stdout.strip().splitlines()[-1])
        peaks[dst.name] = numbers["peak"] - numbers["baseline"]
    print({k: f"{v / 1e6:.0f} MB" for k, v in peaks.items()}, f"model {total / 1e6:.0f} MB")
    for name, peak in peaks.items():
        assert peak <= budget * 1.5, f"{name}: peak {peak / 1e6:.0f} MB above a {budget / 1e6:.0f} MB budget"
    assert _stored(tmp_path / "back").keys() == set(tensors)


_CONVERT = r"""
import json, sys
import orbax_safetensors as ost

src, dst, config = sys.argv[1:4]
mapping = ost.mappings.maxtext("llama3.1", json.load(open(config)), scan_layers=True)
ost.convert(src, dst, mapping=mapping, dtype="float32", memory_budget="16MB", progress=False)
"""


@pytest.mark.slow
def test_ctrl_c_leaves_nothing(tmp_path):
    """SIGINT while the Orbax output is being written: ``KeyboardInterrupt`` (exit 130), and
    neither the checkpoint, nor its staging, nor the lock is left (Orbax's commit threads stop
    at their next chunk and are waited for before the staged directory is removed)."""
    import signal
    import time

    config = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
              "intermediate_size": 2048, "num_hidden_layers": 8, "vocab_size": 8192,
              "tie_word_embeddings": False}
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": (8192, 512), "lm_head.weight": (8192, 512), "model.norm.weight": (512,)}
    for i in range(8):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": (512, 512), p + "self_attn.k_proj.weight": (256, 512),
                    p + "self_attn.v_proj.weight": (256, 512), p + "self_attn.o_proj.weight": (512, 512),
                    p + "mlp.gate_proj.weight": (2048, 512), p + "mlp.up_proj.weight": (2048, 512),
                    p + "mlp.down_proj.weight": (512, 2048), p + "input_layernorm.weight": (512,),
                    p + "post_attention_layernorm.weight": (512,)}
    ost.save(tmp_path / "hf", {n: rng.standard_normal(s, np.float32) for n, s in tensors.items()})
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _CONVERT, str(tmp_path / "hf"), str(out / "mt"),
                              str(tmp_path / "config.json")], cwd=_REPO, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".mt.tmp-") for p in out.iterdir()):  # writing has begun
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130 or "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1].startswith("KeyboardInterrupt"), stderr[-3000:]
    assert sorted(os.listdir(out)) == []


@pytest.mark.parametrize("budget", ["1MB", "64KB"], ids=["bands-of-layers", "no-band-fits"])
def test_way_back_from_chunks_that_hold_every_layer(hf_dir, tmp_path, budget):
    """MaxText's own converter writes each scanned array in chunks that hold every layer (one
    chunk here: Orbax's default for an unsharded array). The way back reads them in bands of
    layers (or, when not even one layer of every leaf fits the budget, box by box) and gives
    the checkpoint's tensors byte for byte."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    mapping = ost.mappings.maxtext("llama3.1", config, scan_layers=True)
    tree = ost.load(hf_dir, mapping=mapping, nest=True)
    tree = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(tmp_path / "mt" / "0" / "items"),
                          {"params": {"params": tree}, "step": 0})
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(tmp_path / "mt" / "0" / "items")).tree
    query = meta["params"]["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert tuple(query.storage.chunk_shape) == tuple(query.shape)  # every layer in one chunk
    ost.convert(tmp_path / "mt", tmp_path / "back", mapping=mapping, dtype="bfloat16", memory_budget=budget,
                progress=False)
    original, returned = _stored(hf_dir), _stored(tmp_path / "back")
    assert {n: v.tobytes() for n, v in returned.items()} == {n: v.tobytes() for n, v in original.items()}

"""Flax NNX states: saved and loaded under the names their params dict has.

``nnx.split(model)`` gives a ``State`` whose leaves sit inside ``Variable``s
(``nnx.Param``), each holding its array under a ``value`` attribute. The
checkpoint names a tensor as a Linen params dict or a PyTorch ``state_dict``
does (``block.down.kernel``, never ``block.down.kernel.value``), so a state
loads checkpoints made by either, through a mapping too; and a load into an
abstract state (``nnx.eval_shape``) gives a ``State`` of ``Variable``s again,
which ``nnx.merge`` turns into the model, bit for bit. The NNX Llama of
``examples/nnx_llama.py`` loads a transformers checkpoint, trains a step and
saves back a directory transformers loads with the trained model's logits.
"""

import dataclasses
import importlib.util
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.hf_reference import write_random_llama
from tests.support.tolerances import assert_within, causal_lm_reference

nnx = pytest.importorskip("flax.nnx")

_EXAMPLES = os.path.join(str(REPO), "examples")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example_for_nnx", os.path.join(_EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


nnx_llama = _example("nnx_llama")

_NAMES = {"embed.embedding", "block.up.kernel", "block.up.bias", "block.down.kernel", "block.down.bias",
          "block.norm.scale", "head.kernel"}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.relu(self.up(self.norm(x))))


class Toy(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.block = Block(rngs)
        self.head = nnx.Linear(16, 64, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.block(self.embed(tokens)))


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


def _fsdp(abstract: nnx.State) -> nnx.State:
    """Each leaf's first axis over the 8 devices where it divides, replicated otherwise."""
    mesh = _mesh()

    def place(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = P("fsdp") if leaf.shape and leaf.shape[0] % 8 == 0 else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(place, abstract)


def _abstract_toy() -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Toy(nnx.Rngs(0))))
    return graphdef, _fsdp(abstract)


def _assert_same_state(actual: nnx.State, expected: nnx.State) -> None:
    assert isinstance(actual, nnx.State)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)  # Variables of the same types
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), actual, expected)


def _variables(state: nnx.State) -> list:
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_a_state_is_saved_under_the_names_of_its_params_dict(tmp_path):
    _, state = nnx.split(Toy(nnx.Rngs(0)))
    ost.save(tmp_path / "state", state, checksums=False)
    ost.save(tmp_path / "dict", nnx.to_pure_dict(state), checksums=False)
    assert set(ost.metadata(tmp_path / "state").tensors) == _NAMES
    assert (tmp_path / "state" / "model.safetensors").read_bytes() == \
        (tmp_path / "dict" / "model.safetensors").read_bytes()


def test_an_abstract_state_loads_as_a_state_the_model_merges_bit_for_bit(tmp_path):
    """From a checkpoint of the plain names, as a Linen params dict (or another program) saves it."""
    model = Toy(nnx.Rngs(0))
    _, state = nnx.split(model)
    ost.save(tmp_path / "ckpt", nnx.to_pure_dict(state))
    graphdef, target = _abstract_toy()
    loaded = ost.load(tmp_path / "ckpt", target)
    _assert_same_state(loaded, state)
    assert all(isinstance(v, nnx.Param) for v in _variables(loaded))
    assert jax.tree.all(jax.tree.map(lambda a, t: a.sharding == t.sharding, loaded, target))
    merged = nnx.merge(graphdef, loaded)
    _assert_same_state(nnx.state(merged), state)
    placed = nnx.merge(graphdef, jax.device_put(state, jax.tree.map(lambda t: t.sharding, target)))
    tokens = jnp.arange(8).reshape(2, 4)
    np.testing.assert_array_equal(np.asarray(merged(tokens)), np.asarray(placed(tokens)))


def test_async_save_and_async_load_of_a_state(tmp_path):
    _, state = nnx.split(Toy(nnx.Rngs(2)))
    ost.async_save(tmp_path / "ckpt", state).result()
    assert set(ost.metadata(tmp_path / "ckpt").tensors) == _NAMES
    _assert_same_state(ost.async_load(tmp_path / "ckpt", _abstract_toy()[1]).result(), state)


def test_target_of_a_saved_state_names_its_leaves(tmp_path):
    _, state = nnx.split(Toy(nnx.Rngs(3)))
    ost.save(tmp_path / "ckpt", state)
    target = ost.target(tmp_path / "ckpt", [("kernel|embedding", P("fsdp")), (".*", P())], mesh=_mesh())
    loaded = ost.load(tmp_path / "ckpt", target)
    assert jax.tree.structure(loaded) == jax.tree.structure(nnx.to_pure_dict(state))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded, nnx.to_pure_dict(state))


def test_checkpoint_manager_saves_and_restores_a_state(tmp_path):
    import orbax.checkpoint as ocp

    _, state = nnx.split(Toy(nnx.Rngs(4)))
    _, target = _abstract_toy()
    with ocp.CheckpointManager(tmp_path / "run", item_names=("params",)) as manager:
        manager.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(state)))
        manager.wait_until_finished()
        restored = manager.restore(1, args=ocp.args.Composite(params=ost.SafetensorsRestore(target)))["params"]
    assert set(ost.metadata(tmp_path / "run" / "1" / "params").tensors) == _NAMES
    _assert_same_state(restored, state)
    assert jax.tree.all(jax.tree.map(lambda a, t: a.sharding == t.sharding, restored, target))


class WithRngs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def test_a_state_with_rng_keys_is_refused_saying_to_split_out_the_params(tmp_path):
    model = WithRngs(nnx.Rngs(0))
    with pytest.raises(ost.ArgumentTypeError, match=r"'drop\.rngs\.key' is a typed PRNG key.*nnx\.Param"):
        ost.save(tmp_path / "all", nnx.split(model)[1])
    assert not (tmp_path / "all").exists()
    _, params, batch_stats, _ = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    ost.save(tmp_path / "params", params)
    ost.save(tmp_path / "batch_stats", batch_stats)
    assert set(ost.metadata(tmp_path / "params").tensors) == {"linear.kernel", "linear.bias", "norm.scale",
                                                             "norm.bias"}
    assert set(ost.metadata(tmp_path / "batch_stats").tensors) == {"norm.mean", "norm.var"}
    _, abstract_params, abstract_stats, _ = nnx.split(nnx.eval_shape(lambda: WithRngs(nnx.Rngs(0))),
                                                      nnx.Param, nnx.BatchStat, ...)
    _assert_same_state(ost.load(tmp_path / "params", abstract_params), params)
    loaded_stats = ost.load(tmp_path / "batch_stats", abstract_stats)
    _assert_same_state(loaded_stats, batch_stats)
    assert all(isinstance(v, nnx.BatchStat) for v in _variables(loaded_stats))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    value: jax.Array


def test_a_value_field_outside_a_variable_keeps_its_name(tmp_path):
    ost.save(tmp_path / "ckpt", {"box": Box(np.arange(3.0)), "param": nnx.Param(np.ones(2))})
    assert set(ost.metadata(tmp_path / "ckpt").tensors) == {"box.value", "param"}


def _llama_config(tied: bool) -> dict:
    return {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": tied}


@pytest.mark.parametrize("tied", [False, True])
def test_nnx_llama_saves_and_loads_through_the_llama_mapping(tmp_path, tied):
    config = _llama_config(tied)
    _, state = nnx.split(nnx_llama.LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    ost.save(tmp_path / "hf", state, mapping=ost.mappings.llama(config))
    stored = ost.metadata(tmp_path / "hf").tensors
    assert stored["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # (kv heads * head_dim, hidden)
    assert ("lm_head.weight" in stored) is not tied
    graphdef, abstract = nnx_llama.abstract_model(config)
    target = jax.tree.map(lambda leaf: nnx_llama.fsdp(leaf, _mesh()), abstract)
    loaded = ost.load(tmp_path / "hf", target, mapping=ost.mappings.llama(config))
    _assert_same_state(loaded, state)
    assert jax.tree.all(jax.tree.map(lambda a, t: a.sharding == t.sharding, loaded, target))
    _assert_same_state(nnx.state(nnx.merge(graphdef, loaded)), state)


def test_nnx_llama_state_has_the_names_and_shapes_of_the_linen_llama_params(tmp_path):
    flax_llama = _example("flax_llama")
    config = _llama_config(False)
    linen = flax_llama.abstract_params(flax_llama.LlamaConfig.from_hf(config))
    _, state = nnx.split(nnx_llama.LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    ost.save(tmp_path / "nnx", state)
    expected = {".".join(k.key for k in path): leaf.shape
                for path, leaf in jax.tree_util.tree_flatten_with_path(linen)[0]}
    assert {name: tuple(t.shape) for name, t in ost.metadata(tmp_path / "nnx").tensors.items()} == expected


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> str:
    """A tiny transformers Llama (GQA, untied head) with every weight randomised, norms too."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    directory = str(tmp_path_factory.mktemp("llama") / "tiny")
    write_random_llama(directory)
    return directory


def _transformers_logits(directory: str, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits and each one's atol against another float32 forward."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return causal_lm_reference(model, tokens)


@pytest.mark.slow
def test_nnx_llama_trains_a_step_and_saves_a_checkpoint_transformers_loads(hf_llama, tmp_path):
    optax = pytest.importorskip("optax")
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_llama)
    graphdef, abstract = nnx_llama.abstract_model(config)
    target = jax.tree.map(lambda leaf: nnx_llama.fsdp(leaf, _mesh()), abstract)
    state = ost.load(hf_llama, target, mapping=ost.mappings.llama(config))
    q_proj = state["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]  # (hidden, heads, head_dim)
    assert q_proj.sharding.shard_shape(q_proj.shape) == (64 // 8, 4, 16)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 10), dtype=np.int32)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    reference, atol = _transformers_logits(hf_llama, tokens)
    assert np.abs(reference).max() > 1.0  # logits large enough for a wrong layout to show
    assert_within(np.asarray(forward(state, tokens)), reference, atol, "nnx logits")

    optimizer = optax.sgd(0.5)

    @jax.jit
    def step(state: nnx.State, opt_state, tokens: jax.Array):
        def loss(state: nnx.State) -> jax.Array:
            logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(state)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value

    trained, _, loss = step(state, optimizer.init(state), tokens)
    assert isinstance(trained, nnx.State) and np.isfinite(loss)
    trained_logits = np.asarray(forward(trained, tokens))
    assert np.abs(trained_logits - reference).max() > 100 * np.max(atol)  # the step moved the logits
    out = str(tmp_path / "trained")
    ost.save(out, trained, mapping=ost.mappings.llama(config))
    shutil.copy(os.path.join(hf_llama, "config.json"), out)
    round_trip, atol = _transformers_logits(out, tokens)
    assert_within(round_trip, trained_logits, atol, "transformers on the saved step vs the trained nnx model")


@pytest.mark.slow
def test_nnx_llama_example_script_reports_a_match(hf_llama, capsys, monkeypatch):
    monkeypatch.syspath_prepend(_EXAMPLES)  # as when run as a script: flax_llama.py beside it
    assert nnx_llama.main([hf_llama]) == 0
    out = capsys.readouterr().out
    assert "(match)" in out and "identical params" in out


def test_a_target_holding_rng_state_says_to_load_the_params_alone(tmp_path):
    class Dropped(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.down = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    ost.save(tmp_path / "ckpt", nnx.split(Dropped(nnx.Rngs(0)), nnx.Param, ...)[1])
    abstract = nnx.split(nnx.eval_shape(lambda: Dropped(nnx.Rngs(0))))[1]
    with pytest.raises(ost.ArgumentTypeError, match=r"drop\.rngs\.key.*nnx\.split\(abstract_model, nnx\.Param"):
        ost.load(tmp_path / "ckpt", abstract)

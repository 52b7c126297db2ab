"""The README's recipes run as written, in a fresh interpreter, on 1 and 8 CPU devices.

A tiny random Llama (and a word-level tokenizer) stands where the recipe names a download;
after a recipe, the test checks what it promised in the same process: the saved directory
loads in transformers with the trained model's logits, the manager restored the last step, the
CLI round trip gave the tensors back bit for bit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support import REPO

pytestmark = pytest.mark.slow  # fresh interpreters importing JAX (and torch)
_TINY = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _recipe(title: str, language: str = "python") -> str:
    """The first ``language`` block under the README heading that starts with ``title``."""
    section = re.split(r"\n### " + re.escape(title), (REPO / "README.md").read_text(), maxsplit=1)
    assert len(section) == 2, f"README.md has no recipe {title!r}"
    return re.search(rf"```{language}\n(.*?)```", section[1], re.S).group(1)


def _run(code: str, cwd: Path, devices: int, *, extra_path: Path | None = None) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _tiny_llama(directory: Path, **config) -> None:
    """A random LlamaForCausalLM and a word-level tokenizer, as `hf download` leaves them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_TINY, **config}))
    with torch.no_grad():  # norms away from 1, so a swapped or dropped norm shows in the logits
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    words = ["<unk>", "<s>", "JAX", "loves", "safetensors"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(_TINY["vocab_size"] - len(words))])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                         bos_token="<s>").save_pretrained(directory)


_NNX_CHECK = """
import numpy as np, torch, transformers
reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
assert transformers.AutoTokenizer.from_pretrained(out)("JAX loves")["input_ids"] == \\
    tokenizer("JAX loves")["input_ids"]
with torch.no_grad():
    theirs = reloaded(torch.as_tensor(np.asarray(tokens))).logits.numpy()
ours = np.asarray(model(tokens))
scale = np.abs(ours).max()
assert np.abs(theirs - ours).max() <= 1e-4 * max(scale, 1.0), (np.abs(theirs - ours).max(), scale)
before = ost.load(src)
after = ost.load(out)
assert sorted(before) == sorted(after)
assert any(not np.array_equal(before[k], after[k]) for k in before)  # the step changed weights
print("checked")
"""


@pytest.mark.parametrize("devices", [1, 8])
def test_hf_to_flax_nnx_train_step_and_back(tmp_path, devices):
    pytest.importorskip("flax.nnx")
    pytest.importorskip("optax")
    _tiny_llama(tmp_path / "Llama-3.2-1B", tie_word_embeddings=True,  # as Llama 3.2 1B: tied,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    code = _recipe("Hugging Face → Flax NNX")
    out = _run(code + _NNX_CHECK, tmp_path, devices, extra_path=REPO / "examples")
    assert out.startswith("loss ") and out.rstrip().endswith("checked"), out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "Llama-3.2-1B-tuned"))


_MANAGER_CHECK = """
import numpy as np
final = ost.load(f"{run}/{step}/params", abstract[0])
assert step == 20 and all(np.array_equal(final[k], restored.params[k]) for k in final)
assert sorted(os.listdir(run)) == ["10", "20"], os.listdir(run)
print("checked")
"""


@pytest.mark.parametrize("devices", [1, 8])
def test_an_orbax_manager_loop(tmp_path, devices):
    pytest.importorskip("optax")
    out = _run(_recipe("An Orbax `CheckpointManager` loop") + _MANAGER_CHECK, tmp_path, devices)
    assert out.splitlines()[-2].startswith("20 ["), out
    assert out.rstrip().endswith("checked"), out


def test_to_maxtext_and_back_from_the_command_line(tmp_path):
    # head_dim 16: MaxText scales queries by head_dim ** -0.5, exact for a power of 4, so the
    # round trip is bit for bit
    _tiny_llama(tmp_path / "Llama-3.1-8B", rope_theta=500000.0, hidden_size=64)
    cli = shutil.which("orbax-safetensors", path=os.path.dirname(sys.executable))
    assert cli is not None, "the orbax-safetensors entry point is not installed"
    outputs = []
    for line in _recipe("To MaxText and back", "bash").splitlines():
        command = line.split("#", 1)[0].strip()
        if command:
            result = subprocess.run(command.replace("orbax-safetensors", cli, 1), shell=True,
                                    cwd=tmp_path, capture_output=True, text=True, timeout=600,
                                    env={**os.environ, "JAX_PLATFORMS": "cpu"})
            assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"
            outputs.append(result.stdout)
    items = tmp_path / "llama-mt" / "0" / "items"
    assert outputs[0].endswith(f"; MaxText: load_parameters_path={items}\n"), outputs[0]
    transformers = pytest.importorskip("transformers")
    configs = [transformers.AutoConfig.from_pretrained(tmp_path / d).to_dict()
               for d in ("llama-back", "Llama-3.1-8B")]
    assert [{k: v for k, v in c.items() if k != "_name_or_path"} for c in configs][0] == \
        {k: v for k, v in configs[1].items() if k != "_name_or_path"}
    original, back = ost.load(tmp_path / "Llama-3.1-8B"), ost.load(tmp_path / "llama-back")
    assert sorted(original) == sorted(back)
    for name, value in original.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)

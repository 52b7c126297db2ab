"""Independent re-implementations of Hugging Face rules, to test ours against."""

from __future__ import annotations


def reference_split(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """huggingface_hub.split_state_dict_into_shards_factory's rule, from its source.

    Walk in order; a tensor larger than the limit goes alone into a new shard
    (appended immediately, the current shard stays open); otherwise, if it
    would tip the current shard over the limit, close the current shard first.
    """
    shard_list: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > limit:
            shard_list.append([name])
            continue
        if current_size + size > limit:
            shard_list.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shard_list.append(current)
    return shard_list


def write_random_llama(directory: str) -> None:
    """A tiny transformers Llama (GQA, untied head) with every weight randomised, norms too (so
    swapping two norms or transposing the wrong way shows in the logits), saved to ``directory``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=500.0, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)

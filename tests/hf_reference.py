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

"""Flat dotted names ↔ nested dicts, for tests that build targets by name."""

from orbax_safetensors.engine.core.tree_names import nest  # noqa: F401  (the library's own)


def flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": x}}`` → ``{"a.b": x}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out

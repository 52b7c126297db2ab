"""Flat dotted names ↔ nested dicts, for tests that build targets by name."""


def nest(flat: dict) -> dict:
    """``{"a.b": x}`` → ``{"a": {"b": x}}``."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": x}}`` → ``{"a.b": x}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out

"""The package's layers import downwards only, and the integrations use the engine's public names.

DESIGN.md's layers: format → index → planning → storage → engine → integrations.
A module may import its own layer and those below; an integration imports the
engine package (its public surface), never an engine module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "orbax_safetensors"
LAYERS = ["errors", "format", "index", "planning", "storage", "engine", "mappings", "integrations"]
# What each layer may import besides itself (errors is everyone's).
ALLOWED = {
    "errors": set(),
    "format": {"errors"},
    "index": {"errors", "format"},
    "planning": {"errors", "format", "index"},
    "storage": {"errors", "format", "index"},
    "engine": {"errors", "format", "index", "planning", "storage"},
    "mappings": {"errors", "planning"},
    "integrations": {"errors", "format", "index", "planning", "storage", "engine", "mappings"},  # the CLI names mappings
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "orbax_safetensors" and len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names
                      if node.module == "orbax_safetensors"]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _modules() -> list[tuple[str, Path]]:
    return [(path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", "."), path)
            for path in sorted(PACKAGE.rglob("*.py")) if path.parent != PACKAGE]


def test_every_import_points_down():
    wrong = []
    for module, path in _modules():
        layer = _layer(module)
        for imported in _imports(path):
            target = _layer(imported)
            if target and target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_integrations_use_only_the_engines_public_names():
    private = [f"{module} imports {imported}"
               for module, path in _modules() if _layer(module) == "integrations"
               for imported in _imports(path)
               if imported.startswith("orbax_safetensors.engine.")]
    assert not private, private

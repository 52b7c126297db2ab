"""The package's layers import downwards only, and the integrations use the engine's public names.

DESIGN.md's layers: format → index → planning → storage → engine → integrations.
A module may import its own layer and those below; an integration imports the
engine package (its public surface), never an engine module.

Inside the engine, rooms are named by path: ``loading`` and ``saving`` never
import each other, ``core`` imports neither, and ``streams`` (which read one
checkpoint and write another) may build on both.
"""

from __future__ import annotations

import ast
from pathlib import Path
from tests.support import REPO

PACKAGE = REPO / "orbax_safetensors"
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


# Inside the engine: what each room may import besides itself.
ENGINE_ROOMS = {
    "core": set(),
    "loading": {"core"},
    "saving": {"core"},
    "streams": {"core", "loading", "saving"},
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    inside = parts[:2] == ["orbax_safetensors", "engine"] and len(parts) > 2 and parts[2] != "__init__"
    return parts[2] if inside else None


def test_engine_modules_live_in_a_room():
    loose = [module for module, _ in _modules()
             if _layer(module) == "engine" and module.count(".") == 2 and not module.endswith("__init__")]
    assert not loose, loose
    assert {m.split(".")[2] for m, _ in _modules() if _room(m)} == set(ENGINE_ROOMS)


def test_engine_rooms_import_only_their_own_path_and_the_core():
    wrong = []
    for module, path in _modules():
        room = _room(module)
        if room is None:
            continue
        for imported in _imports(path):
            target = _room(imported)
            if target and target != room and target not in ENGINE_ROOMS[room]:
                wrong.append(f"{module} imports {imported}")
            if imported == "orbax_safetensors.engine":
                wrong.append(f"{module} imports the engine's public surface from inside the engine")
    assert not wrong, wrong

"""``import orbax_safetensors`` imports no Orbax, and Orbax still finds our handlers.

Orbax takes about half a second to import, more than everything of ours: the engine and the
CLI's reading commands must not pay it. Each test runs a fresh interpreter, since what a
process has imported is the thing under test. Import times are measured, not asserted here.

Orbax restores a step without arguments through the handler typestrs the step records, so
our handlers must be in its registries whichever of the two packages a process imports first
and whatever imports Orbax (the user, an Orbax name of ``ost``, a module of ours).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
import pytest

import orbax_safetensors as ost
from tests.support import REPO

_ORBAX_NAMES = ("SafetensorsCheckpointHandler", "SafetensorsHandler", "SafetensorsLayout",
                "SafetensorsRestore", "SafetensorsSave", "ConvertOptions", "ConvertStats", "convert",
                "install_orbax_layout")

# What a script reports of its process: the Orbax modules loaded, and our Orbax modules.
_REPORT = """
import json as _json, sys as _sys
print(_json.dumps({
    "orbax": sorted(m for m in _sys.modules if m == "orbax" or m.startswith("orbax.")),
    "ours": sorted(m for m in _sys.modules if m.startswith("orbax_safetensors.integrations.orbax_")
                   and not m.endswith((".orbax_version", ".orbax_registration"))),
}))
"""

# Whether Orbax's registries hold our handlers as a restore without arguments looks them up:
# v0 by the typestr a step records (ours, or v1's for a step v1 wrote), with the restore
# arguments Orbax then builds; v1 by our handler's typestr, or v0's as a secondary one.
_REGISTERED = """
import json as _json
from orbax.checkpoint import args as _args
from orbax.checkpoint._src.handlers import handler_type_registry as _types
import orbax.checkpoint.experimental.v1 as _v1
_registry = _v1.handlers.global_registry()
print(_json.dumps({"registered": {
    "v0": [_args.get_registered_args_cls(_types.get_handler_type(t))[1].__name__ for t in (
        "orbax_safetensors.SafetensorsCheckpointHandler",
        "orbax_safetensors.integrations.orbax_v1.SafetensorsHandler")],
    "v1": [[h.__module__ + "." + h.__qualname__, _registry.get_secondary_typestrs(h)]
           for h, _ in _registry.get_all_entries() if h.__module__.startswith("orbax_safetensors")],
}}))
"""
_ALL_REGISTERED = {
    "v0": ["SafetensorsRestore", "V1StepRestore"],
    "v1": [["orbax_safetensors.integrations.orbax_v1.SafetensorsHandler",
            ["orbax_safetensors.SafetensorsCheckpointHandler"]]],
}
# Our finder is gone from sys.meta_path once its work is done (or was never needed).
_NO_FINDER = """
import sys as _sys
assert not any(type(f).__module__.startswith("orbax_safetensors") for f in _sys.meta_path)
"""


def _run(*parts: str) -> dict:
    """Runs the script ``parts`` make in a fresh interpreter; the JSON objects it prints, merged."""
    script = "".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    merged = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    return merged


def test_import_loads_no_orbax():
    report = _run(f"""
        import orbax_safetensors as ost
        names = {set(_ORBAX_NAMES)!r}
        assert set(ost.__all__) >= names and set(dir(ost)) >= names
    """, _REPORT)
    assert report == {"orbax": [], "ours": []}


def test_save_load_metadata_load_no_orbax(tmp_path):
    report = _run(f"""
        import numpy as np
        import orbax_safetensors as ost
        params = {{"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int8)}}
        ost.save({str(tmp_path / "ckpt")!r}, params, max_shard_size=16)
        loaded = ost.load({str(tmp_path / "ckpt")!r})
        assert all((loaded[k] == v).all() for k, v in params.items())
        assert ost.metadata({str(tmp_path / "ckpt")!r}).tensors["w"].shape == (2, 3)
    """, _REPORT)
    assert report == {"orbax": [], "ours": []}


def test_cli_reading_commands_load_no_orbax(tmp_path):
    ost.save(tmp_path / "ckpt", {"w": np.arange(6, dtype=np.float32)})
    report = _run(f"""
        from orbax_safetensors.integrations.cli import main
        for command in ("inspect", "verify"):
            assert main([command, {str(tmp_path / "ckpt")!r}]) == 0, command
        assert main(["consolidate", {str(tmp_path / "ckpt")!r}, {str(tmp_path / "one")!r}]) == 0
    """, _REPORT)
    assert report == {"orbax": [], "ours": []}


@pytest.mark.parametrize("touch", [
    "ost.SafetensorsSave",
    "ost.SafetensorsLayout",
    "ost.convert",
    # Our own module imports Orbax first: registering from inside that import would find it
    # half-executed, so registration waits for the outermost import to finish.
    "import orbax_safetensors.integrations.orbax_v1",
    "import orbax.checkpoint",
])
def test_orbax_loaded_later_finds_our_handlers(touch):
    report = _run(f"""
        import orbax_safetensors as ost
        {touch}
    """, _NO_FINDER, _REGISTERED, _REPORT)
    assert report["registered"] == _ALL_REGISTERED
    assert "orbax.checkpoint" in report["orbax"]


def test_orbax_loaded_first_finds_our_handlers():
    report = _run("""
        import orbax.checkpoint
        import orbax_safetensors as ost
    """, _NO_FINDER, _REGISTERED)
    assert report["registered"] == _ALL_REGISTERED


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """A step a v0 CheckpointManager wrote and one v1's Checkpointer wrote, both ours alone."""
    root = tmp_path_factory.mktemp("steps")
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(4, dtype=np.int32)}
    with ocp.CheckpointManager(root / "v0") as mngr:
        mngr.save(2, args=ocp.args.Composite(params=ost.SafetensorsSave(params)))
    with ocp_v1.training.Checkpointer(root / "v1") as checkpointer:
        checkpointer.save_checkpointables(5, {"params": ost.SafetensorsSave(params)})
    return root, params


_IMPORT_ORDERS = {
    "ost_first": "import orbax_safetensors\nimport orbax.checkpoint as ocp\n",
    "orbax_first": "import orbax.checkpoint as ocp\nimport orbax_safetensors\n",
}


@pytest.mark.parametrize("order", _IMPORT_ORDERS)
def test_fresh_manager_restores_without_arguments(steps, order):
    """Nothing of ours touched but the import: the typestrs a step records pick our handlers
    in v0 (steps v0 and v1 wrote), as in a training script restarted on its last step."""
    root, params = steps
    report = _run(_IMPORT_ORDERS[order], f"""
import json
restored = {{}}
for run, step in (("v0", 2), ("v1", 5)):
    with ocp.CheckpointManager({str(root)!r} + "/" + run) as mngr:
        restored[run] = {{k: v.tolist() for k, v in mngr.restore(step)["params"].items()}}
print(json.dumps({{"restored": restored}}))
""")
    expected = {k: v.tolist() for k, v in params.items()}
    assert report["restored"] == {"v0": expected, "v1": expected}


@pytest.mark.parametrize("order", _IMPORT_ORDERS)
def test_v1_loads_without_abstract_tree(steps, order):
    """``ocp.v1.load_checkpointables`` resolves our handler by typestr (v1's own, or v0's as
    its secondary typestr) for steps either generation wrote."""
    root, params = steps
    report = _run(_IMPORT_ORDERS[order], f"""
import json
import orbax.checkpoint.experimental.v1 as ocp_v1
loaded = {{}}
for run, step in (("v0", 2), ("v1", 5)):
    item = ocp_v1.load_checkpointables({str(root)!r} + "/" + run + "/" + str(step))["params"]
    loaded[run] = {{k: v.tolist() for k, v in item.items()}}
print(json.dumps({{"loaded": loaded}}))
""")
    expected = {k: v.tolist() for k, v in params.items()}
    assert report["loaded"] == {"v0": expected, "v1": expected}


def test_unsupported_orbax_is_left_alone():
    """Outside the supported range, importing Orbax after us registers nothing and raises
    nothing; touching an Orbax name of ours is what raises."""
    report = _run("""
        import importlib.metadata as m
        real = m.version
        m.version = lambda name: "0.10.2" if name == "orbax-checkpoint" else real(name)
        import json
        import orbax_safetensors as ost
        import orbax.checkpoint
        try:
            ost.SafetensorsSave
        except ost.UnsupportedOrbaxError as e:
            print(json.dumps({"error": str(e)}))
    """, _REPORT)
    assert "orbax-checkpoint 0.10.2 is installed" in report["error"]
    assert report["ours"] == [] and "orbax.checkpoint" in report["orbax"]

"""The orbax-safetensors command, run as users run it (a subprocess)."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np

import orbax_safetensors as ost

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "orbax_safetensors.integrations.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=_REPO)


def test_inspect_table_and_json(tmp_path):
    ost.save(tmp_path / "c", {"w": np.zeros((4, 8), ml_dtypes.bfloat16), "f4": np.zeros(
        (2, 2), ml_dtypes.float4_e2m1fn)}, max_shard_size=40, metadata={"step": "3"})
    table = _cli("inspect", str(tmp_path / "c"))
    assert table.returncode == 0, table.stderr
    assert "w" in table.stdout and "bfloat16" in table.stdout and "(4, 8)" in table.stdout
    assert "2 tensors, 66 B in 2 file(s)" in table.stdout
    assert "metadata step = 3" in table.stdout
    report = json.loads(_cli("inspect", str(tmp_path / "c"), "--json").stdout)
    assert {t["name"]: t["bytes"] for t in report["tensors"]} == {"f4": 2, "w": 64}
    assert report["metadata"] == {"format": "pt", "step": "3"}


def test_errors_are_one_line_and_non_zero(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    result = _cli("inspect", str(tmp_path / "bad.safetensors"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "bad.safetensors" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_shows_examples():
    result = _cli("--help")
    assert result.returncode == 0 and "orbax-safetensors inspect" in result.stdout


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(_REPO, "examples", "demo.py"), "--dir", str(tmp_path),
         "--layers", "2", "--hidden", "64", "--vocab", "512"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr
    assert "verified: all 21 tensors equal" in result.stdout
    assert "model.safetensors" in os.listdir(tmp_path / "checkpoint")


def test_consolidate_command(tmp_path):
    values = {"w": np.arange(512, dtype=np.float32).reshape(32, 16), "b": np.ones(16, np.int8)}
    ost.save(tmp_path / "dist", values, layout="distributed")
    result = _cli("consolidate", str(tmp_path / "dist"), str(tmp_path / "hf"),
                  "--max-shard-size", "1KB", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["bytes_written"] == 512 * 4 + 16
    restored = ost.load(tmp_path / "hf")
    np.testing.assert_array_equal(restored["w"], values["w"])
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    again = _cli("consolidate", str(tmp_path / "dist"), str(tmp_path / "hf"))
    assert again.returncode == 1 and "overwrite" in again.stderr


def test_progress_line_reports_throughput():
    import io

    from orbax_safetensors.engine.progress import Progress

    stream = io.StringIO()
    progress = Progress("job", 2_000_000_000, enabled=True, stream=stream)
    progress.advance(1_000_000_000)
    summary = progress.close()
    assert "job: 1.00/2.00 GB (50%)" in summary and "GB/s" in summary
    assert stream.getvalue().endswith(summary + "\n")
    quiet = io.StringIO()
    Progress("job", 10, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""

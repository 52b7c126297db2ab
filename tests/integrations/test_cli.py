"""The orbax-safetensors command, run as users run it (a subprocess)."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support import REPO

_REPO = str(REPO)


def _cli(*args, cwd=_REPO):
    return subprocess.run(
        [sys.executable, "-m", "orbax_safetensors.integrations.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd)


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
    assert result.returncode == 0
    for command in ("inspect", "verify", "consolidate", "convert"):
        assert f"  orbax-safetensors {command} " in result.stdout, command
        own = _cli(command, "--help")
        assert own.returncode == 0 and own.stderr == ""
        assert "examples:" in own.stdout and f"  orbax-safetensors {command} " in own.stdout
    assert "--overwrite" in own.stdout and "--flat" in own.stdout  # convert's
    assert not any(line.endswith(" ") for line in own.stdout.splitlines())


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(_REPO, "examples", "demo.py"), "--dir", str(tmp_path),
         "--layers", "2", "--hidden", "64", "--vocab", "512"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr
    assert "verified: all 21 tensors equal" in result.stdout
    assert "model.safetensors" in os.listdir(tmp_path / "checkpoint")


@pytest.mark.slow  # three demo runs, one interrupted
def test_demo_script_leaves_nothing_in_tmp_however_it_ends(tmp_path):
    """``scripts/demo.sh`` writes ~380 MB by default: its temporary directory must go after a
    success, a failure and a Ctrl-C. A stand-in virtualenv (its ``python`` skips ``pip``) keeps
    the script's own set-up from installing anything."""
    import signal

    venv, scratch = tmp_path / "venv", tmp_path / "tmp"
    (venv / "bin").mkdir(parents=True)
    scratch.mkdir()
    (venv / "bin" / "python").write_text(
        f'#!/usr/bin/env bash\n[ "$1 $2" = "-m pip" ] && exit 0\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    env = {**os.environ, "VENV": str(venv), "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])}
    small = ["--layers", "2", "--hidden", "64", "--vocab", "512"]

    def demo(*args, interrupt=False):
        process = subprocess.Popen(["bash", os.path.join(_REPO, "scripts", "demo.sh"), *args],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env, cwd=_REPO, start_new_session=True)
        if interrupt:
            for line in process.stdout:
                if line.startswith("model:"):  # the temporary directory is in use
                    assert os.listdir(scratch)
                    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
                    break
        out, err = process.communicate(timeout=300)
        return process.returncode, out, err

    code, out, err = demo(*small)
    assert code == 0 and "verified: all 21 tensors equal" in out, err
    assert os.listdir(scratch) == []
    code, _, err = demo("--layers", "2", "--hidden", "64", "--vocab", "-1")
    assert code != 0 and os.listdir(scratch) == [], err
    code, _, err = demo("--layers", "8", "--hidden", "1024", "--vocab", "512", interrupt=True)
    assert code != 0 and os.listdir(scratch) == [], err


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

    from orbax_safetensors.engine.core.progress import Progress

    stream = io.StringIO()
    progress = Progress("job", 2_000_000_000, enabled=True, stream=stream)
    progress.advance(1_000_000_000)
    summary = progress.close()
    assert "job: 1.00/2.00 GB (50%)" in summary and "GB/s" in summary
    assert "ETA" not in summary  # the final line has no estimate left
    assert stream.getvalue() == summary + "\n"  # no terminal: a plain line
    quiet = io.StringIO()
    Progress("job", 10, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""


def test_progress_formats():
    from orbax_safetensors.engine.core.progress import (
        Progress, format_bytes, format_rate, format_seconds, summary_line)

    assert format_bytes(999) == "999 B" and format_bytes(1_234_567) == "1.23 MB"
    assert format_rate(270_000_000) == "0.27 GB/s" and format_rate(5_000) == "0.0000050 GB/s"
    assert format_seconds(4.54) == "4.5 s" and format_seconds(125) == "2m05s"
    assert format_seconds(3725) == "1h02m"
    assert summary_line(1_230_000_000, "out", 4.5) == "wrote 1.23 GB to out in 4.5 s (0.27 GB/s)"
    progress = Progress("job", 4_000_000, enabled=False)
    progress.advance(1_000_000)
    line = progress._line(progress.started + 2.0)
    assert line == "job: 1.00/4.00 MB (25%) in 2.0 s, 0.00050 GB/s, ETA 6.0 s"


def _under_terminal(*args):
    """Runs the command with stderr on a pseudo-terminal (stdout a pipe): (code, stdout, stderr)."""
    import pty

    leader, follower = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "orbax_safetensors.integrations.cli", *args],
            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL, cwd=_REPO)
        os.close(follower)
        terminal = b""
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            terminal += data
        stdout = child.stdout.read().decode()
        code = child.wait(timeout=120)
    finally:
        os.close(leader)
    return code, stdout, terminal.decode().replace("\r\n", "\n")


def test_progress_on_a_terminal_and_quiet_in_a_pipe(tmp_path):
    values = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int8)}
    ost.save(tmp_path / "dist", values, layout="distributed")
    code, stdout, terminal = _under_terminal(
        "consolidate", str(tmp_path / "dist"), str(tmp_path / "hf"), "--block-bytes", "1KB")
    assert code == 0, terminal
    # The progress line, drawn at the start and redrawn in place, ends complete.
    assert f"\rconsolidate {tmp_path / 'dist'} -> {tmp_path / 'hf'}: 0.00/16.39 KB (0%)" in terminal
    assert "16.39/16.39 KB (100%) in " in terminal and "/s" in terminal
    assert "ETA" in terminal  # the first drawing has an estimate, the last does not
    assert terminal.endswith("\x1b[K\n")
    assert stdout.count("\n") == 1
    assert stdout.startswith(f"wrote 16.39 KB to {tmp_path / 'hf'} in ") and "/s)" in stdout

    quiet = _cli("consolidate", str(tmp_path / "dist"), str(tmp_path / "hf2"),
                 "--block-bytes", "1KB")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert quiet.stdout.count("\n") == 1 and quiet.stdout.startswith("wrote 16.39 KB to ")

    silenced = _under_terminal("consolidate", str(tmp_path / "dist"), str(tmp_path / "hf3"),
                               "--no-progress")
    assert silenced[0] == 0 and silenced[2] == ""
    as_json = _under_terminal("consolidate", str(tmp_path / "dist"), str(tmp_path / "hf4"),
                              "--json")
    assert as_json[0] == 0 and as_json[2] == ""
    assert json.loads(as_json[1])["bytes_written"] == 4096 * 4 + 7

    code, stdout, terminal = _under_terminal("verify", str(tmp_path / "hf"))
    assert code == 0 and stdout.startswith("ok: ")
    assert terminal.startswith(f"verify {tmp_path / 'hf'}: checking...")
    assert f"\rverify {tmp_path / 'hf'}: checked 1 file(s) in " in terminal


def test_convert_progress_on_a_terminal(tmp_path):
    ost.save(tmp_path / "hf", {"a.w": np.ones((32, 32), np.float32)})
    code, stdout, terminal = _under_terminal("convert", str(tmp_path / "hf"), str(tmp_path / "o"))
    assert code == 0, terminal
    assert f"\rconvert {tmp_path / 'hf'} -> {tmp_path / 'o'}: 4.10/4.10 KB (100%)" in terminal
    assert "WARNING" not in terminal  # Orbax's logging stays off the terminal
    assert stdout.startswith(f"wrote 4.10 KB to {tmp_path / 'o'} in ")
    [line] = stdout.splitlines()
    assert "1 tensors, safetensors -> orbax; restore: ocp.StandardCheckpointer().restore(" in line
    failed = _under_terminal("convert", str(tmp_path / "hf"), str(tmp_path / "o"))
    assert failed[0] == 1 and failed[1] == ""
    assert failed[2].count("\n") == 1 and "already exists" in failed[2]
    assert "Traceback" not in failed[2]


def test_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"orbax-safetensors {ost.__version__}"
    assert lines[1].startswith("Python ") and "jax " in lines[1]  # what a bug report needs


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`orbax-safetensors inspect --json CKPT | head -1`: no traceback, no error line."""
    ost.save(tmp_path / "c", {f"layers.{i}.w": np.zeros(2, np.float32) for i in range(2000)})
    child = subprocess.Popen(  # ~350 KB of JSON: far more than a pipe holds
        [sys.executable, "-m", "orbax_safetensors.integrations.cli", "inspect", "--json",
         str(tmp_path / "c")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_REPO)
    try:
        assert child.stdout.readline() == b"{\n"
        child.stdout.close()  # the reader leaves, as head does
        stderr = child.stderr.read().decode()
        code = child.wait(timeout=120)
    finally:
        child.kill()
        child.wait()
    assert "Traceback" not in stderr and stderr == ""
    assert code == 141  # as a shell reports a tool SIGPIPE ended


def test_special_files_are_named_not_missing(tmp_path):
    """A device, a FIFO (never opened: that would block) or a dangling link says what it is."""
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "gone", tmp_path / "link")
    for path, kind in (("/dev/null", "is a character device"), (str(tmp_path / "fifo"), "is a FIFO")):
        for command in ("inspect", "verify"):
            result = _cli(command, path)  # times out (fails) rather than hangs on a FIFO
            assert result.returncode == 1, result
            said = result.stderr + result.stdout
            assert kind in said and "not a regular file or directory" in said, said
            assert "does not exist" not in said and "Traceback" not in said
    for command in ("inspect", "verify"):
        result = _cli(command, str(tmp_path / "link"))
        assert result.returncode == 1
        assert f"symbolic link to {str(tmp_path / 'gone')!r}, which does not exist" in result.stderr


@pytest.mark.parametrize("argv, words", [
    (["convert", "a", "b", "--dtype", "float64"], "invalid choice: 'float64' (choose from 'float32', 'bfloat16')"),
    (["inspect"], "the following arguments are required: path"),
    (["nonsense"], "invalid choice: 'nonsense'"),
])
def test_a_bad_command_line_is_one_line_naming_the_help(argv, words):
    result = _cli(*argv)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and words in result.stderr and "--help)" in result.stderr


def test_convert_says_how_to_use_what_it_wrote(tmp_path):
    ost.save(tmp_path / "hf", {"a.w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    to_orbax = _cli("convert", str(tmp_path / "hf"), str(tmp_path / "orbax"))
    assert to_orbax.returncode == 0, to_orbax.stderr
    [line] = to_orbax.stdout.splitlines()
    assert "GB/s" in line and "B/s" not in line.replace("GB/s", "")
    assert line.endswith(f"; restore: ocp.StandardCheckpointer().restore({str(tmp_path / 'orbax')!r})")
    as_json = json.loads(_cli("convert", str(tmp_path / "orbax"), str(tmp_path / "back"), "--json").stdout)
    assert as_json["item_path"] == "" and as_json["target_format"] == "safetensors"


def test_convert_to_maxtext_prints_the_load_parameters_path(tmp_path):
    from tests.errors.test_error_tour import _llama_tensors

    ost.save(tmp_path / "hf", _llama_tensors(layers=2))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16,
        "num_hidden_layers": 2, "vocab_size": 64, "intermediate_size": 32}))
    result = _cli("convert", "hf", "mt", "--mapping", "maxtext:llama3.1", cwd=tmp_path)  # a relative dst
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    items = tmp_path / "mt" / "0" / "items"  # what MaxText's load_parameters_path reads, absolute
    assert line.endswith(f" GB/s): 12 tensors, safetensors -> orbax; MaxText: load_parameters_path={items}")
    assert (items / "_METADATA").is_file()

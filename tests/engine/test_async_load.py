"""``ost.async_load`` and the Orbax v1 async load path: planned in the call, read in the background."""

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.storage.local import LocalSnapshot
from tests.support.tolerances import assert_within, matmul_reference


@pytest.fixture
def gated_reads(monkeypatch):
    """Tensor reads wait for ``gate``; ``started`` is set by the first one (headers are not
    tensor reads: they go through ``read``, not ``read_scatter``)."""
    gate, started = threading.Event(), threading.Event()
    original = LocalSnapshot.read_scatter

    def read_scatter(self, *args):
        started.set()
        if not gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        return original(self, *args)

    monkeypatch.setattr(LocalSnapshot, "read_scatter", read_scatter)
    yield gate, started
    gate.set()


def _params():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal((32,)).astype(np.float32)}


def _target(params):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None))),
            "b": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=NamedSharding(mesh, P()))}


def test_a_compile_runs_while_the_reads_are_pending(tmp_path, gated_reads):
    gate, started = gated_reads
    params = _params()
    ost.save(tmp_path / "ckpt", params)
    target = _target(params)

    loading = ost.async_load(tmp_path / "ckpt", target)
    assert started.wait(30), "no read started in the background"
    step = jax.jit(lambda p, x: x @ p["w"] + p["b"]).lower(
        target, jax.ShapeDtypeStruct((4, 64), jnp.float32)).compile()
    assert not loading.done()  # compiled while the load was still reading
    gate.set()
    loaded = loading.result(timeout=60)

    assert loaded["w"].sharding == target["w"].sharding
    for name, value in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)  # the load: bit for bit
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    exact, atol = matmul_reference(x, params["w"], params["b"])
    assert_within(np.asarray(step(loaded, x)), exact, atol, "the compiled step")  # XLA's rounding, any CPU


def test_what_fails_before_a_read_raises_in_the_call(tmp_path, gated_reads):
    ost.save(tmp_path / "ckpt", _params())
    with pytest.raises(ost.SafetensorsError, match="missing from the checkpoint: extra"):
        ost.async_load(tmp_path / "ckpt", {**_target(None), "extra": jax.ShapeDtypeStruct((1,), jnp.float32)})
    with pytest.raises(FileNotFoundError):
        ost.async_load(tmp_path / "nothing-here", _target(None))
    assert not gated_reads[1].is_set()


def test_a_failed_read_raises_from_the_future_naming_the_file(tmp_path, monkeypatch):
    ost.save(tmp_path / "ckpt", _params())

    def failing(self, path, offset, buffers):
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(LocalSnapshot, "read_scatter", failing)
    loading = ost.async_load(tmp_path / "ckpt", _target(None))
    with pytest.raises(OSError) as raised:
        loading.result(timeout=60)
    assert raised.value.errno == 5 and "model.safetensors" in str(raised.value.filename)


def test_stats_and_host_arrays(tmp_path):
    params = _params()
    ost.save(tmp_path / "ckpt", params)
    stats = ost.LoadStats()
    loaded = ost.async_load(tmp_path / "ckpt", stats=stats).result(timeout=60)
    assert sorted(loaded) == ["b", "w"] and np.array_equal(loaded["w"], params["w"])
    assert stats.bytes_needed == params["w"].nbytes + params["b"].nbytes


def test_the_orbax_v1_layout_returns_once_planned(tmp_path, gated_reads):
    gate, started = gated_reads
    params = _params()
    ost.save(tmp_path / "ckpt", params)
    target = _target(params)

    async def main():
        layout = ost.SafetensorsLayout()
        loading = await layout.load(tmp_path / "ckpt", abstract_state=target)
        assert started.wait(30)  # reading in the background, before anyone awaits the result
        gate.set()
        return await loading

    loaded = asyncio.run(main())
    np.testing.assert_array_equal(np.asarray(loaded["w"]), params["w"])


_ABANDONING_SCRIPT = """
import sys, time
import numpy as np
import orbax_safetensors as ost
from orbax_safetensors.storage.local import LocalSnapshot

ost.save(sys.argv[1], {f"t{i}": np.full((1024,), i, np.float32) for i in range(100)})
original = LocalSnapshot.read_scatter

def slow(self, *args):
    time.sleep(0.5)  # 100 requests of 4 KiB one at a time: a 50 s load
    return original(self, *args)

LocalSnapshot.read_scatter = slow
loading = ost.async_load(sys.argv[1], options=ost.LoadOptions(threads=1, chunk_bytes=4096))
print("planned", flush=True)
raise KeyboardInterrupt  # as a Ctrl-C while the caller did something else
"""


@pytest.mark.slow
def test_a_background_load_nobody_waits_for_does_not_hold_the_exit(tmp_path):
    import subprocess
    import sys
    import time

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _ABANDONING_SCRIPT, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert "planned" in done.stdout and "KeyboardInterrupt" in done.stderr, done.stderr[-2000:]
    assert took < 30, f"the exit waited {took:.0f} s for a load nobody will take"

"""The optional peers of the load benchmarks (``bench/peers.py``) load exactly what we saved.

A benchmark row is only worth its number if the peer returned the right arrays in the
right shardings: every loader is checked bitwise, shard by shard, on a checkpoint we
wrote, locally and (Run:ai) from a moto S3 server. Skipped without the ``bench-peers``
extra.
"""

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("runai_model_streamer")
pytest.importorskip("fastsafetensors")

import fsspec  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import orbax_safetensors as ost  # noqa: E402
from bench import peers  # noqa: E402
from tests.support.object_stores import object_store_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(7)
    tensors = {
        "embed": rng.standard_normal((512, 384)).astype(ml_dtypes.bfloat16),
        "proj": rng.standard_normal((256, 64)).astype(np.float32),
        "codes": rng.integers(-128, 127, (64, 8), dtype=np.int8),
        "norm": rng.standard_normal((384,)).astype(ml_dtypes.bfloat16),
    }
    directory = tmp_path_factory.mktemp("peers") / "ckpt"
    ost.save(directory, tensors, max_shard_size="300KB")
    assert (directory / "model.safetensors.index.json").exists()
    return directory, tensors


def _target(tensors, spec):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {name: jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype), sharding=NamedSharding(
        mesh, spec if x.ndim == 2 else P())) for name, x in tensors.items()}


def _check(result, target, tensors):
    assert set(result) == set(target)
    for name, want in target.items():
        got = result[name]
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        for shard in got.addressable_shards:
            expected = tensors[name][shard.index]
            assert np.asarray(shard.data).tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=["rows", "columns", "replicated"])
@pytest.mark.parametrize("peer", ["runai", "fastsafetensors"])
def test_a_peer_loads_our_checkpoint_bitwise(checkpoint, peer, spec):
    directory, tensors = checkpoint
    target = _target(tensors, spec)
    peers.prepare(peer)
    _check(peers.LOADERS[peer](directory, target, {}), target, tensors)


def test_runai_loads_it_from_s3(checkpoint, monkeypatch):
    directory, tensors = checkpoint
    with object_store_server("s3") as (bucket, env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for name in peers.runai_s3_env("http://unused"):
            monkeypatch.setenv(name, "")  # what configure_runai_s3 sets goes back afterwards
            monkeypatch.delenv(name)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        for path in directory.iterdir():
            fs.put_file(str(path), f"{bucket}/ckpt/{path.name}")
        target = _target(tensors, P("x", None))
        peers.prepare("runai_s3")
        _check(peers.load_runai_s3(f"{bucket}/ckpt", target, {}), target, tensors)

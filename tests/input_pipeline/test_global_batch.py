"""Host-local numpy batches become globally sharded jax.Arrays."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from input_pipeline import to_global_batch


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2, 1), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)


def _local_batch(b=16):
    rng = np.random.default_rng(0)
    return {
        "image": rng.normal(size=(b, 8, 6, 3)).astype(np.float32),
        "boxes": rng.uniform(0, 8, size=(b, 4, 4)).astype(np.float32),
        "labels": rng.integers(-1, 4, size=(b, 4)).astype(np.int32),
        "image_id": np.arange(b, dtype=np.int32),
        "example_mask": rng.random(b) < 0.5,
    }


def test_global_batch_is_sharded_over_data_and_fsdp(mesh):
    local = _local_batch()
    out = to_global_batch(local, mesh, ("data", "fsdp"))
    assert set(out) == set(local)
    for key, x in out.items():
        assert isinstance(x, jax.Array)
        # One process: the global batch is the local batch.
        assert x.shape == local[key].shape and x.dtype == local[key].dtype
        assert x.sharding.mesh.shape == mesh.shape
        assert x.sharding.spec == PartitionSpec(("data", "fsdp"))
        np.testing.assert_array_equal(np.asarray(x), local[key])
        # 8 devices, each holding its own 2 rows of the batch.
        shards = x.addressable_shards
        assert len(shards) == 8
        starts = sorted(s.index[0].start for s in shards)
        assert starts == list(range(0, 16, 2))
        for s in shards:
            assert s.data.shape == (2, *local[key].shape[1:])
            np.testing.assert_array_equal(np.asarray(s.data), local[key][s.index])


def test_data_axis_only_replicates_over_fsdp(mesh):
    local = _local_batch(8)
    out = to_global_batch(local, mesh, ("data",))
    x = out["image"]
    assert x.sharding.spec == PartitionSpec(("data",))
    shapes = {s.data.shape for s in x.addressable_shards}
    assert shapes == {(2, 8, 6, 3)}
    # Each quarter of the batch lives on the 2 devices of one fsdp pair.
    starts = sorted(s.index[0].start for s in x.addressable_shards)
    assert starts == [0, 0, 2, 2, 4, 4, 6, 6]
    np.testing.assert_array_equal(np.asarray(x), local["image"])


def test_batch_must_split_evenly(mesh):
    with pytest.raises(ValueError):
        to_global_batch({"x": np.zeros((6, 2), np.float32)}, mesh, ("data", "fsdp"))
    with pytest.raises(ValueError, match="leading batch dimension"):
        to_global_batch({"x": np.float32(1.0)}, mesh, ("data", "fsdp"))

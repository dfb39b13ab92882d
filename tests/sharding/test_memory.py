import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from sharding import memory


def _compiled_matmul(spec):
    mesh = sharding.create_mesh(dict(data=-1, fsdp=1, model=1))
    weight_sharding = NamedSharding(mesh, spec)
    f = jax.jit(lambda w, x: x @ w, in_shardings=(weight_sharding, NamedSharding(mesh, P())))
    return f.lower(
        jax.ShapeDtypeStruct((1024, 512), jnp.float32), jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    ).compile()


def test_memory_report_counts_sharded_arguments_per_device():
    replicated = memory.memory_report(_compiled_matmul(P()))
    sharded = memory.memory_report(_compiled_matmul(P(None, "data")))
    weight_bytes = 1024 * 512 * 4
    assert replicated.argument_bytes >= weight_bytes
    # The weight split 8 ways: each device holds an eighth.
    assert sharded.argument_bytes < replicated.argument_bytes / 4
    assert sharded.total_bytes > 0
    assert "per-device memory" in sharded.describe()


def test_check_fits_names_the_fix():
    report = memory.MemoryReport(argument_bytes=3 * 2**30, output_bytes=2**30, temp_bytes=2**30, alias_bytes=2**30)
    assert report.total_bytes == 4 * 2**30
    memory.check_fits(report, 5 * 2**30)
    memory.check_fits(report, None)  # unknown capacity (CPU): nothing to check
    with pytest.raises(sharding.MeshError, match="needs 4.00 GiB per device .*raise mesh.fsdp or mesh.model"):
        memory.check_fits(report, 2 * 2**30)

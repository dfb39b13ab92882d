"""Host-local numpy batch -> globally sharded jax.Array batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sharding.partitioning import batch_sharding


def to_global_batch(
    local_batch: dict[str, Any], mesh: Mesh, batch_axes: Sequence[str] = ("data", "fsdp")
) -> dict[str, jax.Array]:
    """Assembles every process's local batch into one global batch.

    Args:
      local_batch: pytree (usually a flat dict) of numpy arrays [b, ...], where
        b = global batch // process count.
      mesh: the device mesh.
      batch_axes: mesh axes the batch dimension is split over, e.g.
        ('data', 'fsdp').

    Returns:
      Same pytree of jax.Arrays [b * process_count, ...] sharded as
      PartitionSpec(batch_axes) on dim 0.
    """
    sharding = batch_sharding(mesh, batch_axes)

    def put(x):
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("batch arrays need a leading batch dimension")
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(put, local_batch)


def process_rows(sharding: NamedSharding, global_batch_size: int) -> int:
    """First row of every global batch that this process's devices hold.

    The input pipeline reads exactly those rows, so a process must hold one
    contiguous block of them (true for meshes built by `sharding.create_mesh`,
    whose device order groups each host's devices).

    Raises:
      ValueError: the process's rows are not one contiguous block.
    """
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch_size,)).values():
        rows.update(range(*index[0].indices(global_batch_size)))
    first, count = min(rows), len(rows)
    if rows != set(range(first, first + count)):
        raise ValueError(
            f"process {jax.process_index()} holds rows {sorted(rows)} of the "
            "global batch, not one contiguous block; build the mesh with "
            "sharding.create_mesh so each host's devices are adjacent"
        )
    return first

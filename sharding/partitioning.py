"""Logical-axis rules -> `NamedSharding`s for parameters, optimizer state and batches.

Modules name the axes of their parameters and activations (`'conv_out'`,
`'batch'`, `'height'`, ...); `config.sharding.rules` maps those names to mesh
axes. Changing a rule changes the partitioning, never the code.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import MESH_AXES, MeshError

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


# With spatial partitioning, conv activations split their height over `model`
# and keep whole channels, so conv kernels must not be split over `model`.
SPATIAL_PARTITIONING_RULES: LogicalRules = (
    ("height", "model"),
    ("channels", None),
    ("conv_out", "fsdp"),
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: LogicalRules):
    """Makes `mesh` and the logical-axis `rules` current: what initialising, tracing and compiling a
    logically partitioned Linen module needs (bare `PartitionSpec` constraints resolve against the mesh)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_rules(sharding_config) -> LogicalRules:
    """Validates and returns `config.sharding.rules` as a tuple of (logical, mesh axes).

    `sharding_config.spatial_partitioning` replaces the rules for the names in
    SPATIAL_PARTITIONING_RULES.
    """
    configured = tuple(sharding_config.rules)
    if sharding_config.spatial_partitioning:
        overridden = dict(SPATIAL_PARTITIONING_RULES)
        configured = tuple(SPATIAL_PARTITIONING_RULES) + tuple(r for r in configured if r[0] not in overridden)
    rules = []
    for rule in configured:
        if len(rule) != 2:
            raise MeshError(f"sharding rule {rule!r} must be a pair (logical_axis, mesh_axes)")
        logical, mesh_axes = rule
        axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise MeshError(
                f"sharding rule for {logical!r} names mesh axis {unknown[0]!r}; mesh axes are {', '.join(MESH_AXES)}"
            )
        rules.append((logical, mesh_axes if mesh_axes is None or isinstance(mesh_axes, str) else tuple(mesh_axes)))
    return tuple(rules)


def _fit_spec_to_shape(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> tuple[PartitionSpec, bool]:
    """Drops mesh axes from dimensions they do not divide (e.g. a 3-channel stem input).

    XLA would pad such dimensions; replicating the odd small tensor instead is
    cheaper and keeps every shard the same size.
    """
    fitted, changed = [], False
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            fitted.append(None)
            continue
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        for axis in axes_tuple:
            if dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]) == 0:
                kept.append(axis)
            else:
                changed = True
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fitted), changed


def mesh_sharding_for_logical_specs(abstract_tree: Any, logical_specs: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for `abstract_tree` (ShapeDtypeStructs) from its logical specs.

    Args:
      abstract_tree: pytree of arrays or ShapeDtypeStructs.
      logical_specs: matching pytree of logical `PartitionSpec`s (from
        `nn.get_partition_spec`); `None` or `PartitionSpec()` means replicated.
      mesh: the device mesh.
      rules: logical -> mesh axis rules.
    """
    mesh_specs = nn.logical_to_mesh(logical_specs, rules)
    replicated_dims = 0

    def to_sharding(x, spec):
        nonlocal replicated_dims
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
        spec, changed = _fit_spec_to_shape(spec, x.shape, mesh)
        replicated_dims += changed
        return NamedSharding(mesh, spec)

    shardings = jax.tree.map(
        to_sharding, abstract_tree, mesh_specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
    )
    if replicated_dims:
        logging.info("%d arrays keep a dimension replicated that the mesh does not divide", replicated_dims)
    return shardings


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, batch_axes: Sequence[str]) -> NamedSharding:
    """Sharding of arrays whose leading dimension is the global batch.

    Dim 0 is split over `batch_axes` (e.g. ('data', 'fsdp')); the other dims are replicated.
    """
    return NamedSharding(mesh, PartitionSpec(tuple(batch_axes)))

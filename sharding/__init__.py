"""Device mesh, logical-axis rules and shardings for the detector.

Data parallelism and model parallelism are one mechanism here: every array
carries a `NamedSharding` on a `('data', 'fsdp', 'model')` mesh, derived from
logical axis names and the rules in `config.sharding.rules`.
"""

from sharding.mesh import (
    MESH_AXES,
    MeshError,
    batch_axes,
    check_global_batch,
    create_mesh,
    resolve_mesh_shape,
    split_global_batch,
)
from sharding.partitioning import (
    LogicalRules,
    batch_sharding,
    logical_rules,
    mesh_sharding_for_logical_specs,
    replicated,
    use_mesh,
)

__all__ = [
    "LogicalRules",
    "MESH_AXES",
    "MeshError",
    "batch_axes",
    "batch_sharding",
    "check_global_batch",
    "create_mesh",
    "logical_rules",
    "mesh_sharding_for_logical_specs",
    "replicated",
    "resolve_mesh_shape",
    "split_global_batch",
    "use_mesh",
]

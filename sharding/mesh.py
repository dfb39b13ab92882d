"""Building the `('data', 'fsdp', 'model')` device mesh from `config.mesh`."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "model")
# The global batch is split over these axes: `fsdp` shards parameters *and*
# batch (ZeRO-3), `model` holds replicas of the same examples.
BATCH_AXES = ("data", "fsdp")


class MeshError(ValueError):
    """The configured mesh or batch does not fit the available devices."""


def resolve_mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Returns (data, fsdp, model) sizes; at most one of them may be -1 (fills the rest)."""
    sizes = [int(mesh_config[name]) for name in MESH_AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    bad = [f"mesh.{MESH_AXES[i]}={s}" for i, s in enumerate(sizes) if s == 0 or s < -1]
    if bad:
        raise MeshError(
            f"{', '.join(bad)} is not a valid axis size; use a positive size or -1 to fill the remaining devices"
        )
    if len(fill) > 1:
        names = ", ".join(f"mesh.{MESH_AXES[i]}" for i in fill)
        raise MeshError(f"{names} are all -1; at most one mesh axis may be -1 (it takes the devices the others leave)")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if num_devices % known:
            raise MeshError(
                f"mesh {_describe(sizes)} cannot fill {num_devices} devices: {num_devices} is not divisible by "
                f"{known}; choose axis sizes whose product divides {num_devices}"
            )
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise MeshError(
            f"mesh {_describe(sizes)} needs {math.prod(sizes)} devices but {num_devices} are available; "
            f"set the axis sizes so their product is {num_devices} (or set one of them to -1)"
        )
    return tuple(sizes)


def _describe(sizes: Sequence[int]) -> str:
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, sizes)) + ")"


def create_mesh(mesh_config: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Creates the mesh with Auto axes (Linen logical constraints need GSPMD-style axes).

    On several processes the `data` axis is laid across hosts and `fsdp`/`model`
    inside a host, so the bandwidth-hungry axes stay on the fast interconnect.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_config, len(devices))
    num_processes = len({d.process_index for d in devices})
    device_array = None
    if num_processes > 1 and shape[0] % num_processes == 0:
        per_host = (shape[0] // num_processes, shape[1], shape[2])
        try:
            device_array = mesh_utils.create_hybrid_device_mesh(
                per_host, (num_processes, 1, 1), devices, process_is_granule=True
            )
        except (ValueError, AssertionError, NotImplementedError) as e:
            logging.warning("hybrid mesh unavailable (%s); using a flat device order", e)
    if device_array is None:
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, AssertionError, NotImplementedError) as e:
            logging.warning("topology-aware mesh unavailable (%s); using a flat device order", e)
            device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over."""
    del mesh  # The same for every mesh today; kept as a function of it for callers.
    return BATCH_AXES


def split_global_batch(global_batch_size: int, parts: int, over: str) -> int:
    """The rows of a global batch each of `parts` equal parts holds: global_batch_size // parts.

    The one divisibility check of a global batch, over devices or processes.

    Args:
      global_batch_size: examples per global batch.
      parts: how many equal parts it is split into (devices, processes).
      over: what the parts are, for the message, e.g. "4 processes".

    Raises:
      MeshError: global_batch_size is not a positive multiple of `parts`; the
        one-line message names a valid size.
    """
    if global_batch_size <= 0 or global_batch_size % parts:
        raise MeshError(
            f"global_batch_size={global_batch_size} does not divide over {over}; use a multiple of {parts} "
            f"(e.g. --config.global_batch_size={parts * max(1, global_batch_size // parts)})"
        )
    return global_batch_size // parts


def check_global_batch(global_batch_size: int, mesh: Mesh) -> int:
    """Returns the per-device batch; raises MeshError when the batch does not divide over devices or processes."""
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    per_device = split_global_batch(global_batch_size, shards, f"the batch axes data x fsdp = {shards} devices")
    processes = jax.process_count()
    split_global_batch(global_batch_size, processes, f"{processes} processes")
    return per_device

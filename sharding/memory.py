"""Per-device memory of a compiled step, from XLA's own accounting."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from sharding.mesh import MeshError


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of one compiled executable (`compiled.memory_analysis()`)."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # outputs that reuse donated argument buffers

    @property
    def total_bytes(self) -> int:
        # Donated (aliased) outputs live in their argument's buffer: count once.
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def describe(self) -> str:
        gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
        return (
            f"per-device memory: total {gib(self.total_bytes)} = arguments {gib(self.argument_bytes)}"
            f" + outputs {gib(self.output_bytes)} + temporaries {gib(self.temp_bytes)}"
            f" - aliased {gib(self.alias_bytes)}"
        )


def memory_report(compiled: Any) -> MemoryReport | None:
    """Reads `compiled.memory_analysis()`; None where the backend does not report it."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return MemoryReport(
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        temp_bytes=int(analysis.temp_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
    )


def device_memory_limit_bytes(device: jax.Device | None = None) -> int | None:
    """The accelerator's usable bytes, or None where the backend does not say (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_fits(report: MemoryReport | None, limit_bytes: int | None) -> None:
    """Raises MeshError before the first step when the compiled step cannot fit."""
    if report is None or limit_bytes is None or report.total_bytes <= limit_bytes:
        return
    raise MeshError(
        f"the train step needs {report.total_bytes / 2**30:.2f} GiB per device but the device has "
        f"{limit_bytes / 2**30:.2f} GiB; shard more (raise mesh.fsdp or mesh.model), lower "
        f"global_batch_size, set model.remat=full or model.dtype=bfloat16 "
        f"(`python -m detector.plan --config=... --devices=N` finds a split that fits)"
    )


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded arrays or `ShapeDtypeStruct`s.

    Counts each leaf's shard shape (the full shape where a leaf carries no
    sharding), so replicated leaves count in full on every device.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        leaf_sharding = getattr(leaf, "sharding", None)
        shape = leaf_sharding.shard_shape(leaf.shape) if leaf_sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total

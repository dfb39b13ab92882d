"""Per-device accounting of a compiled train step, and the search for a mesh split that fits.

Model-agnostic: a `StepPlan` is read off any compiled `(state, batch) -> ...`
step (XLA's memory analysis, cost analysis and the collectives of its HLO),
and `search_fitting_mesh` tries (data, fsdp, model) splits through a compile
function the caller passes in. `python -m detector.plan` is the command that
compiles the detector's step with it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from sharding.collectives import COLLECTIVE_KINDS, Collective, CollectiveSummary, parse_collectives, summarize
from sharding.memory import MemoryReport, memory_report, per_device_bytes
from sharding.mesh import MESH_AXES, MeshError
from sharding.tables import markdown_table

GB = 10**9


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one device holds and moves for one compiled train step. Bytes are per device."""

    mesh_shape: dict[str, int]
    global_batch_size: int
    params_bytes: int
    opt_state_bytes: int
    # The gradients the step computes: of the trained parameters only (part of the temporaries).
    gradient_bytes: int
    batch_bytes: int
    memory: MemoryReport  # XLA's accounting of the whole step
    flops: float  # per device per step, from cost_analysis()
    collectives: list[Collective]  # every collective of the step, with its executions per step
    compile_seconds: float

    @property
    def collective_summary(self) -> dict[str, CollectiveSummary]:
        """Executions and bytes per step for each kind in COLLECTIVE_KINDS."""
        return summarize(self.collectives)

    @property
    def total_bytes(self) -> int:
        return self.memory.total_bytes

    def fits(self, limit_bytes: int) -> bool:
        return self.total_bytes <= limit_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh_shape,
            "global_batch_size": self.global_batch_size,
            "per_device_bytes": {
                "params": self.params_bytes,
                "optimizer_state": self.opt_state_bytes,
                "gradients": self.gradient_bytes,
                "batch": self.batch_bytes,
                "arguments": self.memory.argument_bytes,
                "outputs": self.memory.output_bytes,
                "temporaries": self.memory.temp_bytes,
                "aliased": self.memory.alias_bytes,
                "total": self.total_bytes,
            },
            "flops_per_device": self.flops,
            "collectives": {k: dataclasses.asdict(v) for k, v in self.collective_summary.items()},
            "compile_seconds": self.compile_seconds,
        }


def plan_from_compiled(
    compiled: Any,
    abstract_state: Any,
    abstract_batch: Any,
    mesh_shape: dict[str, int],
    global_batch_size: int,
    compile_seconds: float = 0.0,
    *,
    trained_params: Any = None,
) -> StepPlan:
    """Reads memory, FLOPs and collectives off a compiled `(state, batch) -> ...` step.

    `trained_params`: the part of `abstract_state.params` the step
    differentiates (default: all), whose gradients it holds.
    """
    report = memory_report(compiled)
    if report is None:
        raise MeshError("this backend reports no memory analysis; plan on CPU (JAX_PLATFORMS=cpu)")
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per program
        cost = cost[0] if cost else {}
    return StepPlan(
        mesh_shape=dict(mesh_shape),
        global_batch_size=global_batch_size,
        params_bytes=per_device_bytes(abstract_state.params),
        opt_state_bytes=per_device_bytes(abstract_state.opt_state),
        gradient_bytes=per_device_bytes(abstract_state.params if trained_params is None else trained_params),
        batch_bytes=per_device_bytes(abstract_batch),
        memory=report,
        flops=float((cost or {}).get("flops", 0.0)),
        collectives=parse_collectives(compiled.as_text()),
        compile_seconds=compile_seconds,
    )


def candidate_meshes(num_devices: int, global_batch_size: int, max_model: int = 8) -> list[tuple[int, int, int]]:
    """(data, fsdp, model) splits in the order to try them: least model parallelism first.

    Ordered by fsdp x model (the communication a split adds grows with it),
    then by model (FSDP's gathers overlap with compute; tensor parallelism's
    all-reduces sit on the critical path). Every split keeps the global batch
    divisible over data x fsdp and `model` within `max_model` (one host's
    fast interconnect).
    """
    candidates = []
    for fsdp, model in itertools.product(_divisors(num_devices), repeat=2):
        if num_devices % (fsdp * model) or model > max_model:
            continue
        data = num_devices // (fsdp * model)
        if global_batch_size % (data * fsdp):
            continue
        candidates.append((data, fsdp, model))
    return sorted(candidates, key=lambda s: (s[1] * s[2], s[2]))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_mesh_shape(config, shape: tuple[int, int, int]):
    """A copy of `config` with `mesh` set to (data, fsdp, model) = `shape`."""
    config = config.copy_and_resolve_references()
    for axis, size in zip(MESH_AXES, shape):
        config.mesh[axis] = size
    return config


def search_fitting_mesh(
    config,
    limit_bytes: int,
    plan_step: Callable[[Any, Any], StepPlan],
    devices=None,
    max_model: int = 8,
    tried: list[StepPlan] | None = None,
    max_candidates: int | None = None,
) -> StepPlan | None:
    """The first `candidate_meshes` split whose train step fits `limit_bytes`, or None.

    `plan_step(config, devices)` compiles the step of a config (its `mesh`
    set to a candidate split) on `devices` and returns its StepPlan; this
    module never sees the model. Considers at most `max_candidates` splits
    (each is a full compile). Plans already in `tried` are reused, not
    recompiled; every new one is appended.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    tried = [] if tried is None else tried
    candidates = candidate_meshes(len(devices), config.global_batch_size, max_model)
    for shape in candidates[:max_candidates]:
        plan = next((p for p in tried if _shape(p) == shape), None)
        if plan is None:
            plan = plan_step(with_mesh_shape(config, shape), devices)
            tried.append(plan)
        if plan.fits(limit_bytes):
            return plan
    return None


def _shape(plan: StepPlan) -> tuple[int, int, int]:
    return tuple(plan.mesh_shape[a] for a in MESH_AXES)


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / GB:.2f}"


def format_table(plans: list[StepPlan], limit_bytes: int | None = None) -> str:
    """A markdown table, one row per plan; byte columns in GB (10^9) per device."""
    header = [
        "mesh (data, fsdp, model)",
        "batch/device",
        "params GB",
        "opt state GB",
        "grads GB",
        "batch GB",
        "temps GB",
        "total GB",
        "TFLOP/step",
    ]
    header += [f"{kind} GB" for kind in COLLECTIVE_KINDS]
    if limit_bytes is not None:
        header.append(f"fits {limit_bytes / GB:g} GB")
    rows = []
    for p in plans:
        shape = _shape(p)
        per_device_batch = p.global_batch_size / (shape[0] * shape[1])
        row = [
            str(shape),
            f"{per_device_batch:g}",
            _gb(p.params_bytes),
            _gb(p.opt_state_bytes),
            _gb(p.gradient_bytes),
            _gb(p.batch_bytes),
            _gb(p.memory.temp_bytes),
            _gb(p.total_bytes),
            f"{p.flops / 1e12:.2f}",
        ]
        summary = p.collective_summary
        row += [_gb(summary[kind].bytes) for kind in COLLECTIVE_KINDS]
        if limit_bytes is not None:
            row.append("yes" if p.fits(limit_bytes) else "no")
        rows.append(row)
    return markdown_table(header, rows)

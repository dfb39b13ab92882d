"""Plan a run before launching it: per-device memory, FLOPs and communication of the train step.

    python -m sharding.plan --config=configs/vitdet_h_coco.py --devices=64 \
        [--config.mesh.model=8] [--device_memory_gb=80] [--json=OUT]

Compiles the config's train step ahead of time for `--devices` fake CPU
devices (nothing is allocated or run) and prints, per device: parameter,
optimizer-state and batch bytes, XLA's temporaries and total, FLOPs per step,
and the bytes each collective kind moves per step (parsed from the compiled
HLO). It says whether the step fits `--device_memory_gb` and, when the
configured mesh does not, compiles larger fsdp/model splits until one fits
and names it. The trainer runs the same accounting on its real devices and
refuses a step that will not fit before the first step.

Numbers come from XLA's CPU compiler. GPU compilers schedule and fuse
differently, so treat the totals as estimates within tens of percent; the
ratios between meshes are what the CPU plan measures well.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from typing import Any

from sharding.collectives import COLLECTIVE_KINDS, Collective, CollectiveSummary, parse_collectives, summarize
from sharding.memory import MemoryReport, memory_report, per_device_bytes
from sharding.mesh import MESH_AXES, MeshError

GB = 10**9


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one device holds and moves for one compiled train step. Bytes are per device."""

    mesh_shape: dict[str, int]
    global_batch_size: int
    params_bytes: int
    opt_state_bytes: int
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


def plan_from_compiled(compiled: Any, abstract_state: Any, abstract_batch: Any, mesh_shape: dict[str, int],
                       global_batch_size: int, compile_seconds: float = 0.0) -> StepPlan:
    """Reads memory, FLOPs and collectives off a compiled `(state, batch) -> ...` step."""
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
        batch_bytes=per_device_bytes(abstract_batch),
        memory=report,
        flops=float((cost or {}).get("flops", 0.0)),
        collectives=parse_collectives(compiled.as_text()),
        compile_seconds=compile_seconds,
    )


def plan_train_step(config, devices=None) -> StepPlan:
    """Compiles `config`'s train step on `devices` (default: all) and accounts for it.

    Reads no data: the number of classes comes from the dataset's registry entry.
    """
    import flax.linen as nn
    import jax

    import sharding
    from detector import optim, steps
    from detector.retinanet import create_model
    from input_pipeline import datasets

    mesh = sharding.create_mesh(config.mesh, devices)
    rules = sharding.logical_rules(config.sharding)
    sharding.check_global_batch(config.global_batch_size, mesh)
    num_classes = len(datasets.class_names(config))
    model = create_model(config.model, num_classes, steps.num_anchors_per_location(config))
    tx, schedule = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
    start = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compiled, abstract_state, _ = steps.compile_train_step(
            config, model, tx, schedule, num_classes=num_classes, mesh=mesh, rules=rules)
    seconds = time.perf_counter() - start
    batch = steps.abstract_batch(config, config.global_batch_size,
                                 sharding.batch_sharding(mesh, sharding.batch_axes(mesh)))
    return plan_from_compiled(compiled, abstract_state, batch, dict(mesh.shape), config.global_batch_size, seconds)


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


def search_fitting_mesh(config, limit_bytes: int, devices=None, max_model: int = 8,
                        tried: list[StepPlan] | None = None, max_candidates: int | None = None) -> StepPlan | None:
    """The first `candidate_meshes` split whose train step fits `limit_bytes`, or None.

    Considers at most `max_candidates` splits (each is a full compile). Plans
    already in `tried` are reused, not recompiled; every new one is appended.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    tried = [] if tried is None else tried
    candidates = candidate_meshes(len(devices), config.global_batch_size, max_model)
    for shape in candidates[:max_candidates]:
        plan = next((p for p in tried if _shape(p) == shape), None)
        if plan is None:
            plan = plan_train_step(with_mesh_shape(config, shape), devices)
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
    header = ["mesh (data, fsdp, model)", "batch/device", "params GB", "opt state GB", "batch GB",
              "temps GB", "total GB", "TFLOP/step"]
    header += [f"{kind} GB" for kind in COLLECTIVE_KINDS]
    if limit_bytes is not None:
        header.append(f"fits {limit_bytes / GB:g} GB")
    rows = []
    for p in plans:
        shape = _shape(p)
        per_device_batch = p.global_batch_size / (shape[0] * shape[1])
        row = [str(shape), f"{per_device_batch:g}", _gb(p.params_bytes), _gb(p.opt_state_bytes),
               _gb(p.batch_bytes), _gb(p.memory.temp_bytes), _gb(p.total_bytes), f"{p.flops / 1e12:.2f}"]
        summary = p.collective_summary
        row += [_gb(summary[kind].bytes) for kind in COLLECTIVE_KINDS]
        if limit_bytes is not None:
            row.append("yes" if p.fits(limit_bytes) else "no")
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    del argv
    import os

    from detector.cli import use_fake_cpu_devices

    # Checked before minutes of compiling, not after.
    if _JSON.value and not os.path.isdir(os.path.dirname(os.path.abspath(_JSON.value))):
        raise FileNotFoundError(f"--json={_JSON.value}: its directory does not exist; create it or pick another path")

    use_fake_cpu_devices(_DEVICES.value)
    import jax

    if len(jax.devices()) != _DEVICES.value:
        raise MeshError(f"JAX started with {len(jax.devices())} devices before the plan could ask for "
                        f"{_DEVICES.value}; run the plan as its own process")
    config = _CONFIG.value
    limit = int(_DEVICE_MEMORY_GB.value * GB)
    plans = [plan_train_step(config)]
    print(f"# {_CONFIG_PATH()} on {_DEVICES.value} devices, global batch {config.global_batch_size}, "
          f"{config.input.image_size[0]}x{config.input.image_size[1]} px, model.dtype={config.model.dtype}, "
          f"model.remat={config.model.remat}")
    fitting = plans[0] if plans[0].fits(limit) else None
    if fitting is None and _SEARCH.value:
        fitting = search_fitting_mesh(config, limit, max_model=_MAX_MODEL.value, tried=plans,
                                      max_candidates=_MAX_CANDIDATES.value)
    print(format_table(plans, limit))
    configured = plans[0]
    verdict = "fits" if configured.fits(limit) else "does NOT fit"
    print(f"\nconfigured mesh {configured.mesh_shape}: {_gb(configured.total_bytes)} GB per device, "
          f"{verdict} in {_DEVICE_MEMORY_GB.value:g} GB")
    if fitting is not None and fitting is not configured:
        m = fitting.mesh_shape
        print(f"smallest split that fits: --config.mesh.data={m['data']} --config.mesh.fsdp={m['fsdp']} "
              f"--config.mesh.model={m['model']} ({_gb(fitting.total_bytes)} GB per device)")
    elif fitting is None and not _SEARCH.value:
        print("not searching other splits (--nosearch)")
    elif fitting is None:
        print(f"none of the {len(plans)} splits tried fits (--max_model={_MAX_MODEL.value}, "
              f"--max_candidates={_MAX_CANDIDATES.value}); set model.remat=full, use model.dtype=bfloat16, "
              "lower global_batch_size, or add devices")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"config": _CONFIG_PATH(), "devices": _DEVICES.value, "device_memory_bytes": limit,
                       "plans": [p.to_json() for p in plans],
                       "fitting_mesh": fitting.mesh_shape if fitting is not None else None}, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/X.py).", lock_config=True)
    _DEVICES = flags.DEFINE_integer("devices", 8, "Target number of devices (simulated on the CPU).",
                                    lower_bound=1)
    _DEVICE_MEMORY_GB = flags.DEFINE_float("device_memory_gb", 80.0, "Memory per device, in GB (10^9 bytes).")
    _SEARCH = flags.DEFINE_bool("search", True, "When the configured mesh does not fit, search fsdp/model splits.")
    _MAX_MODEL = flags.DEFINE_integer("max_model", 8, "Largest `model` axis the search tries (devices per host).")
    _MAX_CANDIDATES = flags.DEFINE_integer("max_candidates", 8, "Most splits the search compiles.",
                                           lower_bound=1)
    _JSON = flags.DEFINE_string("json", None, "Also write the plans as JSON to this path.")
    _CONFIG_PATH = lambda: flags.FLAGS["config"].config_filename  # noqa: E731
    flags.mark_flags_as_required(["config"])

    from detector.cli import run

    run(main)

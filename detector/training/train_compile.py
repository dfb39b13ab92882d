"""The detector's train step, compiled ahead of time for accounting: what `python -m detector.plan` runs.

The trainer runs the same accounting on its real devices before the first
step (`log_step_plan`) and refuses a step that will not fit.
"""

from __future__ import annotations

import json
import sys
import time

from absl import logging

import sharding
from detector.training import steps
from detector.training.run import Run, create_run
from detector.training.train_state import select_params
from input_pipeline import datasets
from sharding import memory
from sharding.step_plan import GB, StepPlan, format_table, plan_from_compiled, search_fitting_mesh


def plan_train_step(config, devices=None) -> StepPlan:
    """Compiles `config`'s train step on `devices` (default: all) and accounts for it.

    Reads no data: the number of classes comes from the dataset's registry entry.
    """
    mesh = sharding.create_mesh(config.mesh, devices)
    sharding.check_global_batch(config.global_batch_size, mesh)
    run = create_run(config, len(datasets.class_names(config)), mesh, training=True)
    start = time.perf_counter()
    with sharding.use_mesh(mesh, run.rules):
        compiled, abstract_state, _ = steps.compile_train_step(run)
    return step_plan_of(run, compiled, abstract_state, time.perf_counter() - start)


def step_plan_of(run: Run, compiled_train, abstract_state, compile_seconds: float = 0.0) -> StepPlan:
    """The per-device accounting of `run`'s compiled train step (`steps.compile_train_step(run)`)."""
    config = run.config
    return plan_from_compiled(
        compiled_train,
        abstract_state,
        steps.abstract_batch(config, config.global_batch_size, run.batch_sharding, training=True),
        dict(run.mesh.shape),
        config.global_batch_size,
        compile_seconds,
        trained_params=select_params(abstract_state.params, run.trainable),
    )


def log_step_plan(run: Run, compiled_train, abstract_state) -> None:
    """Logs the per-device table of a compiled train step and raises MeshError when it cannot fit the device."""
    report = memory.memory_report(compiled_train)
    if report is not None:
        step_plan = step_plan_of(run, compiled_train, abstract_state)
        logging.info("train step %s; per device:\n%s", report.describe(), format_table([step_plan]))
    memory.check_fits(report, memory.device_memory_limit_bytes())


def print_plan(
    config,
    *,
    config_path: str,
    devices: int,
    device_memory_gb: float,
    search: bool,
    max_model: int,
    max_candidates: int,
    json_path: str | None,
) -> StepPlan | None:
    """Plans `config` on the current devices, searches splits when it does not fit, prints the table.

    Returns the plan that fits (the configured one, or the first split the
    search found), or None. With `json_path`, also writes every plan there.
    """
    limit = int(device_memory_gb * GB)
    plans = [plan_train_step(config)]
    print(
        f"# {config_path} on {devices} devices, global batch {config.global_batch_size}, "
        f"{config.input.image_size[0]}x{config.input.image_size[1]} px, model.dtype={config.model.dtype}, "
        f"model.remat={config.model.remat}"
    )
    fitting = plans[0] if plans[0].fits(limit) else None
    if fitting is None and search:
        fitting = search_fitting_mesh(
            config, limit, plan_train_step, max_model=max_model, tried=plans, max_candidates=max_candidates
        )
    print(format_table(plans, limit))
    configured = plans[0]
    verdict = "fits" if configured.fits(limit) else "does NOT fit"
    print(
        f"\nconfigured mesh {configured.mesh_shape}: {configured.total_bytes / GB:.2f} GB per device, "
        f"{verdict} in {device_memory_gb:g} GB"
    )
    if fitting is not None and fitting is not configured:
        m = fitting.mesh_shape
        print(
            f"smallest split that fits: --config.mesh.data={m['data']} --config.mesh.fsdp={m['fsdp']} "
            f"--config.mesh.model={m['model']} ({fitting.total_bytes / GB:.2f} GB per device)"
        )
    elif fitting is None and not search:
        print("not searching other splits (--nosearch)")
    elif fitting is None:
        print(
            f"none of the {len(plans)} splits tried fits (--max_model={max_model}, "
            f"--max_candidates={max_candidates}); set model.remat=full, use model.dtype=bfloat16, "
            "lower global_batch_size, or add devices"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "config": config_path,
                    "devices": devices,
                    "device_memory_bytes": limit,
                    "plans": [p.to_json() for p in plans],
                    "fitting_mesh": fitting.mesh_shape if fitting is not None else None,
                },
                f,
                indent=2,
            )
    sys.stdout.flush()
    return fitting

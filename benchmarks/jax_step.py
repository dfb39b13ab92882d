"""A config's jitted train step on random inputs, compiled and timed: what the benchmarks share.

Inputs are random images with a few random boxes each, so no input pipeline
runs; what is measured is the sharded step itself (forward, loss, backward,
optimizer) as the trainer compiles it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

import sharding
from benchmarks.synthetic import random_batch
from detector.training import steps
from detector.training.run import create_run
from detector.training.train_state import init_train_state
from sharding import step_plan


@dataclasses.dataclass
class TrainStep:
    """A compiled train step with its live state and one device-resident batch."""

    compiled: Any
    state: Any
    batch: dict[str, jax.Array]
    plan: step_plan.StepPlan  # per-device memory, FLOPs, collectives
    global_batch_size: int

    def run(self, num_steps: int) -> float:
        """Runs `num_steps` steps and returns the mean seconds per step (waits for the device)."""
        start = time.perf_counter()
        metrics = None
        for _ in range(num_steps):
            self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / max(num_steps, 1)


def build(config, num_classes: int, devices=None) -> TrainStep:
    """Compiles `config`'s train step on `devices` (default: all) and initialises its state."""
    mesh = sharding.create_mesh(config.mesh, devices)
    sharding.check_global_batch(config.global_batch_size, mesh)
    run = create_run(config, num_classes, mesh, training=True)
    batch_sharding = run.batch_sharding
    with sharding.use_mesh(mesh, run.rules):
        start = time.perf_counter()
        compiled, abstract_state, shardings = steps.compile_train_step(run)
        compile_seconds = time.perf_counter() - start
        state = init_train_state(
            run.model, run.tx, run.image_size, shardings, jax.random.key(0), trainable=run.trainable
        )
    abstract_batch = steps.abstract_batch(config, config.global_batch_size, batch_sharding, training=True)
    plan = step_plan.plan_from_compiled(
        compiled, abstract_state, abstract_batch, dict(mesh.shape), config.global_batch_size, compile_seconds
    )
    batch = jax.device_put(random_batch(config, num_classes), batch_sharding)
    return TrainStep(compiled=compiled, state=state, batch=batch, plan=plan, global_batch_size=config.global_batch_size)

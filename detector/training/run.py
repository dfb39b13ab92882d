"""A run: what it derives from its config, built once per process and passed to what uses it.

The loop, the evaluator, the predictor, export and the plan all take a
`Run` rather than rebuilding its parts from `config`: the networks, the
family's objective, which parameters train and which stay fixed, the
optimizer, the mesh and its logical rules. Its compiled steps come from
`steps.compile_train_step(run)` and `steps.compile_predict_step(run, ...)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import optax

import sharding
from detector.models import families
from detector.training import optim


@dataclasses.dataclass(frozen=True)
class Run:
    """The config-derived parts of a training or prediction run.

    Attributes:
      config: the run's config.
      num_classes: the dataset's number of classes (the heads' width).
      mesh, rules: the device mesh and the logical-axis rules every program is compiled under.
      model: the network trained (its head may pack levels for the mesh's
        data-parallel gradient reduction); for prediction, `predict_model`.
      predict_model: the network prediction runs: the same parameters, no level packing.
      objective: `loss` on `model`, `detect` on `predict_model` (`families.objective`).
      trainable: `optim.trainable_parameters`: path -> whether it trains, or None (all do).
      frozen: `optim.frozen_parameters`: params -> bools held fixed, or None.
      tx, schedule: the optimizer and its learning-rate schedule (None for a prediction run).
    """

    config: ml_collections.ConfigDict
    num_classes: int
    mesh: jax.sharding.Mesh
    rules: Any
    model: nn.Module
    predict_model: nn.Module
    objective: families.Objective
    trainable: Callable[[tuple[str, ...]], bool] | None
    frozen: Callable[[Any], Any] | None
    tx: optax.GradientTransformation | None
    schedule: optax.Schedule | None

    @property
    def batch_sharding(self) -> jax.sharding.NamedSharding:
        """A global batch split over the mesh's batch axes (data x fsdp)."""
        return sharding.batch_sharding(self.mesh, sharding.batch_axes(self.mesh))

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.config.input.image_size)


def create_run(config: ml_collections.ConfigDict, num_classes: int, mesh: jax.sharding.Mesh, *, training: bool) -> Run:
    """Builds `config`'s run on `mesh` once: networks, objective, trainable and frozen masks, optimizer.

    `training=False` builds a prediction run: one network, no optimizer.
    """
    rules = sharding.logical_rules(config.sharding)
    predict_model = families.create_model(config, num_classes)
    model, tx, schedule, frozen = predict_model, None, None, None
    if training:
        data_parallel_devices = math.prod(mesh.shape[axis] for axis in sharding.batch_axes(mesh))
        model = families.create_model(config, num_classes, data_parallel_devices=data_parallel_devices)
        frozen = optim.frozen_parameters(config.model)
        tx, schedule = optim.create_optimizer(
            config.optimizer, config.total_steps, model_config=config.model, frozen=frozen
        )
    return Run(
        config=config,
        num_classes=num_classes,
        mesh=mesh,
        rules=rules,
        model=model,
        predict_model=predict_model,
        objective=families.objective(config, model, num_classes, predict_model=predict_model),
        trainable=optim.trainable_parameters(config.model),
        frozen=frozen,
        tx=tx,
        schedule=schedule,
    )

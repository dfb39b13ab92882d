"""The training loop: mesh, compiled steps, state, input, steps with logging, checkpoints and evaluation.

`train_and_evaluate` is what `python -m detector.train` runs. The same code
runs on one CPU, one GPU, or many hosts: the config's mesh and batch size
decide how the work is split. A workdir that holds a checkpoint is resumed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

import input_pipeline
import sharding
from detector.loop import preemption, workdir_lock
from detector.loop.evaluator import EvaluationInterrupted, Evaluator
from detector.loop.metric_writers import MetricWriter
from detector.loop.monitors import DataReport, MetricWindow, NonFiniteSteps
from detector.models.weights import load_backbone_params
from detector.training import checkpointing, steps
from detector.training.run import Run, create_run
from detector.training.train_compile import log_step_plan
from detector.training.train_state import (
    TrainState,
    count_params,
    evaluated_params,
    init_train_state,
    restart_ema,
)
from input_pipeline.progress import Progress


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    """Trains to `config.total_steps` (resuming from `workdir` if possible) and evaluates.

    Returns the last evaluation's COCO metrics on process 0 (None elsewhere,
    and None after a preemption stop).

    Raises:
      TrainingError: another trainer is using `workdir` (workdir_lock), before anything is written there.
    """
    with workdir_lock.hold_workdir(workdir):
        return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    is_primary = jax.process_index() == 0
    workdir_path = _prepare_workdir(config, workdir, is_primary)
    mesh = _create_mesh(config)
    # Checked before the dataset is read: a bad input option fails in seconds,
    # not after the minutes a first run spends preparing the splits.
    input_pipeline.TransformOptions.from_config(config)
    dataset_info = input_pipeline.get_dataset_info(config)
    data_report = DataReport(config, workdir_path, enabled=is_primary)
    run = create_run(config, dataset_info.num_classes, mesh, training=True)
    programs = _compile(run)

    manager = checkpointing.create_manager(workdir, max_to_keep=config.keep_checkpoints)
    best_manager = checkpointing.create_best_manager(workdir)
    writer = MetricWriter(workdir, enabled=is_primary)
    evaluate = None
    try:
        start = _restore_or_init(run, manager, programs)
        writer.discard_after(start.step)
        # The stream is a function of (seed, position): a resumed run starts at
        # the checkpoint's position and sees exactly what an uninterrupted run
        # would. Each process reads only the rows of every global batch its devices hold.
        train_iter = input_pipeline.create_train_iterator(
            config,
            start_position=start.input_position,
            first_row=input_pipeline.process_rows(programs.batch_sharding, config.global_batch_size),
        )
        evaluate = Evaluator(
            config,
            workdir,
            mesh=mesh,
            predict=programs.predict,
            dataset_info=dataset_info,
            writer=writer,
            data_report=data_report,
            best_manager=best_manager,
            is_primary=is_primary,
        )
        state, last_metrics, stopped_early = _train_loop(
            run,
            programs.train,
            start.state,
            train_iter,
            manager=manager,
            evaluate=evaluate,
            writer=writer,
            data_report=data_report,
        )
        if not stopped_early:
            checkpointing.export_params(workdir, evaluated_params(state))
    finally:
        try:
            # Let an in-flight async save finish so the newest checkpoint is complete.
            checkpointing.finish_writes(manager)
        finally:
            if evaluate is not None:
                evaluate.close()
            manager.close()
            best_manager.close()
            writer.close()
    if stopped_early:
        return None
    if is_primary and last_metrics is not None:
        logging.info("final COCO metrics: %s", json.dumps({k: round(v, 4) for k, v in last_metrics.items()}))
    return last_metrics


def _prepare_workdir(config: ml_collections.ConfigDict, workdir: str, is_primary: bool) -> epath.Path:
    """Creates the workdir and writes the run's config.json (process 0)."""
    path = epath.Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    if is_primary:
        (path / "config.json").write_text(config.to_json_best_effort(indent=2))
    return path


def _create_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    """The config's mesh, with both global batch sizes checked against it."""
    mesh = sharding.create_mesh(config.mesh)
    per_device_batch = sharding.check_global_batch(config.global_batch_size, mesh)
    sharding.check_global_batch(config.eval_batch_size, mesh)
    logging.info(
        "mesh %s over %d devices (%d processes); per-device batch %d",
        dict(mesh.shape),
        mesh.size,
        jax.process_count(),
        per_device_batch,
    )
    return mesh


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The compiled steps of a run and the shardings they were compiled for."""

    train: Any  # (state, global batch) -> (state, metrics)
    predict: Any  # (params, global batch) -> outputs
    abstract_state: TrainState
    state_shardings: TrainState
    batch_sharding: jax.sharding.NamedSharding


def _compile(run: Run) -> _Programs:
    """Compiles the train and predict steps ahead of time; logs and checks the train step's memory."""
    config = run.config
    with sharding.use_mesh(run.mesh, run.rules):
        compile_start = time.perf_counter()
        train, abstract_state, state_shardings = steps.compile_train_step(run)
        predict = steps.compile_predict_step(
            run,
            abstract_params=abstract_state.params,
            param_shardings=state_shardings.params,
            batch_size=config.eval_batch_size,
        )
        logging.info("compiled train and predict steps in %.1fs", time.perf_counter() - compile_start)
    logging.info(
        "model: %s, %.2fM parameters, %s per image",
        config.model.name,
        count_params(abstract_state.params) / 1e6,
        run.objective.outputs_per_image,
    )
    log_step_plan(run, train, abstract_state)
    return _Programs(
        train=train,
        predict=predict,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        batch_sharding=run.batch_sharding,
    )


@dataclasses.dataclass(frozen=True)
class _Start:
    state: TrainState
    step: int
    input_position: int


def _restore_or_init(run: Run, manager, programs: _Programs) -> _Start:
    """Resumes from the newest checkpoint, or initialises the state sharded (and loads pretrained weights)."""
    config = run.config
    restored = checkpointing.restore_latest(manager, programs.abstract_state)
    if restored is not None:
        state, metadata = restored
        step = int(jax.device_get(state.step))
        position = checkpointing.input_position(metadata, step, config.global_batch_size)
        logging.info("resuming from step %d at input position %d", step, position)
        return _Start(state, step, position)
    state = init_train_state(
        run.model,
        run.tx,
        run.image_size,
        programs.state_shardings,
        jax.random.key(config.seed),
        trainable=run.trainable,
    )
    pretrained = config.model.backbone.pretrained
    if pretrained:
        # Only on a fresh start: a resumed run continues from its own checkpoint.
        state = restart_ema(state.replace(params=load_backbone_params(state.params, pretrained, config.model.backbone)))
        logging.info("backbone initialised from %s", pretrained)
    if config.init_from:
        params, step, skipped = checkpointing.load_matching_params(config.init_from, state.params)
        state = restart_ema(state.replace(params=params))
        logging.warning(
            "initialised from step %d of %s: %d parameters skipped (path or shape differs)%s",
            step,
            config.init_from,
            len(skipped),
            "".join(f"\n  {path}: {stored} there, {wanted} here" for path, stored, wanted in skipped),
        )
    return _Start(state, 0, 0)


def _train_loop(
    run: Run, train_step, state: TrainState, train_iter, *, manager, evaluate: Evaluator, writer, data_report
) -> tuple[TrainState, dict[str, float] | None, bool]:
    """Steps from the state's step to `config.total_steps`; returns (state, last eval metrics, stopped early)."""
    config, mesh, is_primary = run.config, run.mesh, jax.process_index() == 0
    start_step = int(jax.device_get(state.step))
    total_steps = config.total_steps
    batch_axes = sharding.batch_axes(mesh)
    window = MetricWindow(config.global_batch_size, total_steps)
    nonfinite = NonFiniteSteps(int(config.max_consecutive_nonfinite))
    last_metrics, last_logged, stopped_early = None, {}, False
    # A live line on terminals; the periodic log lines are the record everywhere.
    with (
        preemption.PreemptionWatch() as watch,
        Progress(
            "step", total_steps, unit="steps", log_every_s=None, enabled=is_primary, initial=start_step
        ) as progress,
    ):
        saved_step = start_step

        def save_checkpoint(step: int) -> None:
            nonlocal saved_step
            checkpointing.save(manager, step, state, {"step": step, "input_position": train_iter.position})
            saved_step = step

        if _evaluates_restored_step(config, start_step, writer):
            # A finished run evaluates its last step again; a resumed one, the
            # step it resumes from when its score never landed (the run was
            # killed while scoring it in the background). Any earlier
            # evaluation was recorded before a later checkpoint was written.
            logging.info("evaluating step %d, the checkpoint this run starts from", start_step)
            try:
                last_metrics = evaluate(start_step, evaluated_params(state), watch.stop_requested) or last_metrics
            except EvaluationInterrupted as interrupted:
                stopped_early = True
                _log_preemption_stop(start_step, total_steps, cause=interrupted)

        for step in range(start_step + 1, total_steps + 1):
            if stopped_early:
                break
            wait_start = time.perf_counter()
            batch = input_pipeline.to_global_batch(next(train_iter), mesh, batch_axes)
            window.add_input_wait(time.perf_counter() - wait_start)
            state, metrics = train_step(state, batch)
            window.add_step(metrics)
            progress.update(step, **last_logged)
            # Every process asks after every step; all get the same answer.
            stopped_early = watch.stop_requested() and step < total_steps
            last = step == total_steps or stopped_early

            if step % config.log_every_steps == 0 or last:
                summary = window.summarize(step, nonfinite)
                logging.info("%s", window.log_line(step, summary))
                writer.write_train(step, summary)
                last_logged = {"loss": summary["loss"], "img/s": round(summary["images_per_second"], 1)}
                data_report.update("train", train_iter.input_counts)
                window.restart()
                last_metrics = evaluate.record_finished(wait=False) or last_metrics
            if step % config.checkpoint_every_steps == 0 or last:
                if evaluate.pending_step is not None and not stopped_early:
                    # A checkpoint past an evaluation whose score is not in
                    # would let a killed run resume beyond it and never score
                    # it. (A preemption stop saves first: within the grace
                    # period the checkpoint matters more.)
                    last_metrics = evaluate.record_finished(wait=True) or last_metrics
                save_checkpoint(step)
            if stopped_early:
                _log_preemption_stop(step, total_steps)
                break
            if step % config.eval_every_steps == 0 or step == total_steps:
                eval_start = time.perf_counter()
                try:
                    last_metrics = evaluate(step, evaluated_params(state), watch.stop_requested) or last_metrics
                except EvaluationInterrupted as interrupted:
                    # Within a grace period the checkpoint matters, the evaluation does not: a
                    # COCO evaluation can outlast it. The resumed run evaluates at its next eval step.
                    stopped_early = True
                    if saved_step != step:
                        save_checkpoint(step)
                    _log_preemption_stop(step, total_steps, cause=interrupted)
                    break
                window.exclude(time.perf_counter() - eval_start)  # eval time is not training throughput

        if evaluate.pending_step is not None:
            if stopped_early:
                # The checkpoint first: it is what a preempted run must not lose. The score
                # then lands as usual if the grace period allows, else it is lost alone.
                checkpointing.finish_writes(manager)
                logging.info("waiting for the score of the evaluation of step %d", evaluate.pending_step)
            last_metrics = evaluate.record_finished(wait=True) or last_metrics
    return state, last_metrics, stopped_early


def _evaluates_restored_step(config, start_step: int, writer: MetricWriter) -> bool:
    """Whether the run evaluates the checkpoint it starts from before training on: a finished run's, or a due
    evaluation that eval_metrics.jsonl lacks. Process 0's answer, on every process (evaluating is collective)."""
    if start_step >= config.total_steps:
        logging.info("workdir already holds a checkpoint at step %d >= total_steps", start_step)
        return True
    due = start_step > 0 and start_step % config.eval_every_steps == 0
    missing = due and start_step not in writer.eval_steps()
    return bool(multihost_utils.broadcast_one_to_all(np.int32(missing)))


def _log_preemption_stop(step: int, total_steps: int, cause: Exception | None = None) -> None:
    logging.warning(
        "stopping at step %d of %d on a preemption signal%s; the checkpoint of step %d is being written. "
        "Run the same command to resume.",
        step,
        total_steps,
        f": {cause}" if cause else "",
        step,
    )

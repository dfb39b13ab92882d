"""Trains and evaluates the detector on a device mesh.

  python -m detector.train --config=configs/default.py --workdir=runs/default
  python -m detector.train --config=configs/default.py --workdir=DIR \
      --config.mesh.data=4 --config.mesh.model=2 --config.global_batch_size=32

The same code runs on one CPU, one GPU, or many hosts: the config's mesh and
batch size decide how the work is split. Running the same command again in a
workdir that holds a checkpoint resumes from it.
"""

from __future__ import annotations

import functools
import json
import logging as pylogging
import math
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import flags, logging
from etils import epath
from ml_collections import config_flags

import input_pipeline
import sharding
from detector import checkpointing, cli, evaluation, optim, steps
from detector.errors import ConfigError
from detector.metric_writers import MetricWriter
from detector.retinanet import create_model
from detector.train_state import count_params, init_train_state
from sharding import memory, plan

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (get_config()).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])


def _format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _with_batch_size(config: ml_collections.ConfigDict, global_batch_size: int) -> ml_collections.ConfigDict:
    derived = ml_collections.ConfigDict(config.to_dict())
    derived.global_batch_size = global_batch_size
    return derived


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    """Trains to `config.total_steps` (resuming from `workdir` if possible) and evaluates.

    Returns the last evaluation's COCO metrics on process 0 (None elsewhere).
    """
    is_primary = jax.process_index() == 0
    workdir_path = epath.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    if is_primary:
        (workdir_path / "config.json").write_text(config.to_json_best_effort(indent=2))

    # ------------------------------------------------------------------------
    # Mesh and sharding rules.
    # ------------------------------------------------------------------------
    mesh = sharding.create_mesh(config.mesh)
    rules = sharding.logical_rules(config.sharding)
    batch_axes = sharding.batch_axes(mesh)
    per_device_batch = sharding.check_global_batch(config.global_batch_size, mesh)
    sharding.check_global_batch(config.eval_batch_size, mesh)
    batch_sharding = sharding.batch_sharding(mesh, batch_axes)
    logging.info("mesh %s over %d devices (%d processes); per-device batch %d",
                 dict(mesh.shape), mesh.size, jax.process_count(), per_device_batch)

    # ------------------------------------------------------------------------
    # Data description, model, optimizer.
    # ------------------------------------------------------------------------
    dataset_info = input_pipeline.get_dataset_info(config)
    num_anchors = steps.num_anchors_per_location(config)
    model = create_model(config.model, dataset_info.num_classes, num_anchors)
    tx, schedule = optim.create_optimizer(config.optimizer, config.total_steps)
    anchors = steps.anchors_for_config(config)
    image_size = tuple(config.input.image_size)

    # ------------------------------------------------------------------------
    # Ahead-of-time compilation with explicit shardings; memory report.
    # ------------------------------------------------------------------------
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compile_start = time.perf_counter()
        compiled_train, abstract_state, state_shardings_tree = steps.compile_train_step(
            config, model, tx, schedule, num_classes=dataset_info.num_classes, mesh=mesh, rules=rules)
        predict_fn = jax.jit(
            functools.partial(steps.predict_step, model=model, anchors=anchors,
                              postprocess_config=config.postprocess, image_size=image_size,
                              box_coder_weights=tuple(config.loss.box_coder_weights)),
            in_shardings=(state_shardings_tree.params, batch_sharding),
            out_shardings=batch_sharding,
        )
        compiled_predict = predict_fn.lower(
            abstract_state.params, steps.abstract_batch(config, config.eval_batch_size, batch_sharding)).compile()
        logging.info("compiled train and predict steps in %.1fs", time.perf_counter() - compile_start)

    num_params = count_params(abstract_state.params)
    logging.info("model: %.2fM parameters, %d anchors per image", num_params / 1e6, anchors.shape[0])
    report = memory.memory_report(compiled_train)
    if report is not None:
        # The same accounting as `python -m sharding.plan`, on the real devices.
        step_plan = plan.plan_from_compiled(
            compiled_train, abstract_state, steps.abstract_batch(config, config.global_batch_size, batch_sharding),
            dict(mesh.shape), config.global_batch_size)
        logging.info("train step %s; per device:\n%s", report.describe(), plan.format_table([step_plan]))
    memory.check_fits(report, memory.device_memory_limit_bytes())

    # ------------------------------------------------------------------------
    # State: resume from the newest checkpoint, or initialise sharded.
    # ------------------------------------------------------------------------
    manager = checkpointing.create_manager(workdir, max_to_keep=config.keep_checkpoints)
    restored = checkpointing.restore_latest(manager, abstract_state)
    if restored is None:
        state = init_train_state(model, tx, image_size, state_shardings_tree, jax.random.key(config.seed))
        start_step = 0
    else:
        state, _ = restored
        start_step = int(jax.device_get(state.step))
        logging.info("resuming from step %d", start_step)

    # ------------------------------------------------------------------------
    # Input pipelines.
    # ------------------------------------------------------------------------
    # A resumed run skips the batches already trained on (without decoding
    # them), so it sees exactly the stream an uninterrupted run would.
    train_iter = input_pipeline.create_train_iterator(config, start_step=start_step)
    eval_config = _with_batch_size(config, config.eval_batch_size)
    ground_truth = input_pipeline.coco_ground_truth(config) if is_primary else None
    writer = MetricWriter(workdir, enabled=is_primary)

    def run_eval(step: int) -> dict[str, float] | None:
        eval_batches = input_pipeline.create_eval_iterator(eval_config).batches
        global_batches = (input_pipeline.to_global_batch(b, mesh, batch_axes) for b in eval_batches)
        metrics = evaluation.evaluate(compiled_predict, state.params, global_batches,
                                      ground_truth=ground_truth,
                                      label_to_category_id=dataset_info.label_to_category_id)
        if metrics is not None:
            summary = {k: metrics[k] for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100")}
            logging.info("eval step %d: %s", step, " ".join(f"{k} {v:.3f}" for k, v in summary.items()))
            writer.write_eval(step, summary)
        return metrics

    try:
        # --------------------------------------------------------------------
        # Training loop.
        # --------------------------------------------------------------------
        total_steps = config.total_steps
        last_metrics = None
        pending: list[dict[str, jax.Array]] = []
        window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0
        for step in range(start_step + 1, total_steps + 1):
            wait_start = time.perf_counter()
            batch = input_pipeline.to_global_batch(next(train_iter), mesh, batch_axes)
            window_wait += time.perf_counter() - wait_start
            state, metrics = compiled_train(state, batch)
            pending.append(metrics)
            window_steps += 1

            if step % config.log_every_steps == 0 or step == total_steps:
                # The only host sync of the loop: fetch the window's metrics at once.
                fetched = jax.device_get(pending)
                elapsed = time.perf_counter() - window_start
                summary = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
                summary["learning_rate"] = float(fetched[-1]["learning_rate"])
                summary["images_per_second"] = window_steps * config.global_batch_size / elapsed
                summary["step_time_s"] = elapsed / window_steps
                summary["input_wait_fraction"] = window_wait / elapsed
                eta = (total_steps - step) * summary["step_time_s"]
                logging.info(
                    "step %d/%d | loss %.4f (cls %.4f box %.4f) | lr %.2e | grad norm %.3f | %.1f img/s | "
                    "input wait %.0f%% | ETA %s", step, total_steps, summary["loss"], summary["cls_loss"],
                    summary["box_loss"], summary["learning_rate"], summary["grad_norm"],
                    summary["images_per_second"], 100 * summary["input_wait_fraction"], _format_duration(eta))
                if not math.isfinite(summary["loss"]):
                    logging.warning("non-finite loss at step %d", step)
                writer.write_train(step, summary)
                pending.clear()
                window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0

            if step % config.checkpoint_every_steps == 0 or step == total_steps:
                checkpointing.save(manager, step, state, {"step": step, "batches_consumed": step})
            if step % config.eval_every_steps == 0 or step == total_steps:
                last_metrics = run_eval(step)
                window_start = time.perf_counter()  # eval time is not training throughput

        if start_step >= total_steps:
            logging.info("workdir already holds a checkpoint at step %d >= total_steps; evaluating it", start_step)
            last_metrics = run_eval(start_step)
    finally:
        # Let an in-flight async save finish so the newest checkpoint is complete.
        manager.wait_until_finished()
        manager.close()
        writer.close()
    if is_primary and last_metrics is not None:
        logging.info("final COCO metrics: %s", json.dumps({k: round(v, 4) for k, v in last_metrics.items()}))
    return last_metrics


class _QuietLibraries(pylogging.Filter):
    """Keeps the libraries' INFO chatter (one line per checkpoint file) out of the training log."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(_QuietLibraries())
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    cli.run(main)

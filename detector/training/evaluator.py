"""Evaluation inside a training run: COCO metrics, the best parameters, TensorBoard pictures, plots.

Every process takes part (predicting is sharded, the best checkpoint is
saved by all); process 0 alone scores with pycocotools and writes files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

import input_pipeline
import sharding
from detector.serving import coco_evaluation, drawing
from detector.training import checkpointing, plots
from detector.training.metric_writers import MetricWriter
from input_pipeline.progress import track

# The metrics of eval_metrics.jsonl and the log line, in their order.
LOGGED_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100")


class EvaluationInterrupted(Exception):
    """A stop was requested (a preemption signal) while an evaluation ran; it was abandoned, nothing recorded."""

    def __init__(self, step: int, batches_done: int, num_batches: int):
        super().__init__(f"evaluation of step {step} abandoned after {batches_done} of {num_batches} batches")
        self.step = step


def _until_stop(batches: Iterable, stop_requested: Callable[[], bool], step: int, num_batches: int) -> Iterator:
    """`batches`, asking `stop_requested` before each one and once after the last (scoring can take minutes)."""
    done = 0
    if stop_requested():
        raise EvaluationInterrupted(step, done, num_batches)
    for batch in batches:
        yield batch
        done += 1
        if stop_requested():
            raise EvaluationInterrupted(step, done, num_batches)


class Evaluator:
    """Runs the eval split through the compiled predict step at a training step and records the result."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str,
        *,
        mesh: jax.sharding.Mesh,
        predict: Any,
        dataset_info: Any,
        writer: MetricWriter,
        data_report: Any,
        best_manager: Any,
        is_primary: bool,
    ):
        self._config = input_pipeline.with_batch_size(config, config.eval_batch_size)
        self._workdir = workdir
        self._mesh = mesh
        self._batch_axes = sharding.batch_axes(mesh)
        self._batch_sharding = sharding.batch_sharding(mesh, self._batch_axes)
        self._predict = predict
        self._dataset_info = dataset_info
        self._writer = writer
        self._data_report = data_report
        self._best_manager = best_manager
        self._is_primary = is_primary
        self._ema = float(config.optimizer.ema_decay) > 0
        self._ground_truth = input_pipeline.coco_ground_truth(config) if is_primary else None
        self._pictures = _EvalPictures(
            int(config.eval_pictures), self._config, mesh, dataset_info.class_names, enabled=is_primary
        )

    def __call__(
        self, step: int, params: Any, stop_requested: Callable[[], bool] = lambda: False
    ) -> dict[str, float] | None:
        """Evaluates `params` (of training step `step`: the EMA ones when the run keeps an EMA).

        `stop_requested` is asked before every batch, on every process at the
        same points; when it says yes, the evaluation stops there and raises
        `EvaluationInterrupted`, having recorded nothing.

        Returns the COCO metrics on process 0, else None.
        """
        eval_iter = input_pipeline.create_eval_iterator(
            self._config,
            first_row=input_pipeline.process_rows(self._batch_sharding, self._config.global_batch_size),
        )
        if self._is_primary:
            logging.info(
                "evaluating step %d: %d batches of %d images",
                step,
                eval_iter.num_batches,
                self._config.global_batch_size,
            )
        batches = track(
            eval_iter.batches,
            f"eval at step {step}",
            eval_iter.num_batches,
            unit="batches",
            log_every_s=60.0,
            enabled=self._is_primary,
        )
        batches = _until_stop(batches, stop_requested, step, eval_iter.num_batches)
        global_batches = (input_pipeline.to_global_batch(b, self._mesh, self._batch_axes) for b in batches)
        metrics = coco_evaluation.evaluate(
            self._predict,
            params,
            global_batches,
            ground_truth=self._ground_truth,
            label_to_category_id=self._dataset_info.label_to_category_id,
        )
        self._data_report.update("eval", eval_iter.input_counts)
        # Only process 0 scores; every process takes part in saving the best parameters.
        ap = float(multihost_utils.broadcast_one_to_all(np.float32(metrics["AP"] if metrics else 0.0)))
        checkpointing.save_if_best(self._best_manager, step, params, ap)
        if metrics is not None:
            summary = {k: metrics[k] for k in LOGGED_METRICS}
            logging.info(
                "eval step %d%s: %s",
                step,
                " (EMA parameters)" if self._ema else "",
                " ".join(f"{k} {v:.3f}" for k, v in summary.items()),
            )
            self._writer.write_eval(step, summary)
        self._pictures.write(step, self._predict, params, self._writer)
        if self._is_primary:
            plots.write_training_plots(self._workdir)
        return metrics


class _EvalPictures:
    """The first `count` validation images, predicted at every evaluation for TensorBoard.

    The batch is read once and kept on the devices; every process takes part
    in predicting it, process 0 draws "predictions | ground truth" panels.
    """

    def __init__(self, count: int, eval_config, mesh, class_names, *, enabled: bool):
        self._count = count
        self._enabled = enabled
        self._class_names = class_names
        self._batch = self._host_batch = None
        if self._count <= 0:
            return
        batch_axes = sharding.batch_axes(mesh)
        eval_iter = input_pipeline.create_eval_iterator(
            eval_config,
            first_row=input_pipeline.process_rows(
                sharding.batch_sharding(mesh, batch_axes), eval_config.global_batch_size
            ),
        )
        self._batch = input_pipeline.to_global_batch(next(iter(eval_iter.batches)), mesh, batch_axes)
        self._host_batch = jax.tree.map(np.array, multihost_utils.process_allgather(self._batch, tiled=True))
        self._host_batch["example_mask"][self._count :] = False

    def write(self, step: int, predict, params, writer: MetricWriter) -> None:
        if self._batch is None:
            return
        outputs = multihost_utils.process_allgather(predict(params, self._batch), tiled=True)
        if self._enabled:
            panels = drawing.prediction_panels(
                self._host_batch,
                jax.tree.map(np.asarray, outputs),
                class_names=self._class_names,
            )
            writer.write_images(step, {"eval/predictions_vs_ground_truth": panels})

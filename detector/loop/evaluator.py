"""Evaluation inside a training run: COCO metrics, the best parameters, TensorBoard pictures, plots.

Every process takes part in predicting (sharded) and in saving the best
checkpoint; process 0 alone collects the detections and scores them, in a
background thread while training goes on (`background_scoring`), and writes
files. The score lands at the next point where every process asks for it
(`Evaluator.record_finished`: the loop asks at every log step, before the
next evaluation and at the end), written with the step it belongs to.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

import input_pipeline
import sharding
from detector.errors import ConfigError
from detector.loop import plots
from detector.loop.metric_writers import MetricWriter
from detector.serving import coco_evaluation, drawing
from detector.serving.coco_ap import MASK_STAT_NAMES, STAT_NAMES, CocoGroundTruth
from detector.training import checkpointing
from input_pipeline.progress import track

# The metrics of eval_metrics.jsonl and the log line, in their order.
LOGGED_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100")
# With masks scored, their stats are logged beside the boxes'.
LOGGED_MASK_METRICS = tuple(f"mask_{name}" for name in LOGGED_METRICS)


def best_metric(config: ml_collections.ConfigDict) -> str:
    """`config.best_metric`, checked: a COCO stat name, a mask one only for a model that predicts masks."""
    name = config.best_metric
    if name not in STAT_NAMES and name not in MASK_STAT_NAMES:
        raise ConfigError(
            f"best_metric={name!r}; use a COCO stat name: {', '.join(STAT_NAMES)}, or with masks mask_AP, ..."
        )
    if name in MASK_STAT_NAMES and not (config.model.name == "dino" and config.model.dino.mask_dim):
        raise ConfigError(f"best_metric={name!r} needs a model that predicts masks (model.dino.mask_dim > 0)")
    return name


# What process 0 tells the others about the pending scoring.
_PENDING, _SCORED, _FAILED = 0, 1, 2


class EvaluationInterrupted(Exception):
    """A stop was requested (a preemption signal) while an evaluation ran; it was abandoned, nothing recorded."""

    def __init__(self, step: int, batches_done: int, num_batches: int):
        super().__init__(f"evaluation of step {step} abandoned after {batches_done} of {num_batches} batches")
        self.step = step


def _until_stop(batches: Iterable, stop_requested: Callable[[], bool], step: int, num_batches: int) -> Iterator:
    """`batches`, asking `stop_requested` before each one and once after the last."""
    done = 0
    if stop_requested():
        raise EvaluationInterrupted(step, done, num_batches)
    for batch in batches:
        yield batch
        done += 1
        if stop_requested():
            raise EvaluationInterrupted(step, done, num_batches)


@dataclasses.dataclass
class _Scoring:
    """An evaluation whose predictions are made and whose score is not yet recorded.

    `params` are the evaluated parameters, held (on the devices, one more copy
    of them) until the score decides whether they become the best checkpoint.
    """

    step: int
    params: Any
    future: concurrent.futures.Future | None  # process 0 only
    started: float


def lower_thread_priority() -> None:
    """Runs the scoring thread at a lower CPU priority (nice 10), so that on a host whose cores also
    feed or run the train step (a CPU run, a busy input pipeline) scoring takes what they leave.

    Linux keeps a nice value per thread; elsewhere this does nothing.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def score_predictions(
    ground_truth: CocoGroundTruth, local: coco_evaluation.Predictions, key: str
) -> coco_evaluation.CocoEvaluation:
    """Process 0's scoring job: the other processes' predictions, then COCO metrics of them all."""
    gathered = coco_evaluation.gather_predictions(local, key)
    return coco_evaluation.score(ground_truth, gathered.detections, gathered.image_ids)


class Evaluator:
    """Runs the eval split through the compiled predict step at a training step and records the result.

    `score` is process 0's scoring job (`score_predictions`); it runs on a
    worker thread when the config's `background_scoring` is on.
    """

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
        score: Callable[[CocoGroundTruth, coco_evaluation.Predictions, str], Any] | None = None,
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
        self._background = bool(config.background_scoring)
        self._score = score or score_predictions
        self._best_metric = best_metric(config)
        # Columns, never a dict per box: a large validation set's ground truth is mostly its boxes.
        self._ground_truth = (
            CocoGroundTruth.from_columns(input_pipeline.coco_ground_truth_columns(config)) if is_primary else None
        )
        if self._ground_truth is not None and self._best_metric in MASK_STAT_NAMES:
            if self._ground_truth.segmentations is None:
                raise ConfigError(
                    f"best_metric={self._best_metric!r}, but the validation set's ground truth has no mask for "
                    "every box, so no mask AP is scored; use best_metric='AP' or a validation set with masks"
                )
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="coco_scoring", initializer=lower_thread_priority
            )
            if is_primary
            else None
        )
        self._pending: _Scoring | None = None
        self._evaluations = 0
        self._pictures = _EvalPictures(
            int(config.eval_pictures), self._config, mesh, dataset_info.class_names, enabled=is_primary
        )

    @property
    def pending_step(self) -> int | None:
        """The step whose score is being computed, if any."""
        return self._pending.step if self._pending else None

    def __call__(
        self, step: int, params: Any, stop_requested: Callable[[], bool] = lambda: False
    ) -> dict[str, float] | None:
        """Evaluates `params` (of training step `step`: the EMA ones when the run keeps an EMA).

        Waits for an earlier evaluation's score first (at most one is pending),
        predicts the eval split, then scores it: in the background, or here when
        `background_scoring` is off. `stop_requested` is asked before every
        batch, on every process at the same points; when it says yes, the
        evaluation stops there and raises `EvaluationInterrupted`, having
        recorded nothing of this step.

        Returns the metrics recorded by this call on process 0 (the earlier
        evaluation's, or this one's when scored here), else None.
        """
        recorded = self.record_finished(wait=True)
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
        start = time.perf_counter()
        local = coco_evaluation.predict_local(
            self._predict, params, global_batches, label_to_category_id=self._dataset_info.label_to_category_id
        )
        self._data_report.update("eval", eval_iter.input_counts)
        self._pictures.write(step, self._predict, params, self._writer)
        self._evaluations += 1
        key = f"eval/{step}/{self._evaluations}"
        if self._is_primary:
            future = self._worker.submit(self._score, self._ground_truth, local, key)
            logging.info(
                "eval step %d: predicted in %.1fs; scoring %s",
                step,
                time.perf_counter() - start,
                "in the background" if self._background else "now",
            )
        else:
            future = None
            coco_evaluation.gather_predictions(local, key)  # sends, does not wait
        if self._background:
            # The train step donates the state's buffers: the score decides on a copy.
            params = jax.tree.map(lambda x: x.copy(), params)
        self._pending = _Scoring(step, params, future, time.perf_counter())
        if not self._background:
            recorded = self.record_finished(wait=True)
        return recorded

    def record_finished(self, *, wait: bool) -> dict[str, float] | None:
        """Records the pending evaluation if its score is ready (or, with `wait`, once it is).

        Every process must call this at the same points: process 0 tells the
        others whether the score is in, and all then offer the evaluated
        parameters to the best checkpoint (a collective save). Returns the
        recorded metrics on process 0, else None.
        """
        if self._pending is None:
            return None
        pending = self._pending
        status, ap, metrics = _PENDING, 0.0, None
        if self._is_primary and (wait or pending.future.done()):
            try:
                evaluation = pending.future.result()
                metrics, status = evaluation.metrics, _SCORED
                # No detections at all leave the mask stats out: nothing scored, as 0.
                ap = float(evaluation.metrics.get(self._best_metric, 0.0))
            except Exception:  # noqa: BLE001  a failed scoring loses this evaluation, not the run
                logging.exception("scoring the evaluation of step %d failed; it is not recorded", pending.step)
                status = _FAILED
        status, ap = (float(v) for v in multihost_utils.broadcast_one_to_all(np.array([status, ap], np.float64)))
        if status == _PENDING:
            return None
        self._pending = None
        if status == _FAILED:
            return None
        checkpointing.save_if_best(self._best_manager, pending.step, pending.params, ap)
        if metrics is None:
            return None
        summary = {k: metrics[k] for k in (*LOGGED_METRICS, *LOGGED_MASK_METRICS) if k in metrics}
        logging.info(
            "eval step %d%s: %s (scored %.1fs after prediction)",
            pending.step,
            " (EMA parameters)" if self._ema else "",
            " ".join(f"{k} {v:.3f}" for k, v in summary.items()),
            time.perf_counter() - pending.started,
        )
        self._writer.write_eval(pending.step, summary)
        plots.write_training_plots(self._workdir)
        return metrics

    def close(self) -> None:
        """Stops the scoring thread; a score still being computed is abandoned (never recorded)."""
        if self._pending is not None and self._is_primary:
            logging.warning("the score of the evaluation of step %d is abandoned", self._pending.step)
        self._pending = None
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)


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

"""A trained detector at work: load a checkpoint, evaluate it on the eval split, predict on image files.

What `python -m detector.evaluate` and `python -m detector.predict` run.
Inference is sharded like training (the config's mesh: the batch over the
data axes, parameters as the sharding rules say), so a model that needed
model parallelism to train also fits to predict, and several processes
join as they do for training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

import input_pipeline
import sharding
from detector.errors import ConfigError
from detector.serving import coco_evaluation
from detector.serving.coco_ap import MASK_STAT_NAMES
from detector.training import checkpointing, steps
from detector.training.run import Run, create_run
from detector.training.train_state import params_shardings
from input_pipeline import batch as batch_layout
from input_pipeline import transforms
from input_pipeline.progress import track


@dataclasses.dataclass(frozen=True)
class Predictor:
    """Everything needed to run `predict(params, global_batch)` on this run's devices.

    Attributes:
      config: the training config, its `global_batch_size` and `eval_batch_size` set to batch_size.
      run: the prediction run (its network, `run.predict_model`, and objective).
      mesh: the device mesh from `config.mesh`.
      batch_sharding: NamedSharding of a global batch over the mesh's data axes.
      params: the restored parameters, sharded.
      step: the training step the parameters come from.
      predict: compiled `(params, global_batch) -> outputs` (see `steps.predict_step`).
      batch_size: global batch size the predict step was compiled for.
      dataset_info: class names and label -> category id of the training data.
    """

    config: ml_collections.ConfigDict
    run: Run
    mesh: jax.sharding.Mesh
    batch_sharding: jax.sharding.NamedSharding
    params: Any
    step: int
    predict: Any
    batch_size: int
    dataset_info: Any

    def __call__(self, global_batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self.predict(self.params, global_batch)

    @property
    def predicts_masks(self) -> bool:
        """Whether the outputs hold `masks` (a Mask DINO's mask logits)."""
        return "masks" in self.predict.out_info

    def global_batch(self, local_batch: dict[str, Any]) -> dict[str, jax.Array]:
        """This process's rows of a batch (numpy) -> the sharded global batch."""
        return input_pipeline.to_global_batch(local_batch, self.mesh, sharding.batch_axes(self.mesh))

    def first_row(self) -> int:
        """The first row of every global batch this process provides."""
        return input_pipeline.process_rows(self.batch_sharding, self.batch_size)


def load_predictor(
    config: ml_collections.ConfigDict,
    workdir: str,
    checkpoint: str = "last",
    *,
    batch_size: int | None = None,
    raw_params: bool = False,
) -> Predictor:
    """Builds the config's model on its mesh and loads `checkpoint` ("last", "best" or a step) from `workdir`.

    `batch_size` (default `config.eval_batch_size`) must be a multiple of the
    mesh's data-parallel size. A run that kept an EMA of its parameters
    (`optimizer.ema_decay` > 0) is loaded with the EMA ones unless
    `raw_params`; its best checkpoint holds the EMA parameters it was
    evaluated with, so `raw_params` needs "last" or a step there.
    """
    batch_size = int(batch_size or config.eval_batch_size)
    use_ema = float(config.optimizer.ema_decay) > 0 and not raw_params
    if raw_params and float(config.optimizer.ema_decay) > 0 and str(checkpoint).strip().lower() == "best":
        raise ConfigError(
            "--raw_params with --checkpoint=best: the best checkpoint holds the EMA parameters it was evaluated "
            "with; use --checkpoint=last or a step for the raw ones"
        )
    mesh = sharding.create_mesh(config.mesh)
    sharding.check_global_batch(batch_size, mesh)
    dataset_info = input_pipeline.get_dataset_info(config)
    # No gradients to reduce: the head packs its levels only under model.head_level_packing="always".
    run = create_run(config, dataset_info.num_classes, mesh, training=False)
    with sharding.use_mesh(mesh, run.rules):
        abstract_params, shardings = params_shardings(run.predict_model, run.image_size, mesh, run.rules)
        params, step = checkpointing.restore_params(workdir, checkpoint, abstract_params, ema=use_ema)
        start = time.perf_counter()
        predict = steps.compile_predict_step(
            run, abstract_params=abstract_params, param_shardings=shardings, batch_size=batch_size
        )
    logging.info(
        "loaded the %sparameters of step %d (%s) from %s; compiled predict for batches of %d in %.1fs",
        "EMA " if use_ema else "",
        step,
        checkpoint,
        workdir,
        batch_size,
        time.perf_counter() - start,
    )
    return Predictor(
        config=input_pipeline.with_batch_size(config, batch_size),
        run=run,
        mesh=mesh,
        batch_sharding=run.batch_sharding,
        params=params,
        step=step,
        predict=predict,
        batch_size=batch_size,
        dataset_info=dataset_info,
    )


# ----------------------------------------------------------------------------
# Evaluating a checkpoint on the eval split.
# ----------------------------------------------------------------------------

METRICS_FILE = "metrics.json"
DETECTIONS_FILE = "detections.json"


def evaluate_workdir(
    config: ml_collections.ConfigDict,
    workdir: str,
    checkpoint: str = "last",
    output: str | None = None,
    *,
    raw_params: bool = False,
) -> dict[str, Any] | None:
    """Evaluates `checkpoint` of `workdir`; returns the metrics.json content on process 0 (None elsewhere).

    `raw_params`: see `load_predictor`.
    """
    predictor = load_predictor(config, workdir, checkpoint, raw_params=raw_params)
    start = time.perf_counter()
    eval_iter = input_pipeline.create_eval_iterator(predictor.config, first_row=predictor.first_row())
    batches = (predictor.global_batch(batch) for batch in eval_iter.batches)
    predicted = coco_evaluation.predict_all(
        predictor.predict,
        predictor.params,
        track(
            batches, "eval", eval_iter.num_batches, unit="batches", log_every_s=10.0, enabled=jax.process_index() == 0
        ),
        label_to_category_id=predictor.dataset_info.label_to_category_id,
    )
    if predicted is None:
        return None
    ground_truth = input_pipeline.coco_ground_truth(config)
    names = {int(c["id"]): str(c.get("name", c["id"])) for c in ground_truth.get("categories", [])}
    scored = coco_evaluation.coco_evaluation(ground_truth, predicted.detections, predicted.image_ids)
    del ground_truth  # scored from columns; the dicts are not needed any more
    report = {
        "workdir": str(workdir),
        "checkpoint": str(checkpoint),
        "step": predictor.step,
        "dataset": config.dataset.name,
        "images": len(np.unique(predicted.image_ids)),
        "detections": len(predicted.detections),
        "metrics": scored.metrics,
        "per_class": [
            {"category_id": c, "name": names.get(c, str(c)), **values} for c, values in sorted(scored.per_class.items())
        ],
    }
    directory = epath.Path(output) if output else epath.Path(workdir) / "evaluation" / str(predictor.step)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METRICS_FILE).write_text(json.dumps(report, indent=2))
    coco_evaluation.write_results(directory / DETECTIONS_FILE, predicted.detections)
    print(format_report(report), flush=True)
    logging.info(
        "evaluated %d images in %.1fs; wrote %s and %s",
        report["images"],
        time.perf_counter() - start,
        directory / METRICS_FILE,
        directory / DETECTIONS_FILE,
    )
    return report


def format_report(report: dict[str, Any]) -> str:
    """The COCO table and the per-class table of a metrics.json report, as text."""
    metrics = report["metrics"]
    coco = coco_evaluation.format_table(
        ["metric", "value"],
        [(name, metrics[name]) for name in (*coco_evaluation.COCO_METRIC_NAMES, *MASK_STAT_NAMES) if name in metrics],
    )
    per_class = coco_evaluation.format_table(
        ["class", "AP", "AP50", "AP75", "instances"],
        [(c["name"], c["AP"], c["AP50"], c["AP75"], c["instances"]) for c in report["per_class"]],
    )
    return (
        f"COCO bbox metrics of step {report['step']} ({report['checkpoint']}) on {report['images']} "
        f"{report['dataset']} images, {report['detections']} detections:\n{coco}\n\nper class "
        f"(all sizes, 100 detections per image; '-': no ground truth):\n{per_class}"
    )


# ----------------------------------------------------------------------------
# Predicting on image files.
# ----------------------------------------------------------------------------


def network_input(image: np.ndarray, image_id: int, opts: transforms.TransformOptions) -> dict[str, np.ndarray]:
    """The eval transform of one image (resize to fit, round, pad): one example of the batch layout, as numpy.

    Returns:
      {key: array} for every key of input_pipeline.batch, shapes without the batch dimension: image
      uint8 [H, W, 3], image_hw int32 [2] the resized image's (h, w), boxes float32 [max_boxes, 4] all
      padding (zeros), scale float32 [] network px per original px, ...
    """
    transformed = _eval_transform_graph(opts)(np.asarray(image, np.uint8), np.int32(image_id))
    return {key: np.asarray(transformed[key]) for key in batch_layout.KEYS}


@functools.lru_cache(maxsize=8)
def _eval_transform_graph(opts: transforms.TransformOptions):
    """`transforms.eval_transform` as one TensorFlow graph for images of any size: the transform op by op,
    eagerly, costs about 8 ms an image in Python overhead (a 64 px one, 2-core CPU), the graph a tenth of it."""
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([None, None, 3], tf.uint8), tf.TensorSpec([], tf.int32)])
    def transform(image, image_id):
        example = {
            "image": image,
            "boxes": tf.zeros((0, 4), tf.float32),
            "labels": tf.zeros((0,), tf.int32),
            "image_id": image_id,
        }
        return transforms.eval_transform(example, opts)

    return transform

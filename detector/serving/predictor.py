"""A trained detector at work: load a checkpoint, evaluate it on the eval split, predict on image files.

What `python -m detector.evaluate` and `python -m detector.predict` run.
Inference is sharded like training (the config's mesh: the batch over the
data axes, parameters as the sharding rules say), so a model that needed
model parallelism to train also fits to predict, and several processes
join as they do for training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import hotcoco
import jax
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from PIL import Image, ImageOps, UnidentifiedImageError

import input_pipeline
import sharding
from detector.errors import ConfigError
from detector.serving import coco_evaluation, drawing
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

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
IMAGES_FILE = "images.json"


def find_images(inputs: Sequence[str]) -> list[epath.Path]:
    """Image files named by `inputs` (files, or folders searched recursively), in a stable order."""
    found: list[epath.Path] = []
    for name in inputs:
        path = epath.Path(name)
        if path.is_dir():
            found.extend(_image_files_under(path))
        elif path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(f"{name} does not exist; pass image files or folders of images")
    if not found:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {', '.join(inputs)}")
    return found


def _image_files_under(directory: epath.Path) -> list[epath.Path]:
    # iterdir rather than rglob: epath refuses recursive globs (one request per file on GCS).
    files = []
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            files.extend(_image_files_under(path))
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            files.append(path)
    return files


def read_image(path: epath.Path) -> np.ndarray | None:
    """`[H, W, 3]` uint8 RGB with the EXIF rotation applied, or None (logged) when the file is not an image."""
    try:
        with path.open("rb") as f, Image.open(f) as image:
            return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        logging.warning("skipping %s: not a readable image (%s)", path, e)
        return None


def network_input(image: np.ndarray, image_id: int, opts: transforms.TransformOptions) -> dict[str, np.ndarray]:
    """The eval transform of one image (resize to fit, round, pad): one example of the batch layout, as numpy.

    Returns:
      {key: array} for every key of input_pipeline.batch, shapes without the batch dimension: image
      uint8 [H, W, 3], image_hw int32 [2] the resized image's (h, w), boxes float32 [max_boxes, 4] all
      padding (zeros), scale float32 [] network px per original px, ...
    """
    example = {
        "image": image,
        "boxes": np.zeros((0, 4), np.float32),
        "labels": np.zeros((0,), np.int32),
        "image_id": np.int32(image_id),
    }
    transformed = transforms.eval_transform(example, opts)
    return {key: np.asarray(transformed[key]) for key in batch_layout.KEYS}


def predict_images(predictor: Predictor, inputs: Sequence[str], output: str) -> list[dict[str, Any]] | None:
    """Predicts every image of `inputs`; process 0 writes OUTPUT and returns the COCO results (None elsewhere).

    Works through one global batch at a time, so memory does not grow with the
    number of images. Image ids are positions in the sorted input list.
    """
    paths = find_images(inputs)
    opts = transforms.TransformOptions.from_config(predictor.config)
    info = predictor.dataset_info
    is_primary = jax.process_index() == 0
    output_dir = epath.Path(output)
    global_size = predictor.batch_size
    local_rows = range(
        predictor.first_row(), predictor.first_row() + global_size // jax.device_count() * jax.local_device_count()
    )
    blank = batch_layout.empty_example(predictor.config.input.image_size, predictor.config.input.max_boxes)
    pictures = dict(zip(range(len(paths)), _picture_names(paths)))
    label_of_category = {int(c): label for label, c in enumerate(info.label_to_category_id)}
    results: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    start = time.perf_counter()
    num_batches = -(-len(paths) // global_size)
    for batch_index in track(
        range(num_batches), "predict", num_batches, unit="batches", log_every_s=10.0, enabled=is_primary
    ):
        first = batch_index * global_size
        images = {i: read_image(paths[i]) for i in (first + row for row in local_rows) if i < len(paths)}
        rows = [
            network_input(images[i], i, opts) if images.get(i) is not None else blank
            for i in (first + row for row in local_rows)
        ]
        local_batch = {k: np.stack([row[k] for row in rows]) for k in blank}
        outputs = predictor(predictor.global_batch(local_batch))
        # Every process takes part in the gather; process 0 writes.
        outputs = multihost_utils.process_allgather(outputs, tiled=True)
        if not is_primary:
            continue
        detections = coco_evaluation.detections_to_coco(outputs, info.label_to_category_id)
        results.extend(detections)
        for image_id, (height, width) in zip(
            outputs["image_id"][outputs["example_mask"]], outputs["original_size"][outputs["example_mask"]]
        ):
            image_id = int(image_id)
            entries.append(
                {"id": image_id, "file_name": str(paths[image_id]), "height": int(height), "width": int(width)}
            )
            mine = [d for d in detections if d["image_id"] == image_id]
            boxes_yxyx = np.array(
                [[y, x, y + h, x + w] for x, y, w, h in (d["bbox"] for d in mine)], np.float32
            ).reshape(-1, 4)
            image = images[image_id] if image_id in images else read_image(paths[image_id])
            instance_masks = None
            if mine and "segmentation" in mine[0]:
                decoded = np.asarray(hotcoco.mask.decode([d["segmentation"] for d in mine]), bool)
                instance_masks = np.moveaxis(decoded.reshape(int(height), int(width), len(mine)), -1, 0)
            picture = drawing.draw_detections(
                image,
                boxes_yxyx,
                np.array([label_of_category[d["category_id"]] for d in mine], np.int32),
                np.array([d["score"] for d in mine], np.float32),
                info.class_names,
                masks=instance_masks,
            )
            drawing.save_png(picture, output_dir / pictures[image_id])
    if not is_primary:
        return None
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / DETECTIONS_FILE).write_text(json.dumps(results))
    (output_dir / IMAGES_FILE).write_text(json.dumps(entries, indent=1))
    logging.info(
        "predicted %d images (%d unreadable, skipped) in %.1fs: %d detections with score >= %.2f; wrote %s",
        len(entries),
        len(paths) - len(entries),
        time.perf_counter() - start,
        len(results),
        predictor.config.postprocess.score_threshold,
        output_dir,
    )
    return results


def _picture_names(paths: Sequence[epath.Path]) -> list[str]:
    """`NAME.png` per input; `NAME_ID.png` (ID: the image id) where inputs share a name (a.jpg, a.png, x/a.jpg)."""
    stems = [path.stem for path in paths]
    return [
        f"{stem}.png" if stems.count(stem) == 1 else f"{stem}_{image_id}.png" for image_id, stem in enumerate(stems)
    ]

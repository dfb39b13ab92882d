"""Input-pipeline throughput on this machine: how many images/s can the host feed?

  python -m benchmarks.input_pipeline                       # both pipelines below
  python -m benchmarks.input_pipeline --batches=40 --threads=1 --threads=2

Pipelines measured (each from a prepared split, reading, decoding and
transforming exactly as training does, batches pulled as fast as possible):
  default    configs/default.py: synthetic shapes, 128 px PNGs, scale jitter
             0.75-1.25 + flip to 128 x 128, global batch 16.
  coco_lsj   configs/vitdet_b_coco.py's input on a generated COCO-format
             folder of 640 x 480 JPEGs (COCO's typical size, 7 boxes each):
             large-scale jitter 0.1-2.0 + flip, crop/pad to 1024 x 1024,
             global batch 64 read by one process (the per-host load of one
             host feeding 8 accelerators at 8 images each).

Prints a markdown table: pipeline, output size, tf.data threads, images/s,
images/s per thread (one thread keeps one host core busy), ms per batch, and
the host cores a host with --accelerators accelerators training at
--images_per_second images/s each needs for input alone (their product over
the images/s per thread, rounded up), and the share of images the host
resized: "all" without input.resize_on_device; with it, those whose crop
window's source pixels did not fit the source canvas (input.source_size). Compare images/s with the train step's
images/s per host (benchmarks.scaling, benchmarks.gpu): below it, training
waits for input (the trainer logs that wait as `input wait`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks import report

_BATCHES = flags.DEFINE_integer("batches", 20, "Timed batches per pipeline (after 3 warm-up batches).")
_THREADS = flags.DEFINE_multi_integer("threads", [0], "tf.data threads per pipeline (0: the config's default).")
_PIPELINES = flags.DEFINE_multi_string("pipelines", ["default", "coco_lsj"], "Which pipelines to measure.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where datasets are generated (default: a temporary directory).")
_COCO_IMAGES = flags.DEFINE_integer("coco_images", 256, "Images in the generated COCO-format folder.")
_SYNTHETIC_IMAGES = flags.DEFINE_integer(
    "synthetic_images",
    0,
    "Train images the default pipeline's synthetic dataset is generated with (0: the config's). Fewer generate "
    "faster and measure the same: batches repeat the split.",
    lower_bound=0,
)
_ACCELERATORS = flags.DEFINE_integer("accelerators", 8, "Accelerators one host feeds, for the host-cores column.")
_IMAGES_PER_SECOND = flags.DEFINE_float(
    "images_per_second", 300.0, "Training images/s of one accelerator, for the host-cores column."
)


def _write_coco_folder(root: str, num_images: int) -> tuple[str, str]:
    """A COCO-format folder of 640x480 JPEGs with 7 random boxes each; returns (json, image dir)."""
    from PIL import Image

    image_dir = os.path.join(root, "images")
    json_path = os.path.join(root, "instances.json")
    if os.path.exists(json_path):
        return json_path, image_dir
    os.makedirs(image_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    images, annotations = [], []
    for index in range(num_images):
        # Smooth content compresses like a photo; pure noise would inflate JPEG decode cost.
        small = rng.integers(0, 256, (15, 20, 3), np.uint8)
        image = Image.fromarray(small).resize((640, 480), Image.BICUBIC)
        name = f"{index:08d}.jpg"
        image.save(os.path.join(image_dir, name), quality=90)
        images.append({"id": index + 1, "file_name": name, "width": 640, "height": 480})
        for _ in range(7):
            w, h = rng.uniform(20, 300, size=2)
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 480 - h)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": index + 1,
                    "category_id": int(rng.integers(1, 81)),
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
    categories = [{"id": i, "name": f"class{i}"} for i in range(1, 81)]
    with open(json_path, "w") as f:
        json.dump({"images": images, "annotations": annotations, "categories": categories}, f)
    return json_path, image_dir


def _resized_on_the_host(batch) -> np.ndarray:
    """bool [B]: with input.resize_on_device, the examples the host still resized (their window's source did not
    fit): the identity geometry on an image of another size than the original."""
    from input_pipeline.batch import IDENTITY_GEOMETRY

    identity = (batch["source_to_image"] == np.float32(IDENTITY_GEOMETRY)).all(-1) & ~batch["source_flipped"]
    resized = (batch["image_hw"] != batch["original_size"]).any(-1)
    return batch["example_mask"] & identity & resized


def _config(name: str, root: str):
    from configs import default, vitdet_b_coco

    if name == "default":
        config = default.get_config()
        config.dataset.data_dir = os.path.join(root, "data")
        if _SYNTHETIC_IMAGES.value:
            config.dataset.num_train_examples = _SYNTHETIC_IMAGES.value
            config.dataset.num_eval_examples = min(config.dataset.num_eval_examples, _SYNTHETIC_IMAGES.value)
        return config
    if name == "coco_lsj":
        config = vitdet_b_coco.get_config()
        json_path, image_dir = _write_coco_folder(os.path.join(root, "coco_folder"), _COCO_IMAGES.value)
        config.dataset.name = "coco_json"
        config.dataset.data_dir = os.path.join(root, "data")
        for split in ("train", "eval"):
            config.dataset[f"{split}_json"] = json_path
            config.dataset[f"{split}_images"] = image_dir
        return config
    raise app.UsageError(f"unknown pipeline {name!r}; choose default or coco_lsj")


def main(argv: list[str]) -> None:
    del argv
    import input_pipeline

    root = _WORKDIR.value or tempfile.mkdtemp(prefix="input_bench_")
    os.makedirs(root, exist_ok=True)
    rows = []
    for name in _PIPELINES.value:
        config = _config(name, root)
        input_pipeline.get_dataset_info(config)  # convert once, outside the timing
        for threads in _THREADS.value:
            config.input.num_threads = threads or None
            iterator = input_pipeline.create_train_iterator(config)
            for _ in range(3):
                next(iterator)
            start = time.perf_counter()
            examples, on_host = 0, 0
            for _ in range(_BATCHES.value):
                batch_arrays = next(iterator)
                examples += int(batch_arrays["example_mask"].sum())
                on_host += int(_resized_on_the_host(batch_arrays).sum())
            elapsed = time.perf_counter() - start
            batch = config.global_batch_size
            used_threads = input_pipeline.num_threads(config)
            images_per_s = _BATCHES.value * batch / elapsed
            rows.append(
                (
                    name,
                    "x".join(str(v) for v in config.input.image_size),
                    batch,
                    f"{used_threads}" + ("" if threads else " (default)"),
                    images_per_s,
                    images_per_s / used_threads,
                    1000 * elapsed / _BATCHES.value,
                    math.ceil(_ACCELERATORS.value * _IMAGES_PER_SECOND.value * used_threads / images_per_s),
                    f"{100 * on_host / max(examples, 1):.0f}%" if config.input.resize_on_device else "all",
                )
            )
            print(f"{name}: {images_per_s:.1f} images/s", flush=True)
    report.emit(
        "input_pipeline",
        f"Input pipeline on {os.cpu_count()} CPU cores ({_BATCHES.value} batches each)",
        [
            "pipeline",
            "output",
            "batch",
            "tf.data threads",
            "images/s",
            "images/s per thread",
            "ms/batch",
            f"host cores for {_ACCELERATORS.value} x {_IMAGES_PER_SECOND.value:g} images/s",
            "resized on the host",
        ],
        rows,
        extra={"accelerators": _ACCELERATORS.value, "images_per_second_per_accelerator": _IMAGES_PER_SECOND.value},
    )


if __name__ == "__main__":
    app.run(main)

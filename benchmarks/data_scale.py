"""How preparing a COCO-format folder scales: time, memory and the cost of opening what it wrote.

  python -m benchmarks.data_scale                                # 20,000 and 200,000 images, 1 and 2 workers
  python -m benchmarks.data_scale --images=2000 --workers=1,2,4  # a quick look

For each --images count, a synthetic COCO-format folder is generated once
under --workdir: hard links to four real 640x480 JPEGs (so file reading and
header parsing are real, the disk holds four images), about 7 boxes per
image over COCO's 80 category ids (1-90 with gaps), and its instances JSON.
For each --workers count a fresh process (`--child`) prepares the folder's
train split exactly as training does (input_pipeline.prepare_split with
dataset.prepare_workers), then opens the prepared split (cache.load_split,
best of 3) and builds the first batch of a small training pipeline
(create_train_iterator + next(), 256 px, batch 8). The table shows:

  JSON MB            the instances JSON's size
  prepare s          wall time of prepare_split (parsing the JSON, the workers, merging)
  images/s           images / prepare s
  peak RSS GB        the peak of the resident sets of the preparing process
                     (which imports TensorFlow and JAX, as training does) and
                     its workers added together, sampled every 50 ms from
                     outside while prepare_split runs (/proc VmRSS of the
                     process tree)
  prepare RSS GB     the preparing process's own peak (it parses the JSON)
  index MB           index.npz (what every training process loads)
  open s             load_split of the prepared split (file checks + index)
  first batch s      create_train_iterator + the first next()

The prepared split is deleted after each row; the folders stay for the next run.

A second table scores validation sets of --scoring_sizes (IMAGES:CLASSES,
100 detections per image) with coco_ap and hotcoco and, up to
--pycocotools_max_images, pycocotools and faster-coco-eval on the same
detections (benchmarks.coco_scoring).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

from benchmarks import coco_scoring, report
from benchmarks.process_tree import resident_bytes

_IMAGES = flags.DEFINE_list("images", ["20000", "200000"], "Image counts of the generated folders.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "dataset.prepare_workers values to measure.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where folders and splits go (default: a new temporary directory).")
_CHILD = flags.DEFINE_string("child", None, "Internal: JSON of one measurement, run in this process.")
_SCORING_SIZES = flags.DEFINE_list(
    "scoring_sizes", ["5000:80", "20000:365"], "IMAGES:CLASSES validation sets to score (empty: none)."
)
_PREPARED_MARK = "prepared: split written"

_SOURCE_IMAGES = 4
_BOXES_PER_IMAGE = 7


def _source_jpegs(directory: str) -> list[str]:
    """Four smooth 640x480 JPEGs (they compress like photos: about 20 KB each)."""
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for k in range(_SOURCE_IMAGES):
        path = os.path.join(directory, f"source{k}.jpg")
        if not os.path.exists(path):
            small = rng.integers(0, 256, (15, 20, 3), np.uint8)
            Image.fromarray(small).resize((640, 480), Image.BICUBIC).save(path, quality=90)
        paths.append(path)
    return paths


def write_folder(root: str, num_images: int) -> tuple[str, str]:
    """A COCO-format folder of `num_images` images under root (reused when complete); (json path, image dir)."""
    from input_pipeline.datasets.categories import COCO_CATEGORY_IDS

    folder = os.path.join(root, f"coco_{num_images}")
    json_path, image_dir = os.path.join(folder, "instances.json"), os.path.join(folder, "images")
    if os.path.exists(json_path):
        return json_path, image_dir
    os.makedirs(image_dir, exist_ok=True)
    sources = _source_jpegs(os.path.join(root, "sources"))
    for i in range(num_images):
        name = os.path.join(image_dir, f"{i + 1:012d}.jpg")
        if not os.path.exists(name):
            os.link(sources[i % len(sources)], name)
    rng = np.random.default_rng(num_images)
    count = num_images * _BOXES_PER_IMAGE
    w, h = rng.uniform(20, 300, count).round(2), rng.uniform(20, 300, count).round(2)
    x, y = (rng.uniform(0, 1, count) * (640 - w)).round(2), (rng.uniform(0, 1, count) * (480 - h)).round(2)
    image_ids = np.repeat(np.arange(1, num_images + 1), _BOXES_PER_IMAGE)
    categories = np.asarray(COCO_CATEGORY_IDS)[rng.integers(0, len(COCO_CATEGORY_IDS), count)]
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        f.write('{"info": {"description": "benchmarks.data_scale"}, "images": [')
        f.write(
            ", ".join(
                f'{{"id": {i}, "file_name": "{i:012d}.jpg", "width": 640, "height": 480}}'
                for i in range(1, num_images + 1)
            )
        )
        f.write('], "annotations": [')
        f.write(
            ", ".join(
                f'{{"id": {k + 1}, "image_id": {i}, "category_id": {c}, "bbox": [{a}, {b}, {c_}, {d}], '
                f'"area": {round(c_ * d, 2)}, "iscrowd": 0}}'
                for k, (i, c, a, b, c_, d) in enumerate(
                    zip(image_ids.tolist(), categories.tolist(), x.tolist(), y.tolist(), w.tolist(), h.tolist())
                )
            )
        )
        f.write('], "categories": [')
        f.write(", ".join(f'{{"id": {c}, "name": "class{c}"}}' for c in COCO_CATEGORY_IDS))
        f.write("]}")
    os.rename(tmp, json_path)
    return json_path, image_dir


def _config(json_path: str, image_dir: str, cache_dir: str, workers: int):
    from configs import default

    config = default.get_config()
    config.dataset.name = "coco_json"
    for split in ("train", "eval"):
        config.dataset[f"{split}_json"] = json_path
        config.dataset[f"{split}_images"] = image_dir
    config.dataset.cache_dir = cache_dir
    config.dataset.prepare_workers = workers
    config.input.image_size = (256, 256)
    config.global_batch_size = 8
    return config


def _child(spec: dict) -> None:
    """One measurement (see module doc); prints its JSON as the last line of stdout."""
    import input_pipeline
    from input_pipeline.datasets import cache, splits  # noqa: F401  (imported here: not timed)

    config = _config(spec["json"], spec["images"], spec["cache_dir"], spec["workers"])
    start = time.perf_counter()
    split = input_pipeline.prepare_split(config, "train", sync=False)
    prepare_s = time.perf_counter() - start
    print(_PREPARED_MARK, flush=True)  # the parent stops sampling the process tree's memory here
    # Before the training pipeline adds its own.
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    open_s = []
    for _ in range(3):
        start = time.perf_counter()
        cache.load_split(split.directory)
        open_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    next(input_pipeline.create_train_iterator(config))
    first_batch_s = time.perf_counter() - start
    result = {
        "prepare_s": prepare_s,
        "prepare_peak_bytes": own_peak,
        "records": split.num_records,
        "shards": len(split.shard_paths),
        "index_bytes": os.path.getsize(os.path.join(split.directory, cache.INDEX)),
        "open_s": min(open_s),
        "first_batch_s": first_batch_s,
    }
    print(json.dumps(result), flush=True)


def _measure(json_path: str, image_dir: str, cache_dir: str, workers: int) -> dict:
    spec = {"json": json_path, "images": image_dir, "cache_dir": cache_dir, "workers": workers}
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.data_scale", f"--child={json.dumps(spec)}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = {"bytes": 0}
    preparing = threading.Event()
    preparing.set()

    def sample() -> None:
        while preparing.is_set() and child.poll() is None:
            peak["bytes"] = max(peak["bytes"], resident_bytes(child.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = []
    reader = threading.Thread(target=lambda: stderr.extend(child.stderr), daemon=True)
    reader.start()
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.strip() == _PREPARED_MARK:
            preparing.clear()
    child.wait()
    preparing.clear()
    sampler.join()
    reader.join()
    if child.returncode != 0:
        sys.exit(f"error: preparing {json_path} with {workers} workers failed:\n{''.join(stderr)[-3000:]}")
    result = json.loads(lines[-1])
    result["peak_bytes"] = peak["bytes"]
    return result


def scoring_section() -> None:
    """The scoring table (see the module doc)."""
    sizes = [tuple(int(v) for v in pair.split(":")) for pair in _SCORING_SIZES.value]
    if not sizes:
        return
    rows = coco_scoring.scoring_rows(sizes, pycocotools_max_images=coco_scoring.PYCOCOTOOLS_MAX_IMAGES.value)
    columns = list(rows[0])
    report.emit(
        "data_scale_scoring",
        "COCO bbox scoring of validation sets: coco_ap (hotcoco) against pycocotools on the same detections",
        columns,
        [[row[c] for c in columns] for row in rows],
    )


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        _child(json.loads(_CHILD.value))
        return
    root = _WORKDIR.value or tempfile.mkdtemp(prefix="data_scale_")
    os.makedirs(root, exist_ok=True)
    rows = []
    for num_images in sorted(int(n) for n in _IMAGES.value):
        start = time.perf_counter()
        json_path, image_dir = write_folder(root, num_images)
        print(f"folder of {num_images} images ready ({time.perf_counter() - start:.0f} s)", flush=True)
        for workers in (int(w) for w in _WORKERS.value):
            cache_dir = os.path.join(root, f"prepared_{num_images}_{workers}")
            shutil.rmtree(cache_dir, ignore_errors=True)
            measured = _measure(json_path, image_dir, cache_dir, workers)
            shutil.rmtree(cache_dir, ignore_errors=True)
            gb = 1e9
            rows.append(
                [
                    num_images,
                    workers,
                    os.path.getsize(json_path) / 1e6,
                    measured["prepare_s"],
                    num_images / measured["prepare_s"],
                    measured["peak_bytes"] / gb,
                    measured["prepare_peak_bytes"] / gb,
                    measured["index_bytes"] / 1e6,
                    measured["open_s"],
                    measured["first_batch_s"],
                ]
            )
            print(f"{num_images} images, {workers} workers: {measured}", flush=True)
    report.emit(
        "data_scale",
        f"Preparing a synthetic COCO-format folder ({_BOXES_PER_IMAGE} boxes per image, 80 classes) on "
        f"{os.cpu_count()} CPU cores",
        [
            "images",
            "workers",
            "JSON MB",
            "prepare s",
            "images/s",
            "peak RSS GB",
            "prepare RSS GB",
            "index MB",
            "open s",
            "first batch s",
        ],
        rows,
        extra={"workdir": root},
    )
    scoring_section()


if __name__ == "__main__":
    app.run(main)

"""How bulk prediction scales: images/s, peak memory and output size for 1 and 2 processes, 20k and 200k images.

  python -m benchmarks.predict_scale                              # 20,000 and 200,000 images, 1 and 2 processes
  python -m benchmarks.predict_scale --images=2000 --processes=1   # a quick look

A tiny RetinaNet (the default recipe at 64 px, widths 8-16) is trained for 2
steps on the embedded dataset, once under --workdir; the inputs are hard
links to 16 real 320x240 JPEGs, 1,000 to a folder (reading and decoding are
real, the disk holds 16 images). Each row runs `python -m detector.predict`
over them into a fresh output: with 1 process pinned to one core (`taskset
-c 0`), or 2 processes joined over 127.0.0.1 (jax.distributed) pinned to a
core each, one CPU device per process, global batch 32, 20 detections an
image (score threshold 0). Both read and decode
the next batches in a thread while the device runs. The table shows:

  images/s        images / the prediction loop's seconds (`predicted N images in S s`, process 0's log)
  wall s          from starting the processes to the last one's exit (start-up and compiling included)
  peak RSS MB     the largest peak resident set among the processes (getrusage of each child)
  output MB       the shards and the merged index

What 2 processes should show against 1: about twice the images/s (each
decodes and predicts its own rows), and per-process memory flat in the
number of images (paths are memory-mapped from the on-disk index, rows go
to disk as they are committed).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks import report

_IMAGES = flags.DEFINE_list("images", ["20000", "200000"], "Image counts to predict.")
_PROCESSES = flags.DEFINE_list("processes", ["1", "2"], "Process counts (each pinned to its own core).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the model, images and outputs go (default: a temporary dir).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Global batch size.")
_PER_FOLDER = 1000
_DISTINCT = 16
_MODEL = {
    "dataset.num_train_examples": 64,
    "dataset.num_eval_examples": 16,
    "dataset.image_size": 64,
    "input.image_size": "(64,64)",
    "input.max_boxes": 8,
    "global_batch_size": 8,
    "eval_batch_size": 8,
    "model.fpn_features": 16,
    "model.head_features": 16,
    "model.head_convs": 1,
    "model.backbone.width": 8,
    "total_steps": 2,
    "checkpoint_every_steps": 2,
    "eval_every_steps": 2,
}


def _model_flags(workdir: str) -> list[str]:
    return [
        "--config=configs/default.py",
        f"--workdir={os.path.join(workdir, 'model')}",
        f"--config.dataset.data_dir={os.path.join(workdir, 'data')}",
        *(f"--config.{key}={value}" for key, value in _MODEL.items()),
    ]


def _train(workdir: str) -> None:
    if os.path.isdir(os.path.join(workdir, "model", "checkpoints")):
        return
    subprocess.run([sys.executable, "-m", "detector.train", *_model_flags(workdir)], check=True, capture_output=True)


def _images(workdir: str, count: int) -> str:
    """A folder of `count` hard links to _DISTINCT JPEGs, _PER_FOLDER to a subfolder (made once)."""
    from PIL import Image

    folder = os.path.join(workdir, f"images_{count}")
    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return folder
    originals = os.path.join(workdir, "originals")
    os.makedirs(originals, exist_ok=True)
    rng = np.random.default_rng(0)
    sources = []
    for i in range(_DISTINCT):
        path = os.path.join(originals, f"{i}.jpg")
        if not os.path.exists(path):
            # Smooth noise compresses like a photo, not like white noise.
            small = rng.integers(0, 256, (30, 40, 3), np.uint8)
            Image.fromarray(small).resize((320, 240), Image.BILINEAR).save(path, quality=90)
        sources.append(path)
    for i in range(count):
        sub = os.path.join(folder, f"{i // _PER_FOLDER:05d}")
        if i % _PER_FOLDER == 0:
            os.makedirs(sub, exist_ok=True)
        target = os.path.join(sub, f"{i:08d}.jpg")
        if not os.path.exists(target):
            os.link(sources[i % _DISTINCT], target)
    open(done, "w").close()
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(workdir: str, images: str, processes: int, output: str) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    xla_flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*xla_flags, "--xla_force_host_platform_device_count=1"])
    command = [
        sys.executable,
        "-m",
        "detector.predict",
        *_model_flags(workdir),
        f"--output={output}",
        f"--batch_size={_BATCH.value}",
        # Every image keeps its 20 best detections: the rows carry a pseudo-labelling run's load.
        "--score_threshold=0",
        "--max_detections=20",
        "--pictures=0",
        images,
    ]
    address = f"127.0.0.1:{_free_port()}"
    logs = [os.path.join(workdir, f"log_{processes}_{i}.txt") for i in range(processes)]
    start = time.perf_counter()
    children = []
    for i in range(processes):
        joined = [f"--coordinator_address={address}", f"--num_processes={processes}", f"--process_id={i}"]
        with open(logs[i], "w") as log:
            children.append(
                subprocess.Popen(
                    ["taskset", "-c", str(i % (os.cpu_count() or 1)), *command, *(joined if processes > 1 else [])],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    peak_kb = 0
    for child in children:
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        peak_kb = max(peak_kb, usage.ru_maxrss)
    wall = time.perf_counter() - start
    text = open(logs[0]).read()
    if any(child.returncode for child in children):
        raise SystemExit(f"error: detector.predict failed ({processes} processes); see {logs}:\n{text[-2000:]}")
    match = re.search(r"predicted (\d+) images .* in ([\d.]+)s", text)
    predicted, seconds = int(match.group(1)), float(match.group(2))
    size = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(output)
        if "inputs" not in root
        for name in names
    )
    return {
        "images": predicted,
        "loop_s": seconds,
        "wall_s": wall,
        "peak_rss_mb": peak_kb / 1024,
        "output_mb": size / 1e6,
    }


def main(argv: list[str]) -> None:
    del argv
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="predict_scale_")
    os.makedirs(workdir, exist_ok=True)
    _train(workdir)
    rows = []
    for count in (int(n) for n in _IMAGES.value):
        folder = _images(workdir, count)
        for processes in (int(p) for p in _PROCESSES.value):
            measured = _run(workdir, folder, processes, os.path.join(workdir, f"out_{count}_{processes}"))
            rows.append(
                [
                    count,
                    processes,
                    measured["images"] / measured["loop_s"],
                    measured["wall_s"],
                    measured["peak_rss_mb"],
                    measured["output_mb"],
                ]
            )
            print(rows[-1], flush=True)
    report.emit(
        "predict_scale",
        "Bulk prediction (detector.predict), a tiny RetinaNet at 64 px, 320x240 JPEGs, each process on one core",
        ["images", "processes", "images/s", "wall s", "peak RSS MB", "output MB"],
        rows,
        extra={"workdir": workdir, "batch_size": _BATCH.value},
    )


if __name__ == "__main__":
    app.run(main)

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

A second table puts the same model's exported programs side by side, each
timed in one process pinned to one core on the same preprocessed batch
(uint8 network inputs, so decoding is left out): the StableHLO program
(`detector.export`, run by JAX) and the ONNX model (`--format=onnx`, run by
onnxruntime's CPU provider), at batches of 1 and --batch_size; the median of
20 calls after 3 warm-up calls. Left out, with a line saying so, where the
ONNX converter is not installed.
"""

from __future__ import annotations

import json
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


_PROGRAM_TIMING = """
import json, sys, time
import numpy as np
from detector.serving import artifact
directory, batch_size = sys.argv[1], int(sys.argv[2])
detector = artifact.load_artifact(directory)
height, width = detector.metadata["input"]["image_size"]
rng = np.random.default_rng(0)
images = rng.integers(0, 256, (batch_size, height, width, 3), np.uint8)
image_hw = np.tile(np.array([[height, width]], np.int32), (batch_size, 1))
for _ in range(3):
    detector.call(images, image_hw)
seconds = []
for _ in range(20):
    start = time.perf_counter()
    detector.call(images, image_hw)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"median_s": float(np.median(seconds))}))
"""


def _export(workdir: str, program_format: str, batch_size: int) -> str:
    output = os.path.join(workdir, f"export_{program_format}_{batch_size}")
    command = [sys.executable, "-m", "detector.export", *_model_flags(workdir), f"--output={output}"]
    command += [f"--format={program_format}", f"--batch_size={batch_size}", "--config.postprocess.score_threshold=0.0"]
    command += ["--config.postprocess.max_detections=20"]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return output


def _program_rows(workdir: str) -> list[list]:
    """[program, batch, ms per call, images/s] for the StableHLO program and the ONNX model, one core each."""
    try:
        import jax2onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        print(f"ONNX rows left out: {e.name} is not installed (pip install -e '.[onnx]', then jax2onnx)", flush=True)
        return []
    rows = []
    onnx_model = _export(workdir, "onnx", 1)
    for batch_size in sorted({1, _BATCH.value}):
        for name, directory in (
            ("StableHLO (JAX)", _export(workdir, "jax", batch_size)),
            ("ONNX (onnxruntime)", onnx_model),
        ):
            result = subprocess.run(
                ["taskset", "-c", "0", sys.executable, "-c", _PROGRAM_TIMING, directory, str(batch_size)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"},
            )
            median_s = json.loads(result.stdout.strip().splitlines()[-1])["median_s"]
            rows.append([name, batch_size, 1000 * median_s, batch_size / median_s])
            print(rows[-1], flush=True)
    return rows


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
    program_rows = _program_rows(workdir)
    if program_rows:
        report.emit(
            "predict_scale_programs",
            "The exported programs of the same model, one core, one preprocessed batch (20 detections an image)",
            ["program", "batch", "ms per call", "images/s"],
            program_rows,
            extra={"workdir": workdir},
        )


if __name__ == "__main__":
    app.run(main)

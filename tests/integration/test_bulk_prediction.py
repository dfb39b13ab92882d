"""Bulk prediction as a cluster runs it: two real processes, one killed with SIGKILL mid-run, the command again.

The model is test_train's reference run (the tiny RetinaNet at 64 px); the
inputs are 2,000 hard links to a few small images (reading and decoding is
real, the files are few).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
from PIL import Image

from detector.serving import prediction_shards
from tests.helpers.processes import start_processes
from tests.helpers.tiny_config import as_flags

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

IMAGES = 2000


@pytest.fixture(scope="module")
def many_images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(0)
    originals = []
    for i, (height, width) in enumerate(((64, 64), (48, 80), (90, 60), (40, 40))):
        originals.append(folder / f"original_{i}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(originals[-1])
    (folder / "images").mkdir()
    for i in range(IMAGES - 1):
        os.link(originals[i % len(originals)], folder / "images" / f"{i:05d}.png")
    (folder / "images" / f"{IMAGES - 1:05d}.jpg").write_bytes(b"not an image")  # counted, listed, not fatal
    return folder / "images"


def predict_command(reference_run, data_dir, images, output):
    return [
        sys.executable,
        "-m",
        "detector.predict",
        "--config=configs/default.py",
        f"--workdir={reference_run.workdir}",
        f"--output={output}",
        "--batch_size=16",
        "--score_threshold=0.05",
        "--commit_every_s=1",
        "--heartbeat_timeout_s=30",
        *as_flags(data_dir),
        str(images),
    ]


def test_a_killed_process_stops_its_peer_in_one_line_and_the_command_again_finishes_the_run(
    reference_run, data_dir, many_images, tmp_path
):
    cache = tmp_path / "cache"
    reference = tmp_path / "reference"
    (whole,) = start_processes(predict_command(reference_run, data_dir, many_images, reference), 1, 2, cache)
    assert whole.finish() == 0, whole.output[-3000:]

    output = tmp_path / "killed"
    command = predict_command(reference_run, data_dir, many_images, output)
    runs = start_processes(command, 2, 1, cache)
    manifest = output / prediction_shards.MANIFESTS_DIR / f"{prediction_shards.shard_name(1, 2)}.json"
    deadline = time.monotonic() + 240
    while not manifest.exists():  # process 1 has committed rows: mid-run
        assert time.monotonic() < deadline and runs[1].popen.poll() is None, runs[1].output[-3000:]
        time.sleep(0.2)
    runs[1].kill(signal.SIGKILL)
    killed_at = time.monotonic()
    assert runs[1].finish() == -signal.SIGKILL
    code = runs[0].finish(timeout=90)
    assert time.monotonic() - killed_at < 60
    survivor = runs[0].output
    assert code == 1, survivor[-3000:]
    errors = [line for line in survivor.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another process of this launch stopped" in errors[0], survivor[-3000:]
    assert "Traceback" not in survivor and "Check failure" not in survivor, survivor[-3000:]
    assert not (output / prediction_shards.MERGED_FILE).exists()

    again = start_processes(command, 2, 1, cache)
    for run in again:
        assert run.finish() == 0, run.output[-3000:]
    assert any("resuming" in line for line in again[0].lines), again[0].output[-3000:]
    got = prediction_shards.read_merged(str(output)).to_pylist()
    want = prediction_shards.read_merged(str(reference)).to_pylist()
    assert sorted(row["image_id"] for row in got) == list(range(IMAGES))  # each image exactly once
    got.sort(key=lambda row: row["image_id"])
    assert [row["file"] for row in got] == [row["file"] for row in want]
    assert got[-1]["error"] and sum(row["error"] is not None for row in got) == 1
    for a, b in zip(got, want, strict=True):
        # Another process layout (2 x 1 device against 1 x 2), the same per-device batches.
        assert a["category_ids"] == b["category_ids"], a["image_id"]
        np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-5)
        np.testing.assert_allclose(
            np.reshape(a["boxes_xywh"], (-1, 4)), np.reshape(b["boxes_xywh"], (-1, 4)), atol=1e-3
        )

"""Two processes joined by jax.distributed: one COCO-format split prepared together; host bytes sent to process 0."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from input_pipeline.datasets import cache, conversion
from tests.helpers import REPO_ROOT
from tests.helpers.coco_folders import write_folder
from tests.helpers.pipeline_config import make_config
from tests.helpers.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = "tests.helpers.multiprocess_prepare_worker"
INDEX_KEYS = ("image_ids", "heights", "widths", "box_offsets", "boxes_yxyx", "labels", "is_crowd")


def test_two_processes_convert_their_shares_into_the_one_process_split(tmp_path):
    json_path, image_dir, _ = write_folder(tmp_path, "train", 30)
    config = make_config(
        tmp_path / "data",
        **{
            "dataset.name": "coco_json",
            "dataset.train_json": str(json_path),
            "dataset.train_images": str(image_dir),
            "dataset.cache_dir": str(tmp_path / "prepared"),
            "dataset.prepare_workers": 1,
        },
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(config.to_json())
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, str(config_path), str(port), "2", str(i)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("the two-process preparation timed out")
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    # Process 0 alone received every process's bytes, whole, in process order.
    size = 9 * 2**20 + 7
    assert outputs[0].pop("sent") == [[size, [1]], [size, [2]]] and outputs[1].pop("sent") is None
    # Both see the one split, written in two parts: each process converted its share.
    assert outputs[0] == outputs[1] and outputs[0]["shards"] == 2 and outputs[0]["records"] == 30
    together = cache.load_split(outputs[0]["directory"])
    alone = conversion.convert_coco_json(
        str(tmp_path / "alone"), str(json_path), str(image_dir), fingerprint="alone", workers=1
    )
    assert together.counts == alone.counts
    for key in INDEX_KEYS:
        np.testing.assert_array_equal(getattr(together, key), getattr(alone, key), err_msg=key)
    every = np.arange(alone.num_records)
    assert list(together.open_reader().read(every)) == list(alone.open_reader().read(every))
    assert sorted(os.listdir(tmp_path / "prepared" / "coco_json")) == sorted(
        [os.path.basename(outputs[0]["directory"]), os.path.basename(outputs[0]["directory"]) + ".lock"]
    )  # no temporary directory left

"""bulk_prediction without a model: who owns OUTPUT, and which images get pictures."""

import os

import numpy as np
import pytest

from detector.errors import ConfigError
from detector.serving import bulk_prediction


class ListSource:
    fingerprint = "f" * 64
    description = "a test list"

    def __len__(self):
        return 4

    def name(self, position):
        return ["/a/x.jpg", "/b/x.png", "/c/y.jpg", "/d/x.jpg"][position]

    def image_id(self, position):
        return 100 + position

    def read(self, position):
        return np.zeros((4, 6, 3), np.uint8)


RECORD = {
    "format": 1,
    "inputs": {"description": "x", "images": 3, "fingerprint": "a"},
    "model": {"workdir": "/w", "checkpoint": "last", "step": 4, "masks": False},
    "postprocess": {"score_threshold": 0.3, "max_detections": 100},
    "processes": 1,
    "batch_size": 8,
}


def test_output_is_claimed_once_and_another_run_is_refused(tmp_path):
    output = str(tmp_path / "out")
    bulk_prediction._refuse_foreign(output)  # a new folder
    os.makedirs(output)
    bulk_prediction._claim_output(output, RECORD)
    bulk_prediction._refuse_foreign(output)  # this run's
    bulk_prediction._claim_output(output, RECORD)  # the same run again: resumed
    other = {**RECORD, "inputs": {**RECORD["inputs"], "fingerprint": "b"}, "postprocess": {**RECORD["postprocess"]}}
    other["postprocess"]["score_threshold"] = 0.5
    with pytest.raises(ConfigError, match=r"another prediction run's results \(inputs.fingerprint 'a' there, 'b' now"):
        bulk_prediction._claim_output(output, other)
    with pytest.raises(ConfigError, match="score_threshold 0.3 there, 0.5 now"):
        bulk_prediction._claim_output(output, other)


def test_a_folder_of_other_files_is_refused(tmp_path):
    (tmp_path / "results.csv").write_text("mine")
    with pytest.raises(ConfigError, match=r"not empty and holds no prediction run \(results.csv\)"):
        bulk_prediction._refuse_foreign(str(tmp_path))
    with pytest.raises(ConfigError, match="is a file"):
        bulk_prediction._refuse_foreign(str(tmp_path / "results.csv"))


def test_pictures_default_to_all_of_a_small_run_and_a_few_of_a_large_one():
    assert bulk_prediction.picture_count(None, 12) == 12
    assert bulk_prediction.picture_count(None, 10_000) == bulk_prediction.PICTURES_BEYOND
    assert bulk_prediction.picture_count(3, 2) == 2 and bulk_prediction.picture_count(0, 50) == 0
    with pytest.raises(ConfigError, match="--pictures=-1"):
        bulk_prediction.picture_count(-1, 5)


def test_picture_names_add_the_id_where_names_repeat():
    assert bulk_prediction.picture_names(ListSource(), 3) == {0: "x_100.png", 1: "x_101.png", 2: "y.png"}


HOLD_LOCK = """
import sys, time
from input_pipeline import file_lock
lock = file_lock.FileLock(sys.argv[1], wait=False).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_it(tmp_path):
    """Another process (a real one) holds OUTPUT's lock: the second command stops with one line, writing nothing."""
    import subprocess
    import sys

    from PIL import Image

    from tests.helpers import REPO_ROOT

    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(photos / "a.png")
    output = tmp_path / "out"
    output.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(output / bulk_prediction.LOCK_FILE)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=r"--output=.* is in use by .*pid.*; wait for it to finish"):
            bulk_prediction.open_output(str(output), lambda source: RECORD, inputs=[str(photos)])
        assert sorted(os.listdir(output)) == [bulk_prediction.LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()
    source, record, lock = bulk_prediction.open_output(str(output), lambda source: RECORD, inputs=[str(photos)])
    lock.release()
    assert len(source) == 1 and record == RECORD

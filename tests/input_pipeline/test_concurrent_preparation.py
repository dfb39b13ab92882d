"""Independent processes preparing one fresh data dir at once: one generates and converts, the others reuse it.

Two real processes prepare the embedded dataset's train split. The test
holds both locks (the TFDS generation's and the split's) until both
processes are waiting on each, then lets go, so both really race for each
step instead of one finishing before the other starts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from input_pipeline import file_lock
from input_pipeline.datasets import synthetic_shapes as ss
from tests.helpers import REPO_ROOT

NUM_TRAIN, NUM_EVAL, SIZE = 8, 4, 32

PREPARE = f"""
import logging, sys
import ml_collections
import input_pipeline
logging.basicConfig(level=logging.INFO, force=True)
dataset = dict(name="synthetic_shapes", data_dir=sys.argv[1], train_split="train", eval_split="validation",
               num_train_examples={NUM_TRAIN}, num_eval_examples={NUM_EVAL}, image_size={SIZE}, cache_dir=None)
config = ml_collections.ConfigDict(dict(dataset=dataset, input=dict(max_bad_fraction=0.5)))
split = input_pipeline.prepare_split(config, "train")
print("prepared split", split.num_records, split.directory, flush=True)
"""

# Takes the locks named on the command line, says so, and waits (to be killed).
HOLDER = """
import sys, time
from input_pipeline import file_lock
locks = [file_lock.FileLock(path, wait=False).acquire() for path in sys.argv[1:]]
print("held", flush=True)
time.sleep(600)
"""


def lock_paths(data_dir) -> tuple[str, str]:
    """The locks of generating the dataset and of converting its train split."""
    name = ss.config_name(NUM_TRAIN, NUM_EVAL, SIZE)
    generation = data_dir / "synthetic_shapes" / f"{name}.lock"
    split = data_dir / "prepared" / "synthetic_shapes" / name / str(ss.SyntheticShapes.VERSION) / "train"
    return str(generation), f"{split}.lock"


def start_preparing(data_dir, log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", PREPARE, str(data_dir)], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )


def wait_until_all_logged(text: str, logs, processes, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(text in log.read_text() for log in logs):
        for process, log in zip(processes, logs):
            assert process.poll() is None, f"exited before logging {text!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not all logged {text!r}"
        time.sleep(0.1)


@pytest.mark.slow  # two processes that each start TensorFlow, one after the other at the locks: ~12 s
def test_two_processes_on_a_fresh_data_dir_prepare_it_once_and_both_use_it(tmp_path):
    data_dir = tmp_path / "data"
    generation_path, split_path = lock_paths(data_dir)
    generation = file_lock.FileLock(generation_path, wait=False).acquire()
    split = file_lock.FileLock(split_path, wait=False).acquire()
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    processes = [start_preparing(data_dir, log) for log in logs]
    try:
        wait_until_all_logged(f"to release {generation_path}", logs, processes)
        generation.release()  # both race to generate the dataset
        wait_until_all_logged(f"to release {split_path}", logs, processes)
        split.release()  # both race to convert the split
        codes = [process.wait(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    for output in outputs:
        assert "Traceback" not in output, output[-3000:]
    results = [[line for line in output.splitlines() if line.startswith("prepared split")] for output in outputs]
    assert results[0] == results[1] == [f"prepared split {NUM_TRAIN} {split_path.removesuffix('.lock')}"]
    # One generation of the dataset and one conversion of the split between them.
    combined = "".join(outputs)
    assert combined.count("Dataset synthetic_shapes downloaded and prepared to") == 1, combined[-5000:]
    assert combined.count(f"prepared {NUM_TRAIN} records in") == 1, combined[-5000:]


@pytest.mark.slow  # a killed holder, then a preparation that starts TensorFlow: ~7 s
def test_locks_left_by_a_process_killed_with_sigkill_do_not_block_preparation(tmp_path):
    data_dir = tmp_path / "data"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *lock_paths(data_dir)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    assert holder.wait(timeout=60) == -signal.SIGKILL
    preparing = subprocess.run(
        [sys.executable, "-c", PREPARE, str(data_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert preparing.returncode == 0, preparing.stderr[-3000:]
    assert f"prepared split {NUM_TRAIN} " in preparing.stdout
    assert "waiting for" not in preparing.stderr  # the dead holder's locks were free at once

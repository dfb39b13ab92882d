"""The global batch sequence does not depend on the number of processes, and resumes exactly.

Two local processes (4 fake CPU devices each, joined by jax.distributed over
127.0.0.1 with gloo collectives) stand in for two hosts; their global batches,
assembled as the trainer assembles them, must equal those of this single
process with 8 devices.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import input_pipeline
from tests.helpers import REPO_ROOT
from tests.helpers.pipeline_config import make_config
from tests.helpers.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = "tests.helpers.multiprocess_input_worker"
STEPS, RESUME_STEP = 3, 2
KEYS = ("image_id", "image", "boxes", "labels", "boxes_mask")


def _run_processes(config, tmp_path, num_processes):
    config_path = tmp_path / "config.json"
    config_path.write_text(config.to_json())
    out = tmp_path / "global_batches.npz"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, str(config_path), str(port), str(num_processes), str(i), str(out)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process input run timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp_data")
    input_pipeline.get_dataset_info(make_config(path))  # Prepared once, read by every process.
    return path


def test_two_processes_see_the_one_process_global_batches(data_dir, tmp_path):
    config = make_config(data_dir)  # global batch 8, synthetic shapes
    two = _run_processes(config, tmp_path, 2)
    np.testing.assert_array_equal(two["first_rows"], [0, 4])  # each process holds its half of every batch

    one = input_pipeline.create_train_iterator(config)  # one process: local batch == global batch
    reference = [next(one) for _ in range(STEPS)]
    for step, want in enumerate(reference):
        for key in KEYS:
            np.testing.assert_array_equal(two[f"step{step}_{key}"], want[key], err_msg=f"step {step} {key}")
    # Stop after RESUME_STEP steps and resume at the recorded position: the same batch.
    for key in KEYS:
        np.testing.assert_array_equal(two[f"resumed_{key}"], reference[RESUME_STEP][key], err_msg=key)
    # And different steps hold different images (the comparison above is not vacuous).
    assert not np.array_equal(reference[0]["image_id"], reference[1]["image_id"])

"""A damaged newest checkpoint (a truncated data file, as a failed copy leaves it): resume from the one before.

Uses the reference run (checkpoints at steps 2 and 4 of the tiny config) and
real files: the largest data file of step 4's state is cut to half its size.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

from tests.helpers.runs import flat
from tests.integration.test_fault_tolerance import saved_state
from tests.integration.test_workdir_mismatch import run_command

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]


def truncate_largest_file(step_dir: pathlib.Path) -> None:
    files = [path for path in step_dir.rglob("*") if path.is_file()]
    truncate(max(files, key=lambda path: path.stat().st_size))


def truncate(path: pathlib.Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.fixture
def damaged(reference_run, tmp_path):
    workdir = tmp_path / "damaged"
    shutil.copytree(reference_run.workdir, workdir)
    truncate_largest_file(workdir / "checkpoints" / "4" / "state")
    return workdir


def test_training_resumes_from_the_step_before_a_damaged_one(reference_run, damaged, data_dir):
    result = run_command("detector.train", damaged, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint of step 4 does not restore" in result.stderr
    assert "resuming from step 2" in result.stderr
    assert "Traceback" not in result.stderr
    names = sorted(os.listdir(damaged / "checkpoints"))
    assert "4.damaged-0" in names and "4" in names, names  # moved aside, never deleted
    # Steps 3 and 4 trained again from step 2: the reference run's step 4, bit for bit.
    expected, got = saved_state(reference_run.workdir, 4), saved_state(damaged, 4)
    assert flat(expected["params"]).keys() == flat(got["params"]).keys()
    for name, value in flat(expected["params"]).items():
        np.testing.assert_array_equal(flat(got["params"])[name], value, err_msg=name)
    for actual, wanted in zip(jax.tree.leaves(got["opt_state"]), jax.tree.leaves(expected["opt_state"]), strict=True):
        np.testing.assert_array_equal(actual, wanted)


def test_evaluate_falls_back_and_none_restoring_is_one_error_line(damaged, data_dir):
    # Evaluation reads the parameters alone, which the largest file may not hold: damage every file.
    for path in (damaged / "checkpoints" / "4" / "state").rglob("*"):
        if path.is_file():
            truncate(path)
    result = run_command("detector.evaluate", damaged, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint of step 4 does not restore" in result.stderr
    assert "loaded the parameters of step 2" in result.stderr
    assert sorted(os.listdir(damaged / "checkpoints")) == ["2", "4"]  # a reader changes nothing

    truncate_largest_file(damaged / "checkpoints" / "2" / "state")
    result = run_command("detector.train", damaged, data_dir, total_steps=6)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no checkpoint in" in errors[0] and "step 4" in errors[0] and "step 2" in errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]

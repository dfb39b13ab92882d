"""A workdir trained with another model: one clear error line, and `init_from` to fine-tune from it instead.

Uses the reference run (4 steps of the tiny config, FPN width 16) and asks
for an FPN of width 24: the neck's and head's parameters change shape, the
backbone's do not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import flax
import jax
import numpy as np
import pytest

import sharding
from detector.models import families
from detector.training import checkpointing
from detector.training.train_state import params_shardings
from tests.helpers import REPO_ROOT
from tests.helpers.tiny_config import as_flags, make_config
from tests.integration.test_export import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

WIDER = {"model.fpn_features": 24}


def run_command(module: str, workdir, data_dir, **overrides) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--config=configs/default.py",
            f"--workdir={workdir}",
            *as_flags(data_dir, **overrides),
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_one_mismatch_line(result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "was trained with another model" in errors[0]
    # The first differing parameter with both shapes, and the two ways out.
    # FPN 24 wide: the first differing parameter in path order is the head's first conv (input 16 -> 24).
    assert "head/box_conv0/kernel is (3, 3, 16, 16) there and (3, 3, 24, 16) in this config" in errors[0], errors
    assert "parameters differ, of 60" in errors[0], errors
    assert "new --workdir" in errors[0] and "--config.init_from=" in errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_training_a_changed_model_in_a_trained_workdir_is_one_error_line(reference_run, data_dir, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(reference_run.workdir, workdir)
    result = run_command("detector.train", workdir, data_dir, **WIDER, total_steps=6)
    assert_one_mismatch_line(result)
    assert checkpointing.checkpoint_dir(str(workdir)).exists()  # nothing was touched
    assert sorted(p.name for p in checkpointing.checkpoint_dir(str(workdir)).iterdir()) == ["2", "4"]


def test_evaluating_with_a_changed_model_is_one_error_line(reference_run, data_dir):
    assert_one_mismatch_line(run_command("detector.evaluate", reference_run.workdir, data_dir, **WIDER))


def test_init_from_loads_what_matches_and_lists_what_it_skips(reference_run, data_dir, tmp_path):
    config = make_config(data_dir, **WIDER)
    mesh = sharding.create_mesh(config.mesh, jax.devices()[:1])
    rules = sharding.logical_rules(config.sharding)
    model = families.create_model(config, 4)
    with sharding.use_mesh(mesh, rules):
        abstract, shardings = params_shardings(model, tuple(config.input.image_size), mesh, rules)
        fresh = jax.jit(
            lambda r: flax.linen.meta.unbox(model.init(r, np.zeros((1, 64, 64, 3)))["params"]), out_shardings=shardings
        )(jax.random.key(0))
    loaded, step, skipped = checkpointing.load_matching_params(str(reference_run.workdir), fresh)
    assert step == 4
    stored, _ = checkpointing.restore_params(str(reference_run.workdir), "last", _abstract_of(reference_run, mesh))
    flat_loaded, flat_fresh = (flax.traverse_util.flatten_dict(t, sep="/") for t in (loaded, fresh))
    flat_stored = flax.traverse_util.flatten_dict(stored, sep="/")
    skipped_paths = {path for path, _, _ in skipped}
    assert skipped_paths and all(not path.startswith("backbone/") for path in skipped_paths)
    for path, value in flat_loaded.items():
        expected = flat_fresh[path] if path in skipped_paths else flat_stored[path]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected), err_msg=path)

    # The command: a new workdir trains from it and says what it skipped.
    result = run_command(
        "detector.train", tmp_path / "finetune", data_dir, **WIDER, init_from=str(reference_run.workdir), total_steps=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(skipped)} parameters skipped (path or shape differs)" in result.stderr


def _abstract_of(reference_run, mesh):
    config = reference_run.config
    rules = sharding.logical_rules(config.sharding)
    with sharding.use_mesh(mesh, rules):
        abstract, _ = params_shardings(families.create_model(config, 4), tuple(config.input.image_size), mesh, rules)
    return abstract


def test_init_from_a_workdir_without_checkpoints_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config.init_from=.*nowhere.*does not exist; name a trained workdir"):
        checkpointing.load_matching_params(str(tmp_path / "nowhere"), {})

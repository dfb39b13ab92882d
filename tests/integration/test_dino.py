"""DINO end to end: train, evaluate in the loop and from the command line, export and predict in a fresh process.

Two steps of a tiny DINO (64 px, 32 queries, every training option on) on
the synthetic shapes: what is checked is that every user-facing path takes
the DINO family unchanged, not what it learns in two steps. That a run with
every DINO option on resumes exactly: tests/integration/test_mask_dino.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from detector.loop import trainer
from detector.serving import artifact
from detector.serving.predictor import load_predictor
from tests.helpers import REPO_ROOT
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import DINO_OVERRIDES, as_flags, make_dino_config
from tests.integration.test_export import assert_fresh_process_detects_what_the_predictor_does, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

STEPS = {"total_steps": 2, "checkpoint_every_steps": 2, "eval_every_steps": 2, "log_every_steps": 1}
EXPORT = {"postprocess.score_threshold": 0.0, "postprocess.max_detections": 10}


@pytest.fixture(scope="module")
def dino_run(tmp_path_factory, data_dir):
    config = make_dino_config(data_dir, **STEPS)

    def produce(workdir):
        metrics = trainer.train_and_evaluate(config, str(workdir))
        (workdir / "returned_metrics.json").write_text(json.dumps(metrics))

    workdir = once_per_run(tmp_path_factory, "dino_run", produce)
    return workdir, json.loads((workdir / "returned_metrics.json").read_text())


def test_dino_trains_and_evaluates_in_the_loop(dino_run):
    workdir, metrics = dino_run
    assert 0.0 <= metrics["AP"] <= 1.0 and 0.0 <= metrics["AR100"] <= 1.0
    logged = [json.loads(line) for line in (workdir / "train_metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in logged if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2]
    for row in train_rows:
        # The DINO objective's parts are logged; the matched box count is the batch's.
        assert np.isfinite(row["loss"]) and row["denoising_loss"] > 0 and row["encoder_loss"] > 0, row
        assert row["one_to_many_loss"] > 0, row
        assert row["num_positives"] > 0


def test_dino_artifact_in_a_fresh_process_detects_what_the_predictor_does(dino_run, data_dir, tmp_path):
    workdir, _ = dino_run
    config = make_dino_config(data_dir, **STEPS, **EXPORT)
    predictor = load_predictor(config, str(workdir), "last")
    directory = artifact.write_artifact(
        artifact.export_predictor(predictor, batch_size=2), predictor, tmp_path / "artifact"
    )
    metadata = json.loads((directory / artifact.METADATA_FILE).read_text())
    assert metadata["outputs"]["boxes"]["shape"] == [2, 10, 4]

    assert_fresh_process_detects_what_the_predictor_does(directory, predictor, tmp_path, max_detections=10)


def test_evaluate_command_takes_a_dino_workdir(dino_run, data_dir, tmp_path):
    workdir, metrics = dino_run
    output = tmp_path / "evaluation"
    flags = as_flags(data_dir, **DINO_OVERRIDES, **STEPS)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "detector.evaluate",
            "--config=configs/default.py",
            f"--workdir={workdir}",
            f"--output={output}",
            *flags,
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((output / "metrics.json").read_text())
    # The same parameters on the same images: the loop's last evaluation again.
    assert evaluated["step"] == 2 and evaluated["detections"] > 0
    assert evaluated["metrics"]["AP"] == pytest.approx(metrics["AP"], abs=1e-6)

"""Fixtures shared by the end-to-end modules: the dataset and one reference training run.

Compiling the train, predict and init programs dominates the cost here, so
the modules share one reference run (once per pytest run, across xdist
workers), and runs of an identical program load it from the suite's
compilation cache (tests/conftest.py) instead of compiling it again.
"""

from __future__ import annotations

import json
import types

import pytest

import input_pipeline
from detector.training import trainer
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import make_config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # Generates the dataset once.
    return once_per_run(tmp_path_factory, "data", lambda path: input_pipeline.get_dataset_info(make_config(path)))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
    """4 uninterrupted steps, checkpoints at 2 and 4, one evaluation at 4."""
    config = make_config(data_dir)

    def produce(workdir):
        metrics = trainer.train_and_evaluate(config, str(workdir))
        (workdir / "returned_metrics.json").write_text(json.dumps(metrics))

    workdir = once_per_run(tmp_path_factory, "reference_run", produce)
    metrics = json.loads((workdir / "returned_metrics.json").read_text())
    return types.SimpleNamespace(workdir=workdir, config=config, metrics=metrics)

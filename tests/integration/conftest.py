"""Fixtures shared by the end-to-end modules: the dataset, one reference training run, a compilation cache.

Compiling the train, predict and init programs dominates the cost here, so
the modules share one reference run (once per pytest run, across xdist
workers) and a persistent compilation cache: runs of an identical program
load it from disk instead of compiling it again. A module opts into the
cache with `pytestmark = pytest.mark.usefixtures("compilation_cache_dir")`.
"""

from __future__ import annotations

import json
import types

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

import input_pipeline
from detector.loop import trainer
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import make_config


@pytest.fixture(scope="module")
def compilation_cache_dir(tmp_path_factory):
    """A persistent compilation cache for this module only (restored afterwards)."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: getattr(jax.config, name) for name in names}
    cache_dir = once_per_run(tmp_path_factory, "compilation_cache", lambda directory: None)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # The cache is set up once per process; make it see the new dir.
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


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

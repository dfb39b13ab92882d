"""End-to-end training: files in the workdir, exact resume, and sharding that changes placement only.

Everything runs a tiny RetinaNet on 64 px synthetic images for a few steps.
Compiling the train, predict and init programs dominates the cost here, so
the module shares one reference run and a persistent compilation cache:
runs of an identical program (the resumed run, the restores) load it from
disk instead of compiling it again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf

import input_pipeline
import sharding
from detector.errors import TrainingError
from detector.loop import evaluator, trainer
from detector.models import families
from detector.models.retinanet import create_model
from detector.training import checkpointing, optim
from detector.training.train_state import describe_param_shardings, state_shardings
from tests.helpers.runs import checkpoint_steps, flat, read_jsonl
from tests.helpers.sharded_training import abstract_state_on_mesh, assert_same_training, train_on_mesh
from tests.helpers.tiny_config import make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

TRAIN_KEYS = {"step", "loss", "cls_loss", "box_loss", "learning_rate", "images_per_second"}
EVAL_KEYS = {"step", "AP", "AP50", "AP75", "APs", "APm", "APl", "AR100"}


def restore_latest(workdir, config):
    """(state as numpy, metadata, step) of the newest checkpoint in `workdir`, restored onto one device."""
    mesh = sharding.create_mesh(dict(data=1, fsdp=1, model=1), devices=jax.devices()[:1])
    abstract_state = abstract_state_on_mesh(config, mesh)
    manager = checkpointing.create_manager(str(workdir), max_to_keep=config.keep_checkpoints)
    try:
        step = manager.latest_step()
        restored = checkpointing.restore_latest(manager, abstract_state)
    finally:
        manager.close()
    assert restored is not None, f"no checkpoint in {workdir}"
    state, metadata = restored
    return jax.device_get(state), metadata, step


def test_training_writes_checkpoints_metrics_and_tensorboard(reference_run):
    workdir, config = reference_run.workdir, reference_run.config
    assert config.keep_checkpoints >= 2  # so the step-2 checkpoint must survive the step-4 save
    assert checkpoint_steps(workdir) == [2, 4]

    train_lines = read_jsonl(workdir / "train_metrics.jsonl")
    assert [line["step"] for line in train_lines] == [2, 4]  # log_every_steps=2
    for line in train_lines:
        assert TRAIN_KEYS <= set(line), line
        assert all(math.isfinite(line[k]) for k in TRAIN_KEYS), line
        assert line["images_per_second"] > 0
    assert train_lines[-1]["learning_rate"] > 0

    eval_lines = read_jsonl(workdir / "eval_metrics.jsonl")
    assert len(eval_lines) == 1
    assert set(eval_lines[0]) == EVAL_KEYS
    assert eval_lines[0]["step"] == 4
    # The returned metrics are the full pycocotools set; the file holds a summary of the same evaluation.
    returned = reference_run.metrics
    assert returned is not None
    for key in EVAL_KEYS - {"step"}:
        assert eval_lines[0][key] == pytest.approx(returned[key])
        assert -1.0 <= returned[key] <= 1.0  # pycocotools: -1 where a size range has no ground truth

    event_files = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files
    tags = {
        value.tag
        for path in event_files
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }
    assert {"train/loss", "train/learning_rate", "eval/AP", "eval/predictions_vs_ground_truth"} <= tags
    [pictures] = [
        value
        for path in event_files
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
        if value.tag == "eval/predictions_vs_ground_truth"
    ]
    panels = tf.make_ndarray(pictures.tensor)  # [width, height, *encoded images]
    assert len(panels) - 2 == config.eval_pictures
    assert {path.name for path in (workdir / "plots").iterdir()} == {"loss.png", "map.png"}

    saved_config = json.loads((workdir / "config.json").read_text())
    assert saved_config["global_batch_size"] == 8
    assert saved_config["total_steps"] == 4

    # The best evaluation's parameters (the only one here: step 4) and the final export, parameters only.
    final, _, _ = restore_latest(workdir, config)
    best_step, best_params = checkpointing.restore_best(str(workdir))
    assert best_step == 4
    exported = ocp.StandardCheckpointer().restore(checkpointing.export_dir(str(workdir)) / "params")
    for params in (best_params, exported):
        restored, expected = flat(params), flat(final.params)
        assert restored.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(restored[name], expected[name], err_msg=name)


class WrappedTrainIterator:
    """The trainer's real iterator (its position and counts intact) with `on_batch(batch, step)` applied to each batch.

    `step` is the 1-based training step the batch is for; `on_batch` may raise to stand in for a crash.
    """

    def __init__(self, batches, global_batch_size, on_batch):
        self.batches, self.global_batch_size, self.on_batch = batches, global_batch_size, on_batch

    position = property(lambda self: self.batches.position)
    input_counts = property(lambda self: self.batches.input_counts)

    def __next__(self):
        step = self.batches.position // self.global_batch_size + 1
        return self.on_batch(next(self.batches), step)


class Preempted(Exception):
    """Stands in for a crash or preemption in the middle of a run."""


def _held_scoring(monkeypatch, hold):
    """Runs `hold(fetched)` inside the first evaluation's real scoring job, before it scores.

    `fetched` is a list that grows by one each time the train loop takes a
    batch, so `hold` can wait for training to go on (or signal the process).
    Returns `fetched`.
    """
    fetched = []
    real_create_train_iterator = input_pipeline.create_train_iterator
    real_score = evaluator.score_predictions

    def create_train_iterator(config, *, start_position=0, first_row=None):
        batches = real_create_train_iterator(config, start_position=start_position, first_row=first_row)
        return WrappedTrainIterator(batches, config.global_batch_size, lambda b, step: fetched.append(step) or b)

    def score(ground_truth, local, key):
        if key.endswith("/1"):  # this run's first evaluation
            hold(fetched)
        return real_score(ground_truth, local, key)

    monkeypatch.setattr(input_pipeline, "create_train_iterator", create_train_iterator)
    monkeypatch.setattr(evaluator, "score_predictions", score)
    return fetched


def _wait_until(condition, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition(), "timed out"


def test_background_scores_land_with_their_step_while_training_goes_on(reference_run, tmp_path, monkeypatch):
    config = reference_run.config.copy_and_resolve_references()
    config.update_from_flattened_dict({"eval_every_steps": 2, "log_every_steps": 1})
    fetched_when_scored = []

    def hold(fetched):
        # The loop trains steps 3 and 4 while step 2 is being scored (4 steps in all).
        _wait_until(lambda: len(fetched) >= 4)
        fetched_when_scored.append(len(fetched))

    _held_scoring(monkeypatch, hold)
    returned = trainer.train_and_evaluate(config, str(tmp_path))
    assert fetched_when_scored and fetched_when_scored[0] >= 4
    eval_lines = read_jsonl(tmp_path / "eval_metrics.jsonl")
    assert [line["step"] for line in eval_lines] == [2, 4]  # each once, in order, with its own step
    assert returned["AP"] == pytest.approx(eval_lines[-1]["AP"])  # the final evaluation was waited for
    best_step, _ = checkpointing.restore_best(str(tmp_path))
    assert eval_lines[[line["step"] for line in eval_lines].index(best_step)]["AP"] == max(
        line["AP"] for line in eval_lines
    )


def counting(monkeypatch, module, name: str) -> list[int]:
    """Replaces `module.name` by a wrapper that appends 1 to the returned list on every call."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_scoring_in_place_holds_the_loop_until_it_is_recorded(reference_run, tmp_path, monkeypatch):
    config = reference_run.config.copy_and_resolve_references()
    config.update_from_flattened_dict({"eval_every_steps": 2, "log_every_steps": 1, "background_scoring": False})
    fetched_when_scored = []
    _held_scoring(monkeypatch, lambda fetched: fetched_when_scored.append(len(fetched)))
    # What the run derives from its config is built once (`training.run.Run`), whatever trains, predicts or logs.
    built = {
        name: counting(monkeypatch, module, name)
        for module, name in ((optim, "trainable_parameters"), (families, "objective"))
    }
    trainer.train_and_evaluate(config, str(tmp_path))
    assert fetched_when_scored == [2]  # the first evaluation's; no batch of step 3 was taken meanwhile
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")] == [2, 4]
    assert {name: len(calls) for name, calls in built.items()} == {"trainable_parameters": 1, "objective": 1}


def test_sigterm_during_a_background_scoring_records_it_once(reference_run, tmp_path, monkeypatch):
    config = reference_run.config.copy_and_resolve_references()
    config.update_from_flattened_dict({"eval_every_steps": 2, "log_every_steps": 1})

    def hold(fetched):
        os.kill(os.getpid(), signal.SIGTERM)  # a real preemption signal while step 2 is being scored
        _wait_until(lambda: len(fetched) >= 3)

    _held_scoring(monkeypatch, hold)
    assert trainer.train_and_evaluate(config, str(tmp_path)) is None  # stopped early
    assert checkpoint_steps(tmp_path)[-1] == 3  # the stop step's checkpoint, written before the wait
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")] == [2]
    assert checkpointing.restore_best(str(tmp_path))[0] == 2

    monkeypatch.undo()
    trainer.train_and_evaluate(config, str(tmp_path))  # resumes from step 3
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")] == [2, 4]


def test_interrupted_run_resumes_exactly(reference_run, tmp_path, monkeypatch):
    """Stopping after step 2 and running the same command again gives the uninterrupted run's state.

    The same config both times: the learning-rate schedule is a function of
    total_steps, so only an unchanged total_steps continues the same schedule.
    """
    config = reference_run.config
    real_create_train_iterator = input_pipeline.create_train_iterator
    start_positions = []

    def dies_at_step_3(batch, step):
        if step == 3:
            raise Preempted  # while fetching the batch of step 3, after step 2's checkpoint started
        return batch

    def create_train_iterator(config, *, start_position=0, first_row=None):
        start_positions.append(start_position)
        batches = real_create_train_iterator(config, start_position=start_position, first_row=first_row)
        return (
            batches
            if len(start_positions) > 1
            else WrappedTrainIterator(batches, config.global_batch_size, dies_at_step_3)
        )

    monkeypatch.setattr(input_pipeline, "create_train_iterator", create_train_iterator)
    with pytest.raises(Preempted):
        trainer.train_and_evaluate(config, str(tmp_path))
    assert checkpoint_steps(tmp_path) == [2]  # the in-flight async save completed on the way out
    assert [line["step"] for line in read_jsonl(tmp_path / "train_metrics.jsonl")] == [2]
    assert not (tmp_path / "eval_metrics.jsonl").exists()

    metrics = trainer.train_and_evaluate(config, str(tmp_path))
    # The second run asked the input pipeline for the stream after the 2 x 8 consumed examples.
    assert start_positions == [0, 2 * config.global_batch_size]
    assert checkpoint_steps(tmp_path) == [2, 4]
    train_lines = read_jsonl(tmp_path / "train_metrics.jsonl")
    assert [line["step"] for line in train_lines] == [2, 4]  # continues, no step trained twice
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")] == [4]

    # Same batches, same learning rates, same losses as the uninterrupted run.
    reference_lines = read_jsonl(reference_run.workdir / "train_metrics.jsonl")
    for key in ("loss", "cls_loss", "box_loss", "grad_norm", "learning_rate"):
        np.testing.assert_allclose(
            [line[key] for line in train_lines], [line[key] for line in reference_lines], rtol=1e-5, err_msg=key
        )
    assert metrics == pytest.approx(reference_run.metrics)

    resumed, resumed_metadata, resumed_step = restore_latest(tmp_path, config)
    reference, _, _ = restore_latest(reference_run.workdir, config)
    assert resumed_step == 4
    assert int(resumed.step) == 4
    assert resumed_metadata == {"step": 4, "input_position": 4 * config.global_batch_size}
    # optax's own step counters (Adam's bias correction, the schedule) continued too.
    counters = [x for x in jax.tree.leaves(resumed.opt_state) if np.ndim(x) == 0 and np.issubdtype(x.dtype, np.integer)]
    assert counters and all(int(c) == 4 for c in counters)
    reference_params, resumed_params = flat(reference.params), flat(resumed.params)
    assert reference_params.keys() == resumed_params.keys()
    for name in reference_params:
        np.testing.assert_allclose(resumed_params[name], reference_params[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for expected, actual in zip(jax.tree.leaves(reference.opt_state), jax.tree.leaves(resumed.opt_state)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


# An image id no dataset has: marks the batches whose loss the wrapped objective makes NaN.
_POISONED_IMAGE_ID = -12345


def _poison_steps(monkeypatch, bad_steps):
    """Makes the loss of the training batches of `bad_steps` (1-based) NaN, as an overflow would.

    The batch itself cannot carry a NaN any more (its images are uint8), so
    the fault is injected in the loss: the family's objective is wrapped to
    return NaN for batches whose image ids carry a marker.
    """
    real_create_train_iterator = input_pipeline.create_train_iterator
    real_objective = families.objective

    def poison(batch, step):
        return dict(batch, image_id=np.full_like(batch["image_id"], _POISONED_IMAGE_ID)) if step in bad_steps else batch

    def objective(config, model, num_classes, **options):
        real = real_objective(config, model, num_classes, **options)

        def loss(params, batch, rng=None, normalizer=None):
            value, terms = real.loss(params, batch, rng, normalizer)
            poisoned = jnp.any(batch["image_id"] == _POISONED_IMAGE_ID)
            return jnp.where(poisoned, jnp.nan, value), terms

        return dataclasses.replace(real, loss=loss)

    monkeypatch.setattr(families, "objective", objective)
    monkeypatch.setattr(
        input_pipeline,
        "create_train_iterator",
        lambda config, **kwargs: WrappedTrainIterator(
            real_create_train_iterator(config, **kwargs), config.global_batch_size, poison
        ),
    )


def _optimizer_counters(state):
    return [int(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) == 0 and np.issubdtype(x.dtype, np.integer)]


def test_a_nonfinite_step_is_skipped_and_training_continues(reference_run, tmp_path, monkeypatch):
    config = reference_run.config
    _poison_steps(monkeypatch, {3})
    metrics = trainer.train_and_evaluate(config, str(tmp_path))
    lines = read_jsonl(tmp_path / "train_metrics.jsonl")
    assert [line["skipped_steps"] for line in lines] == [0, 1]
    assert all(math.isfinite(line["loss"]) for line in lines)  # averaged over the steps that updated
    state, _, step = restore_latest(tmp_path, config)
    assert step == 4 and int(state.step) == 4  # the batch was consumed, the step counted
    assert set(_optimizer_counters(state)) == {3}  # exactly one update skipped; steps 1, 2 and 4 applied
    assert all(np.isfinite(v).all() for v in flat(state.params).values())
    assert metrics is not None and all(math.isfinite(v) for v in metrics.values())


def test_repeated_nonfinite_steps_stop_and_keep_the_last_good_checkpoint(reference_run, tmp_path, monkeypatch):
    config = make_config(reference_run.config.dataset.data_dir, max_consecutive_nonfinite=2)
    _poison_steps(monkeypatch, {3, 4})
    with pytest.raises(TrainingError, match=r"2 consecutive steps \(3-4\) had a non-finite loss"):
        trainer.train_and_evaluate(config, str(tmp_path))
    assert checkpoint_steps(tmp_path) == [2]  # nothing saved after the bad steps
    state, _, _ = restore_latest(tmp_path, config)
    reference, _, _ = restore_latest(reference_run.workdir, config)
    assert set(_optimizer_counters(state)) == {2}
    assert all(np.isfinite(v).all() for v in flat(state.params).values())
    assert flat(state.params).keys() == flat(reference.params).keys()


@pytest.fixture(scope="module")
def sharding_comparison(reference_run, data_dir):
    """Trains the same 3 batches from the same state on any mesh; the 1-device run is the reference.

    Plain SGD here: Adam's first updates are +-lr whatever the gradient's size,
    which turns rounding-level differences in near-zero gradients into
    lr-sized parameter differences; SGD keeps them at rounding level, so a
    tight tolerance can tell a wrong gradient from reordered float sums.
    """
    config = make_config(data_dir, **{"optimizer.name": "sgd", "optimizer.learning_rate": 0.05, "total_steps": 3})
    reference_state, _, _ = restore_latest(reference_run.workdir, reference_run.config)
    initial_params = reference_state.params  # trained params: a realistic starting point, no init to compile
    batches_iter = input_pipeline.create_train_iterator(config)
    batches = [next(batches_iter) for _ in range(3)]
    num_classes = input_pipeline.get_dataset_info(config).num_classes

    def run(mesh_shape):
        return train_on_mesh(config, mesh_shape, initial_params, batches, num_classes)

    return types.SimpleNamespace(run=run, reference=run((1, 1, 1)), initial=flat(initial_params))


def _kernel_specs(param_specs):
    return [spec for name, spec in param_specs.items() if name.endswith("kernel")]


def test_parameters_are_partitioned_on_a_2x2x2_mesh(data_dir):
    config = make_config(data_dir)
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    rules = sharding.logical_rules(config.sharding)
    model = create_model(
        config.model, input_pipeline.get_dataset_info(config).num_classes, families.num_anchors_per_location(config)
    )
    tx, _ = optim.create_optimizer(config.optimizer, config.total_steps)
    with sharding.use_mesh(mesh, rules):
        abstract_state, _ = state_shardings(model, tx, tuple(config.input.image_size), mesh, rules)
    specs = describe_param_shardings(abstract_state.params)
    kernels = _kernel_specs(specs)
    assert any("'model'" in spec for spec in kernels), specs
    assert any("'fsdp'" in spec for spec in kernels), specs


# (2, 2, 2): every axis splits. Other meshes and detectors: tests/integration/test_sharded_equivalence.py.
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)], ids=lambda shape: "x".join(map(str, shape)))
def test_sharding_changes_placement_not_results(sharding_comparison, mesh_shape):
    sharded = sharding_comparison.run(mesh_shape)
    reference, initial = sharding_comparison.reference, sharding_comparison.initial

    kernels = _kernel_specs(sharded.param_specs)
    for axis, size in zip(("fsdp", "model"), mesh_shape[1:]):
        if size > 1:  # the parameters really are partitioned over this axis
            assert any(f"'{axis}'" in spec for spec in kernels), sharded.param_specs

    assert_same_training(reference, sharded, initial)

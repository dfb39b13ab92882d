"""Real processes, real signals: kill -9 at any moment, SIGTERM, two processes, other topologies.

Every run here is `python -m detector.train` (or tests/checkpoint_worker.py)
in subprocesses on fake CPU devices, the way a cluster would start it; the
module's reference is one uninterrupted 8-step run on 8 devices. All runs
share a persistent compilation cache, so a restart loads the compiled
programs instead of compiling them again, as restarts on a cluster do.
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import shutil
import signal
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from detector.training import checkpointing
from tests.helpers.processes import start_processes
from tests.helpers.runs import checkpoint_steps, flat, once_per_run, read_jsonl
from tests.helpers.tiny_config import as_flags, make_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = "tests.helpers.checkpoint_worker"
TOTAL_STEPS = 8
# SGD with momentum: optimizer state to save and reshard, and updates that
# follow the gradient's size. Adam's normalised updates turn a near-zero
# gradient's rounding into a learning-rate-sized step, which would make the
# multi-process run (another summation order) differ by more than rounding.
# An EMA of the parameters: state beside the optimizer's that a restart must
# restore exactly. (Gradient accumulation runs within one step: it holds no
# state across a restart; tests/integration/test_recipe_parts.py tests it.)
RUN = {
    "total_steps": TOTAL_STEPS,
    "checkpoint_every_steps": 2,
    "log_every_steps": 1,
    "eval_every_steps": TOTAL_STEPS,
    "optimizer.name": "sgd",
    "optimizer.ema_decay": 0.9,
}
LOSS_KEYS = ("loss", "cls_loss", "box_loss", "grad_norm", "learning_rate")


def train_command(data_dir, workdir, **overrides) -> list[str]:
    return [
        sys.executable,
        "-m",
        "detector.train",
        "--config=configs/default.py",
        f"--workdir={workdir}",
        *as_flags(data_dir, **{**RUN, **overrides}),
    ]


def saved_state(workdir, step):
    """The train state of checkpoint `step` as written, as numpy arrays, whatever devices wrote it."""
    path = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=one_device),
        checkpointer.metadata(path).item_metadata.tree,
    )
    return jax.device_get(checkpointer.restore(path, target))


def _dataset_generator(**overrides):
    """Writes the tiny config's synthetic dataset (with `overrides`) into the directory it is given."""

    def generate(path):
        import input_pipeline

        input_pipeline.get_dataset_info(make_config(path, **overrides))

    return generate


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return once_per_run(tmp_path_factory, "data", _dataset_generator())


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return once_per_run(tmp_path_factory, "cli_compilation_cache", lambda directory: None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir, cache_dir):
    """One uninterrupted run: one process, 8 devices, data=8, checkpoints every 2 steps."""
    workdir = tmp_path_factory.mktemp("reference")
    [run] = start_processes(train_command(data_dir, workdir), 1, 8, cache_dir)
    assert run.finish() == 0, run.output[-4000:]
    assert checkpoint_steps(workdir) == [2, 4, 6, 8][-make_config(data_dir).keep_checkpoints :]
    return workdir


def assert_same_metrics(workdir, reference_workdir, **tolerance):
    lines, expected = read_jsonl(workdir / "train_metrics.jsonl"), read_jsonl(reference_workdir / "train_metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, TOTAL_STEPS + 1))  # each step once, in order
    for key in LOSS_KEYS:
        actual, wanted = [line[key] for line in lines], [line[key] for line in expected]
        if tolerance:
            np.testing.assert_allclose(actual, wanted, err_msg=key, **tolerance)
        else:
            np.testing.assert_array_equal(actual, wanted, err_msg=key)


# ----------------------------------------------------------------------------
# One process: kill -9 anywhere, SIGTERM, restart; the end is bit-identical.
# ----------------------------------------------------------------------------


def test_killed_and_preempted_runs_end_with_the_uninterrupted_parameters(reference, data_dir, cache_dir, tmp_path):
    def start():
        [run] = start_processes(train_command(data_dir, tmp_path), 1, 8, cache_dir)
        return run

    resumed_from, newest_complete = [], []

    def started(run):
        """Notes which checkpoint the restart loaded, and which was the newest complete one on disk."""
        newest_complete.append(max(checkpoint_steps(tmp_path), default=0))
        match = run.wait_for(r"resuming from step (\d+)|step 1/8")
        resumed_from.append(int(match.group(1) or 0))
        return run

    # 1. Killed while starting, before any checkpoint exists.
    run = start()
    run.wait_for(r"compiled train and predict steps")
    run.kill(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    assert checkpoint_steps(tmp_path) == []

    # 2. Killed right after the asynchronous save of step 2 started, most likely mid-write.
    run = started(start())
    run.wait_for(r"checkpoint: saving step 2\b")
    run.kill(signal.SIGKILL)
    run.finish()

    # 3. Killed between checkpoints: step 5 was trained and logged, then lost.
    run = started(start())
    run.wait_for(r"step 5/8")
    run.kill(signal.SIGKILL)
    run.finish()

    # A half-written checkpoint, as a kill during a save leaves it: ignored on restart.
    partial = tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text('{"tree_metadata": {')

    # 4. SIGTERM mid-run: stops at the next step with a checkpoint there, exit code 0.
    run = started(start())
    run.wait_for(r"step 5/8")
    run.kill(signal.SIGTERM)
    stop_step = int(run.wait_for(r"stopping at step (\d+) of 8 on a preemption signal").group(1))
    assert run.finish() == 0, run.output[-3000:]
    assert 5 <= stop_step < TOTAL_STEPS
    assert stop_step in checkpoint_steps(tmp_path)
    assert "export" not in os.listdir(tmp_path)  # unfinished: no final export yet

    # 5. The last restart runs to the end.
    run = started(start())
    assert run.finish() == 0, run.output[-3000:]
    assert checkpoint_steps(tmp_path)[-1] == TOTAL_STEPS

    # Every restart loaded the newest complete checkpoint on disk (complete ones have plain step names).
    assert resumed_from == newest_complete
    assert resumed_from[-1] == stop_step

    # Bit-identical to the uninterrupted run: parameters, optimizer state, the EMA, every logged loss.
    final, expected = saved_state(tmp_path, TOTAL_STEPS), saved_state(reference, TOTAL_STEPS)
    assert set(final) == set(expected) == {"step", "params", "opt_state", "ema_params"}
    assert flat(final["params"]).keys() == flat(expected["params"]).keys()
    for name, value in flat(expected["params"]).items():
        np.testing.assert_array_equal(flat(final["params"])[name], value, err_msg=name)
    for actual, wanted in zip(jax.tree.leaves(final), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(actual, wanted)
    ema, params = flat(final["ema_params"]), flat(final["params"])
    assert any(not np.array_equal(ema[name], params[name]) for name in params)  # a real average, not a copy
    assert_same_metrics(tmp_path, reference)
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")] == [TOTAL_STEPS]


def test_a_run_killed_while_scoring_in_the_background_scores_that_step_when_resumed(data_dir, cache_dir, tmp_path):
    """SIGKILL while step 4's evaluation is scored in the background (checkpoint 4 written, its score not): the
    same command again evaluates step 4 before training on, so every due evaluation is recorded once and the
    best checkpoint is chosen from all of them."""
    # Scores land only when they must (before the next evaluation or checkpoint, at the end): the kill
    # right after prediction lands while step 4's score is pending.
    command = train_command(data_dir, tmp_path, eval_every_steps=4, checkpoint_every_steps=4, log_every_steps=100)
    [run] = start_processes(command, 1, 8, cache_dir)
    run.wait_for(r"eval step 4: predicted in .* scoring in the background")
    run.kill(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    assert checkpoint_steps(tmp_path) == [4]
    assert not (tmp_path / "eval_metrics.jsonl").exists(), "step 4's score landed before the kill"

    [run] = start_processes(command, 1, 8, cache_dir)
    assert run.finish() == 0, run.output[-3000:]
    assert "evaluating step 4, the checkpoint this run starts from" in run.output
    evaluations = read_jsonl(tmp_path / "eval_metrics.jsonl")
    assert [line["step"] for line in evaluations] == [4, 8]
    best_step, _ = checkpointing.restore_best(str(tmp_path))
    assert [line["AP"] for line in evaluations if line["step"] == best_step] == [max(e["AP"] for e in evaluations)]


# ----------------------------------------------------------------------------
# Two processes x 4 devices: the one-process result; SIGTERM to one stops both,
# in training and in an evaluation.
# ----------------------------------------------------------------------------


def test_two_processes_train_like_one_and_stop_together_on_sigterm(reference, cache_dir, tmp_path_factory, tmp_path):
    # 512 validation images in 64 batches: an evaluation that outlasts the signal's delivery.
    # The training split is the reference's (examples are generated by split and index).
    long_eval = {"dataset.num_eval_examples": 512}
    data = once_per_run(tmp_path_factory, "data_long_eval", _dataset_generator(**long_eval))
    # Only the preemption checkpoints and the last one: a checkpoint at a stop step is the preemption's.
    # Split data=2 fsdp=2 model=2 over the processes' 8 devices, so every restart loads the programs the
    # first run compiled (resharding a checkpoint onto another split: the topologies test below).
    command = train_command(data, tmp_path, checkpoint_every_steps=100, **long_eval)
    command += ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.model=2"]

    # 1. SIGTERM to one process mid-training: both stop after the same step.
    runs = start_processes(command, 2, 4, cache_dir)
    runs[0].wait_for(r"step 3/8")
    runs[1].kill(signal.SIGTERM)
    stop_steps = [int(run.wait_for(r"stopping at step (\d+) of 8 on a preemption signal").group(1)) for run in runs]
    assert [run.finish() for run in runs] == [0, 0], runs[0].output[-3000:] + runs[1].output[-3000:]
    stop = stop_steps[0]
    assert stop_steps[1] == stop and 3 <= stop < TOTAL_STEPS
    assert checkpoint_steps(tmp_path) == [stop]

    # 2. Restarted with an evaluation at the next step; SIGTERM to one process mid-evaluation:
    # both abandon it at the same batch and save that step, though no checkpoint was due there.
    runs = start_processes(command + [f"--config.eval_every_steps={stop + 1}"], 2, 4, cache_dir)
    runs[0].wait_for(rf"resuming from step {stop}\b")
    num_batches = int(runs[0].wait_for(rf"evaluating step {stop + 1}: (\d+) batches").group(1))
    runs[1].kill(signal.SIGTERM)
    pattern = rf"evaluation of step {stop + 1} abandoned after (\d+) of (\d+) batches"
    abandoned = [run.wait_for(pattern).groups() for run in runs]
    assert [run.finish(timeout=60) for run in runs] == [0, 0], runs[0].output[-3000:] + runs[1].output[-3000:]
    assert abandoned[0] == abandoned[1], abandoned
    # Promptly: before the evaluation's end (a count of batches, not seconds, which a busy machine stretches).
    assert int(abandoned[0][0]) < num_batches == int(abandoned[0][1])
    assert checkpoint_steps(tmp_path) == [stop, stop + 1]
    assert not (tmp_path / "eval_metrics.jsonl").exists()  # nothing half-evaluated was recorded

    # 3. The last restart runs to the end; its final evaluation reads the first 16 validation images
    # (what is evaluated is no part of the training's state).
    runs = start_processes(command + ["--config.dataset.eval_split=validation[:16]"], 2, 4, cache_dir)
    runs[0].wait_for(rf"resuming from step {stop + 1}\b")
    assert [run.finish() for run in runs] == [0, 0], runs[0].output[-3000:] + runs[1].output[-3000:]
    assert checkpoint_steps(tmp_path)[-1] == TOTAL_STEPS
    assert [line["step"] for line in read_jsonl(tmp_path / "eval_metrics.jsonl")][-1] == TOTAL_STEPS
    # Process 0 tells the story; process 1 logs warnings only.
    assert any(re.match(r"I\d{4} .*\[process 0/2\] step 8/8", line) for line in runs[0].lines)
    assert not any(re.match(r"I\d{4} .*\[process 1/2\]", line) for line in runs[1].lines)

    # The same losses as one process on 8 devices, to float tolerance (gloo sums in another order).
    assert_same_metrics(tmp_path, reference, rtol=1e-5, atol=1e-7)
    final, expected = saved_state(tmp_path, TOTAL_STEPS), saved_state(reference, TOTAL_STEPS)
    for name, value in flat(expected["params"]).items():
        np.testing.assert_allclose(flat(final["params"])[name], value, rtol=1e-4, atol=2e-6, err_msg=name)


# ----------------------------------------------------------------------------
# One checkpoint, three topologies: 8 devices -> 1 device -> 2 processes x 4.
# ----------------------------------------------------------------------------


def run_worker(config_json, source, mesh_shape, out, cache_dir, *, destination=None, num_processes=1, devices=1):
    command = [sys.executable, "-m", WORKER, str(config_json), str(source), mesh_shape, str(out)]
    runs = start_processes(command + ([str(destination)] if destination else []), num_processes, devices, cache_dir)
    for run in runs:
        assert run.finish() == 0, run.output[-3000:]
    return dict(np.load(out))


def test_a_checkpoint_restores_identically_across_topologies(reference, cache_dir, tmp_path):
    config_json = reference / "config.json"
    source, one_device_workdir = tmp_path / "written_on_8_devices", tmp_path / "written_on_1_device"
    shutil.copytree(reference / "checkpoints" / str(TOTAL_STEPS), source / "checkpoints" / str(TOTAL_STEPS))

    # Written on data=8; restored onto one device and saved again from there.
    on_one = run_worker(config_json, source, "1,1,1", tmp_path / "one.npz", cache_dir, destination=one_device_workdir)
    # That checkpoint restored onto two processes x 4 devices, split data=2 fsdp=2 model=2.
    on_two = run_worker(
        config_json, one_device_workdir, "2,2,2", tmp_path / "two.npz", cache_dir, num_processes=2, devices=4
    )

    assert on_one["partitioned"] == 0 and on_two["partitioned"] > 0  # really split over fsdp and model
    saved = saved_state(reference, TOTAL_STEPS)
    expected = {f"{kind}/{k}": v for kind in ("params", "ema_params") for k, v in flat(saved[kind]).items()}
    kinds = collections.Counter(name.split("/")[0] for name in on_one)
    assert kinds["params"] == kinds["ema_params"] == len(expected) // 2 and kinds["opt_state"] > 0
    assert on_one.keys() == on_two.keys()
    for restored in (on_one, on_two):
        assert int(restored["step"]) == TOTAL_STEPS
        for name, value in expected.items():
            np.testing.assert_array_equal(restored[name], value, err_msg=name)
    for name in on_one:
        if name.startswith("opt_state/"):
            np.testing.assert_array_equal(on_two[name], on_one[name], err_msg=name)

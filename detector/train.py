"""Trains and evaluates the detector on a device mesh.

  python -m detector.train --config=configs/default.py --workdir=runs/default
  python -m detector.train --config=configs/default.py --workdir=DIR \
      --config.mesh.data=4 --config.mesh.model=2 --config.global_batch_size=32

The same code runs on one CPU, one GPU, or many hosts: the config's mesh and
batch size decide how the work is split. Running the same command again in a
workdir that holds a checkpoint resumes from it.
"""

from __future__ import annotations

import json
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import flags, logging
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import config_flags

import input_pipeline
from input_pipeline import transforms
import sharding
from detector import checkpointing, cli, evaluation, optim, plots, steps, visualize
from detector import preemption as preemption_lib
from detector.errors import TrainingError
from detector.metric_writers import MetricWriter
from detector.pretrained import load_backbone_params
from detector.retinanet import create_model
from detector.train_state import count_params, init_train_state
from input_pipeline.progress import Progress, format_duration, track
from sharding import distributed, memory, plan

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (get_config()).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])
distributed.define_flags()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    """Trains to `config.total_steps` (resuming from `workdir` if possible) and evaluates.

    Returns the last evaluation's COCO metrics on process 0 (None elsewhere).
    """
    is_primary = jax.process_index() == 0
    workdir_path = epath.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    if is_primary:
        (workdir_path / "config.json").write_text(config.to_json_best_effort(indent=2))

    # ------------------------------------------------------------------------
    # Mesh and sharding rules.
    # ------------------------------------------------------------------------
    mesh = sharding.create_mesh(config.mesh)
    rules = sharding.logical_rules(config.sharding)
    batch_axes = sharding.batch_axes(mesh)
    per_device_batch = sharding.check_global_batch(config.global_batch_size, mesh)
    sharding.check_global_batch(config.eval_batch_size, mesh)
    batch_sharding = sharding.batch_sharding(mesh, batch_axes)
    logging.info("mesh %s over %d devices (%d processes); per-device batch %d",
                 dict(mesh.shape), mesh.size, jax.process_count(), per_device_batch)

    # ------------------------------------------------------------------------
    # Data description, model, optimizer.
    # ------------------------------------------------------------------------
    dataset_info = input_pipeline.get_dataset_info(config)
    data_report = _DataReport(config, workdir_path, enabled=is_primary)
    num_anchors = steps.num_anchors_per_location(config)
    model = create_model(config.model, dataset_info.num_classes, num_anchors)
    tx, schedule = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
    anchors = steps.anchors_for_config(config)
    image_size = tuple(config.input.image_size)

    # ------------------------------------------------------------------------
    # Ahead-of-time compilation with explicit shardings; memory report.
    # ------------------------------------------------------------------------
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compile_start = time.perf_counter()
        compiled_train, abstract_state, state_shardings_tree = steps.compile_train_step(
            config, model, tx, schedule, num_classes=dataset_info.num_classes, mesh=mesh, rules=rules)
        compiled_predict = steps.compile_predict_step(
            config, model, abstract_params=abstract_state.params, param_shardings=state_shardings_tree.params,
            mesh=mesh, batch_size=config.eval_batch_size)
        logging.info("compiled train and predict steps in %.1fs", time.perf_counter() - compile_start)

    num_params = count_params(abstract_state.params)
    logging.info("model: %.2fM parameters, %d anchors per image", num_params / 1e6, anchors.shape[0])
    report = memory.memory_report(compiled_train)
    if report is not None:
        # The same accounting as `python -m sharding.plan`, on the real devices.
        step_plan = plan.plan_from_compiled(
            compiled_train, abstract_state, steps.abstract_batch(config, config.global_batch_size, batch_sharding),
            dict(mesh.shape), config.global_batch_size)
        logging.info("train step %s; per device:\n%s", report.describe(), plan.format_table([step_plan]))
    memory.check_fits(report, memory.device_memory_limit_bytes())

    # ------------------------------------------------------------------------
    # State: resume from the newest checkpoint, or initialise sharded.
    # ------------------------------------------------------------------------
    manager = checkpointing.create_manager(workdir, max_to_keep=config.keep_checkpoints)
    best_manager = checkpointing.create_best_manager(workdir)
    restored = checkpointing.restore_latest(manager, abstract_state)
    if restored is None:
        state = init_train_state(model, tx, image_size, state_shardings_tree, jax.random.key(config.seed))
        pretrained = config.model.backbone.get("pretrained", "")
        if pretrained:
            # Only on a fresh start: a resumed run continues from its own checkpoint.
            state = state.replace(params=load_backbone_params(state.params, pretrained))
            logging.info("backbone initialised from %s", pretrained)
        start_step, start_position = 0, 0
    else:
        state, metadata = restored
        start_step = int(jax.device_get(state.step))
        start_position = checkpointing.input_position(metadata, start_step, config.global_batch_size)
        logging.info("resuming from step %d at input position %d", start_step, start_position)

    # ------------------------------------------------------------------------
    # Input pipelines.
    # ------------------------------------------------------------------------
    # The stream is a function of (seed, position): a resumed run starts at the
    # checkpoint's position and sees exactly what an uninterrupted run would.
    # Each process reads only the rows of every global batch its devices hold.
    first_row = input_pipeline.process_rows(batch_sharding, config.global_batch_size)
    train_iter = input_pipeline.create_train_iterator(config, start_position=start_position, first_row=first_row)
    eval_config = input_pipeline.with_batch_size(config, config.eval_batch_size)
    ground_truth = input_pipeline.coco_ground_truth(config) if is_primary else None
    writer = MetricWriter(workdir, enabled=is_primary)
    writer.discard_after(start_step)
    pictures = _EvalPictures(config, eval_config, mesh, batch_axes, batch_sharding, dataset_info.class_names,
                             enabled=is_primary)

    def run_eval(step: int) -> dict[str, float] | None:
        eval_iter = input_pipeline.create_eval_iterator(
            eval_config, first_row=input_pipeline.process_rows(batch_sharding, config.eval_batch_size))
        batches = track(eval_iter.batches, f"eval at step {step}", eval_iter.num_batches, unit="batches",
                        log_every_s=60.0, enabled=is_primary)
        global_batches = (input_pipeline.to_global_batch(b, mesh, batch_axes) for b in batches)
        metrics = evaluation.evaluate(compiled_predict, state.params, global_batches,
                                      ground_truth=ground_truth,
                                      label_to_category_id=dataset_info.label_to_category_id)
        data_report.update("eval", eval_iter.input_counts)
        # Only process 0 scores; every process takes part in saving the best parameters.
        ap = float(multihost_utils.broadcast_one_to_all(np.float32(metrics["AP"] if metrics else 0.0)))
        checkpointing.save_if_best(best_manager, step, state.params, ap)
        if metrics is not None:
            summary = {k: metrics[k] for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100")}
            logging.info("eval step %d: %s", step, " ".join(f"{k} {v:.3f}" for k, v in summary.items()))
            writer.write_eval(step, summary)
        pictures.write(step, compiled_predict, state.params, writer)
        if is_primary:
            plots.write_training_plots(workdir)
        return metrics

    try:
        # --------------------------------------------------------------------
        # Training loop.
        # --------------------------------------------------------------------
        total_steps = config.total_steps
        # A live line on terminals; the periodic log lines below are the record everywhere.
        with preemption_lib.PreemptionWatch() as preemption, Progress(
                "step", total_steps, unit="steps", log_every_s=None, enabled=is_primary,
                initial=start_step) as progress:
            stopped_early = False
            nonfinite = _NonFiniteSteps(int(config.max_consecutive_nonfinite))
            last_metrics, last_logged = None, {}
            pending: list[dict[str, jax.Array]] = []
            window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0
            for step in range(start_step + 1, total_steps + 1):
                wait_start = time.perf_counter()
                batch = input_pipeline.to_global_batch(next(train_iter), mesh, batch_axes)
                window_wait += time.perf_counter() - wait_start
                state, metrics = compiled_train(state, batch)
                pending.append(metrics)
                window_steps += 1
                progress.update(step, **last_logged)
                # Every process asks after every step; all get the same answer.
                stopped_early = preemption.reached_stop_step(step) and step < total_steps

                if step % config.log_every_steps == 0 or step == total_steps or stopped_early:
                    # The only host sync of the loop: fetch the window's metrics at once.
                    fetched = jax.device_get(pending)
                    elapsed = time.perf_counter() - window_start
                    nonfinite.observe(step - len(fetched) + 1, [bool(m["nonfinite"]) for m in fetched])
                    # Loss terms of the steps that updated the model; skipped steps are counted instead.
                    good = [m for m in fetched if not m["nonfinite"]] or fetched
                    summary = {k: float(np.mean([m[k] for m in good])) for k in fetched[0] if k != "nonfinite"}
                    summary["skipped_steps"] = float(sum(m["nonfinite"] for m in fetched))
                    summary["learning_rate"] = float(fetched[-1]["learning_rate"])
                    summary["images_per_second"] = window_steps * config.global_batch_size / elapsed
                    summary["step_time_s"] = elapsed / window_steps
                    summary["input_wait_fraction"] = window_wait / elapsed
                    eta = (total_steps - step) * summary["step_time_s"]
                    logging.info(
                        "step %d/%d | loss %.4f (cls %.4f box %.4f) | lr %.2e | grad norm %.3f | %.1f img/s | "
                        "input wait %.0f%% | ETA %s", step, total_steps, summary["loss"], summary["cls_loss"],
                        summary["box_loss"], summary["learning_rate"], summary["grad_norm"],
                        summary["images_per_second"], 100 * summary["input_wait_fraction"], format_duration(eta))
                    writer.write_train(step, summary)
                    last_logged = {"loss": summary["loss"], "img/s": round(summary["images_per_second"], 1)}
                    data_report.update("train", train_iter.input_counts)
                    pending.clear()
                    window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0

                if step % config.checkpoint_every_steps == 0 or step == total_steps or stopped_early:
                    checkpointing.save(manager, step, state, {"step": step, "input_position": train_iter.position})
                if stopped_early:
                    logging.warning("stopping at step %d of %d on a preemption signal; the checkpoint of step %d is "
                                    "being written. Run the same command to resume.", step, total_steps, step)
                    break
                if step % config.eval_every_steps == 0 or step == total_steps:
                    last_metrics = run_eval(step)
                    window_start = time.perf_counter()  # eval time is not training throughput

            if start_step >= total_steps:
                logging.info("workdir already holds a checkpoint at step %d >= total_steps; evaluating it", start_step)
                last_metrics = run_eval(start_step)
            if not stopped_early:
                checkpointing.export_params(workdir, state.params)
    finally:
        # Let an in-flight async save finish so the newest checkpoint is complete.
        manager.wait_until_finished()
        manager.close()
        best_manager.close()
        writer.close()
    if stopped_early:
        return None
    if is_primary and last_metrics is not None:
        logging.info("final COCO metrics: %s", json.dumps({k: round(v, 4) for k, v in last_metrics.items()}))
    return last_metrics


class _EvalPictures:
    """The first `config.eval_pictures` validation images, predicted at every evaluation for TensorBoard.

    The batch is read once and kept on the devices; every process takes part
    in predicting it, process 0 draws "predictions | ground truth" panels.
    """

    def __init__(self, config, eval_config, mesh, batch_axes, batch_sharding, class_names, *, enabled: bool):
        self._count = int(config.get("eval_pictures", 0))
        self._enabled = enabled
        self._class_names = class_names
        options = transforms.TransformOptions.from_config(config)
        self._mean_rgb, self._std_rgb = options.mean_rgb, options.std_rgb
        self._batch = self._host_batch = None
        if self._count <= 0:
            return
        eval_iter = input_pipeline.create_eval_iterator(
            eval_config, first_row=input_pipeline.process_rows(batch_sharding, eval_config.global_batch_size))
        self._batch = input_pipeline.to_global_batch(next(iter(eval_iter.batches)), mesh, batch_axes)
        self._host_batch = jax.tree.map(np.array, multihost_utils.process_allgather(self._batch, tiled=True))
        self._host_batch["example_mask"][self._count:] = False

    def write(self, step: int, predict, params, writer: MetricWriter) -> None:
        if self._batch is None:
            return
        outputs = multihost_utils.process_allgather(predict(params, self._batch), tiled=True)
        if self._enabled:
            panels = visualize.prediction_panels(self._host_batch, jax.tree.map(np.asarray, outputs),
                                                 mean_rgb=self._mean_rgb, std_rgb=self._std_rgb,
                                                 class_names=self._class_names)
            writer.write_images(step, {"eval/predictions_vs_ground_truth": panels})


class _NonFiniteSteps:
    """Counts steps the train step skipped for a non-finite loss or gradient; stops after too many in a row."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive  # 0: never stop, only skip and count
        self.total = 0
        self._run_start, self._run_length = None, 0

    def observe(self, first_step: int, skipped: list[bool]) -> None:
        """Takes the skipped flags of steps first_step, first_step + 1, ...; raises TrainingError if too many in a row."""
        for step, was_skipped in enumerate(skipped, start=first_step):
            if not was_skipped:
                self._run_start, self._run_length = None, 0
                continue
            self.total += 1
            self._run_start = step if self._run_start is None else self._run_start
            self._run_length += 1
            logging.warning("step %d: non-finite loss or gradient; update skipped (%d skipped so far)", step, self.total)
            if self.max_consecutive and self._run_length >= self.max_consecutive:
                raise TrainingError(
                    f"{self._run_length} consecutive steps ({self._run_start}-{step}) had a non-finite loss or "
                    "gradient and were skipped; the parameters and checkpoints still hold the last good state. "
                    "Lower optimizer.learning_rate, set optimizer.grad_clip_norm, check the data, or raise "
                    "max_consecutive_nonfinite (0 never stops)")


class _DataReport:
    """What the input pipeline skipped, converted, clipped or masked: logged and kept in WORKDIR/data_report.json.

    Conversion counts come from the prepared splits (the same on every host);
    streaming counts (undecodable images masked, boxes cut at max_boxes) cover
    this run since it (re)started, summed over processes, so every process
    must call `update` together.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: epath.Path, *, enabled: bool):
        self._path = workdir / "data_report.json"
        self._enabled = enabled
        self._report = {"dataset": config.dataset.name}
        for which in ("train", "eval"):
            split = input_pipeline.prepare_split(config, which)
            counts = dict(sorted(split.counts.items()))
            self._report[which] = {"prepared_split": split.directory, "records": split.num_records,
                                   "conversion": counts, "streaming": {}}
            handled = {k: v for k, v in counts.items() if v and k not in ("images", "usable_images", "annotations")}
            logging.info("%s data: %d usable of %d images; %s", which, split.num_records,
                         counts.get("images", split.num_records),
                         f"handled: {handled}" if handled else "nothing skipped, dropped or converted")
        self._write()

    def update(self, which: str, input_counts: input_pipeline.InputCounts) -> None:
        keys = sorted(input_counts.counts)
        local = np.array([input_counts.examples] + [input_counts.counts[k] for k in keys], np.int64)
        # Same keys on every process (the pipeline's REPORT_KEYS): sum over hosts.
        total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, local.size).sum(axis=0)
        streaming = {"examples": int(total[0]), **{k: int(v) for k, v in zip(keys, total[1:])}}
        before = self._report[which]["streaming"]
        if any(streaming[k] > before.get(k, 0) for k in keys):
            logging.warning("%s input since this run started: %s", which, streaming)
        self._report[which]["streaming"] = streaming
        self._write()

    def _write(self) -> None:
        if self._enabled:
            self._path.write_text(json.dumps(self._report, indent=2))


def main(argv: list[str]) -> None:
    cli.start(argv)
    logging.info("%s", distributed.describe())
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    cli.run(main)

"""What the training loop watches between steps: metric windows, skipped steps and the data report.

All three run on the host and never add a device sync of their own: the
loop hands `MetricWindow` the device metrics of every step and fetches them
once per logging window.
"""

from __future__ import annotations

import json
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

import input_pipeline
from detector.errors import TrainingError
from input_pipeline.progress import format_duration


class MetricWindow:
    """The steps since the last log line: their device metrics, wall time and time spent waiting for input."""

    def __init__(self, global_batch_size: int, total_steps: int):
        self._global_batch_size = global_batch_size
        self._total_steps = total_steps
        self._pending: list[dict[str, jax.Array]] = []
        self.restart()

    def restart(self) -> None:
        """Starts a new window: no steps, no time."""
        self._start, self._input_wait, self._steps, self._excluded = time.perf_counter(), 0.0, 0, 0.0
        self._pending.clear()

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` of the window's wall time (an evaluation) out of its rates."""
        self._excluded += seconds

    def add_input_wait(self, seconds: float) -> None:
        self._input_wait += seconds

    def add_step(self, metrics: dict[str, jax.Array]) -> None:
        self._pending.append(metrics)
        self._steps += 1

    def summarize(self, step: int, nonfinite: NonFiniteSteps) -> dict[str, float]:
        """Fetches the window's metrics (the loop's only host sync) and returns their summary.

        Loss terms average the steps that updated the model; skipped steps are
        counted (`skipped_steps`) and reported to `nonfinite`. Rates are per
        window: `images_per_second`, `step_time_s`, `input_wait_fraction`.
        """
        fetched = jax.device_get(self._pending)
        elapsed = time.perf_counter() - self._start - self._excluded
        nonfinite.observe(step - len(fetched) + 1, [bool(m["nonfinite"]) for m in fetched])
        good = [m for m in fetched if not m["nonfinite"]] or fetched
        summary = {k: float(np.mean([m[k] for m in good])) for k in fetched[0] if k != "nonfinite"}
        summary["skipped_steps"] = float(sum(m["nonfinite"] for m in fetched))
        summary["learning_rate"] = float(fetched[-1]["learning_rate"])
        summary["images_per_second"] = self._steps * self._global_batch_size / elapsed
        summary["step_time_s"] = elapsed / self._steps
        summary["input_wait_fraction"] = self._input_wait / elapsed
        return summary

    def log_line(self, step: int, summary: dict[str, float]) -> str:
        """The log line of a window's summary, with the ETA at its step time."""
        eta = (self._total_steps - step) * summary["step_time_s"]
        return (
            f"step {step}/{self._total_steps} | loss {summary['loss']:.4f} (cls {summary['cls_loss']:.4f} "
            f"box {summary['box_loss']:.4f}) | lr {summary['learning_rate']:.2e} | grad norm "
            f"{summary['grad_norm']:.3f} | {summary['images_per_second']:.1f} img/s | input wait "
            f"{100 * summary['input_wait_fraction']:.0f}% | ETA {format_duration(eta)}"
        )


class NonFiniteSteps:
    """Counts steps the train step skipped for a non-finite loss or gradient; stops after too many in a row."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive  # 0: never stop, only skip and count
        self.total = 0
        self._run_start, self._run_length = None, 0

    def observe(self, first_step: int, skipped: list[bool]) -> None:
        """Takes the skipped flags of steps first_step, first_step + 1, ...; raises TrainingError after too many."""
        for step, was_skipped in enumerate(skipped, start=first_step):
            if not was_skipped:
                self._run_start, self._run_length = None, 0
                continue
            self.total += 1
            self._run_start = step if self._run_start is None else self._run_start
            self._run_length += 1
            logging.warning(
                "step %d: non-finite loss or gradient; update skipped (%d skipped so far)", step, self.total
            )
            if self.max_consecutive and self._run_length >= self.max_consecutive:
                raise TrainingError(
                    f"{self._run_length} consecutive steps ({self._run_start}-{step}) had a non-finite loss or "
                    "gradient and were skipped; the parameters and checkpoints still hold the last good state. "
                    "Lower optimizer.learning_rate, set optimizer.grad_clip_norm, check the data, or raise "
                    "max_consecutive_nonfinite (0 never stops)"
                )


class DataReport:
    """What the input pipeline skipped, converted, clipped or masked: logged and kept in WORKDIR/data_report.json.

    Conversion counts come from the prepared splits (the same on every host);
    streaming counts (undecodable images masked, boxes cut at max_boxes) cover
    this run since it (re)started, summed over processes, so every process
    must call `update` together.
    """

    FILE = "data_report.json"

    def __init__(self, config: ml_collections.ConfigDict, workdir: epath.Path, *, enabled: bool):
        self._path = workdir / self.FILE
        self._enabled = enabled
        self._report = {"dataset": config.dataset.name}
        for which in ("train", "eval"):
            split = input_pipeline.prepare_split(config, which)
            counts = dict(sorted(split.counts.items()))
            self._report[which] = {
                "prepared_split": split.directory,
                "records": split.num_records,
                "conversion": counts,
                "streaming": {},
            }
            handled = {k: v for k, v in counts.items() if v and k not in ("images", "usable_images", "annotations")}
            logging.info(
                "%s data: %d usable of %d images; %s",
                which,
                split.num_records,
                counts.get("images", split.num_records),
                f"handled: {handled}" if handled else "nothing skipped, dropped or converted",
            )
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

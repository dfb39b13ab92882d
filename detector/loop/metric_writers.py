"""Training and evaluation metrics: JSON lines and TensorBoard scalars in the workdir.

Only the primary process (process 0) writes; the others get a writer that
does nothing, so callers need no `if process_index == 0` of their own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping

import numpy as np
from etils import epath

TRAIN_METRICS_FILE = "train_metrics.jsonl"
EVAL_METRICS_FILE = "eval_metrics.jsonl"


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _rewrite(path: epath.Path, lines: list[str]) -> None:
    """Replaces `path`'s content by `lines`; atomic: a kill leaves the old file or the new one."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in lines))
    temporary.replace(path)


def _json_value(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


class MetricWriter:
    """Appends `{"step": N, ...}` lines and TensorBoard scalars (under `WORKDIR/tensorboard`)."""

    def __init__(self, workdir: str, *, enabled: bool):
        self._enabled = enabled
        self._workdir = epath.Path(workdir)
        self._summary_writer = None
        if enabled:
            self._workdir.mkdir(parents=True, exist_ok=True)
            import tensorflow as tf  # Deferred: only the writing process pays for it.

            self._tf = tf
            self._summary_writer = tf.summary.create_file_writer(str(self._workdir / "tensorboard"))

    def _write(self, filename: str, prefix: str, step: int, metrics: Mapping[str, float]) -> None:
        if not self._enabled:
            return
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        with (self._workdir / filename).open("a") as f:
            f.write(json.dumps(record) + "\n")
        with self._summary_writer.as_default(step=int(step)):
            for name, value in metrics.items():
                self._tf.summary.scalar(f"{prefix}/{name}", float(value))
        self._summary_writer.flush()

    def discard_after(self, step: int) -> None:
        """Drops lines past `step`, the checkpoint a resumed run starts from, so no step appears twice.

        A run killed after logging step 7 whose newest checkpoint is step 6 logs
        step 7 again once resumed; a line cut short by the kill is dropped too.
        """
        if not self._enabled:
            return
        for filename in (TRAIN_METRICS_FILE, EVAL_METRICS_FILE):
            path = self._workdir / filename
            if not path.exists():
                continue
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [
                line
                for line, line_step in zip(lines, map(_step_of, lines))
                if line_step is not None and line_step <= step
            ]
            if len(kept) < len(lines):
                logging.info(
                    "%s: dropped %d line(s) past step %d, the checkpoint this run resumes from",
                    filename,
                    len(lines) - len(kept),
                    step,
                )
                _rewrite(path, kept)

    def write_train(self, step: int, metrics: Mapping[str, float]) -> None:
        self._write(TRAIN_METRICS_FILE, "train", step, metrics)

    def eval_steps(self) -> set[int]:
        """The steps eval_metrics.jsonl holds an evaluation of (empty on the processes that write nothing)."""
        path = self._workdir / EVAL_METRICS_FILE
        if not self._enabled or not path.exists():
            return set()
        return {step for step in map(_step_of, path.read_text().splitlines()) if step is not None}

    def write_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Appends the evaluation of `step`, replacing an earlier one of the same step (a finished run evaluated
        again), so the file holds each evaluated step once."""
        if step in self.eval_steps():
            path = self._workdir / EVAL_METRICS_FILE
            _rewrite(path, [line for line in path.read_text().splitlines() if line.strip() and _step_of(line) != step])
        self._write(EVAL_METRICS_FILE, "eval", step, metrics)

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """TensorBoard image summaries: name -> uint8 `[N, H, W, 3]` (all N shown)."""
        if not self._enabled:
            return
        with self._summary_writer.as_default(step=int(step)):
            for name, batch in images.items():
                self._tf.summary.image(name, batch, max_outputs=len(batch))
        self._summary_writer.flush()

    def close(self) -> None:
        if self._summary_writer is not None:
            self._summary_writer.close()

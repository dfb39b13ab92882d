"""Host resident memory of a long training run, sampled from outside, from the first step to the last.

  python -m benchmarks.host_memory                                   # default config, 5,000 steps
  python -m benchmarks.host_memory --total_steps=600 --eval_every_steps=200   # a quick look

Runs `python -m detector.train` in a fresh process and workdir and reads the
resident set size (VmRSS of /proc/PID/status, the process and its children)
every --sample_s seconds, pairing each sample with the newest step the log has
printed. Memory that grows with the step count (a cache keyed by step, metrics
kept forever, an iterator recreated per evaluation that never frees its
buffers) shows as a slope across evaluations; what a run needs once (compiled
programs, the COCO ground truth, the first evaluation's buffers) is paid
before the first evaluation ends. So the baseline is the median of the first
tenth of the samples after the first evaluation, and the growth is that of
the median of the last tenth before the final evaluation: one sample swings
by several percent with the batches in flight.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from benchmarks import report
from benchmarks.process_tree import resident_bytes

_CONFIG = flags.DEFINE_string("config", "configs/default.py", "The config file to train.")
_TOTAL_STEPS = flags.DEFINE_integer("total_steps", 5000, "Steps to train.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every_steps", 500, "Evaluate every this many steps.")
_LOG_EVERY = flags.DEFINE_integer("log_every_steps", 10, "Log (and so date the samples) every this many steps.")
_SAMPLE_S = flags.DEFINE_float("sample_s", 2.0, "Seconds between memory samples.")
_ROWS = flags.DEFINE_integer("rows", 12, "Table rows: samples at this many evenly spaced steps.")
_MAX_GROWTH = flags.DEFINE_float("max_growth", 0.05, "Exit 1 when memory grows by more than this fraction.")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "KEY=VALUE config overrides (as --config.KEY=VALUE), e.g. input.num_threads=1."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (default: a new temporary directory).")

_STEP_LINE = re.compile(r"step (\d+)/\d+ \|")
_EVAL_LINE = re.compile(r"eval step (\d+)")


class _LogFollower:
    """Copies the child's output to a log file and keeps the newest step and the evaluated steps."""

    def __init__(self, stream, log_path: str):
        self.step = 0
        self.evaluated: list[int] = []
        self._stream, self._log_path = stream, log_path
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        with open(self._log_path, "w") as log:
            for line in self._stream:
                log.write(line)
                log.flush()  # the log is there to be followed while the run goes on
                if match := _STEP_LINE.search(line):
                    self.step = int(match.group(1))
                if match := _EVAL_LINE.search(line):
                    self.evaluated.append(int(match.group(1)))
                    self.step = max(self.step, self.evaluated[-1])

    def join(self) -> None:
        self._thread.join(timeout=30)


def main(argv: list[str]) -> None:
    del argv
    workdir = _WORKDIR.value or os.path.join(tempfile.mkdtemp(prefix="host_memory_"), "run")
    if os.path.exists(os.path.join(workdir, "checkpoints")):
        sys.exit(f"error: {workdir} holds checkpoints (the run would resume); pick another --workdir")
    command = [
        sys.executable,
        "-m",
        "detector.train",
        f"--config={_CONFIG.value}",
        f"--workdir={workdir}",
        f"--config.total_steps={_TOTAL_STEPS.value}",
        f"--config.eval_every_steps={_EVAL_EVERY.value}",
        f"--config.log_every_steps={_LOG_EVERY.value}",
        *[f"--config.{override}" for override in _OVERRIDES.value],
    ]
    os.makedirs(os.path.dirname(os.path.abspath(workdir)), exist_ok=True)
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_path = workdir.rstrip("/") + ".log"
    follower = _LogFollower(process.stdout, log_path)
    samples = []  # (wall s, step, evaluations so far, bytes)
    while process.poll() is None:
        rss = resident_bytes(process.pid)
        if rss:
            samples.append((time.monotonic() - start, follower.step, len(follower.evaluated), rss))
        time.sleep(_SAMPLE_S.value)
    follower.join()
    if process.returncode != 0:
        with open(log_path) as f:
            sys.exit(f"error: training failed (exit {process.returncode}); its log ends:\n{f.read()[-3000:]}")
    after_first_eval = [s for s in samples if s[2] >= 1 and s[1] < _TOTAL_STEPS.value]
    if not after_first_eval:
        sys.exit("error: no sample after the first evaluation; train longer or evaluate more often")
    # Medians of the first and the last tenth: one sample swings by +-5% with
    # the batches in flight and the evaluation's buffers; a leak moves the median.
    tenth = max(1, len(after_first_eval) // 10)
    baseline = (after_first_eval[0][1], statistics.median(s[3] for s in after_first_eval[:tenth]))
    final = (after_first_eval[-1][1], statistics.median(s[3] for s in after_first_eval[-tenth:]))
    gib = 1024**3
    trained = [s for s in samples if s[1] > 0]
    wanted = [round(_TOTAL_STEPS.value * i / (_ROWS.value - 1)) for i in range(_ROWS.value)]
    rows = []
    for target in wanted:
        sample = min(trained, key=lambda s: abs(s[1] - target))
        rows.append(
            [
                sample[1],
                round(sample[0]),
                sample[2],
                sample[3] / gib,
                f"{100 * (sample[3] - baseline[1]) / baseline[1]:+.1f}%",
            ]
        )
    growth = (final[1] - baseline[1]) / baseline[1]
    peak = max(s[3] for s in samples)
    report.emit(
        "host_memory",
        f"Host resident memory of `{_CONFIG.value}` over {_TOTAL_STEPS.value} steps (evaluations every "
        f"{_EVAL_EVERY.value}); median of the first tenth after the first evaluation (from step {baseline[0]}): "
        f"{baseline[1] / gib:.3f} GiB, of the last tenth (to step {final[0]}): {final[1] / gib:.3f} GiB, growth "
        f"{100 * growth:+.1f}%, peak {peak / gib:.3f} GiB",
        ["step", "wall s", "evaluations", "resident GiB", "vs baseline"],
        rows,
        extra={
            "baseline_bytes": baseline[1],
            "final_bytes": final[1],
            "growth": growth,
            "peak_bytes": peak,
            "samples": samples,
            "log": log_path,
        },
    )
    if growth > _MAX_GROWTH.value:
        sys.exit(f"error: resident memory grew {100 * growth:.1f}% (more than {100 * _MAX_GROWTH.value:.0f}%)")


if __name__ == "__main__":
    app.run(main)

"""COCO AP against wall-clock time for several configs trained one after the other on this machine.

  python -m benchmarks.ap_vs_time                                   # configs/default.py vs configs/dino_tiny.py
  python -m benchmarks.ap_vs_time --configs=default,dino_tiny --eval_every_steps=250   # the same steps for both
  python -m benchmarks.ap_vs_time --configs=default --budget_s=60 --override=total_steps=300   # a quick look

Each config runs as `python -m detector.train --config=configs/NAME.py` in a
fresh process and workdir (nothing cached, the compiling counted), one after
the other so they never share the cores. The script stamps every line its run
appends to WORKDIR/eval_metrics.jsonl with the seconds since that process
started, so each evaluation is a point (wall seconds, step, AP); evaluating
costs wall time too, as it does a user. A run still going at --budget_s is
stopped there. The table lists every point of every config, and the JSON keeps
them for plotting.

What it answers: which detector a user on this machine gets furthest with in
the same time, from `python -m detector.train` to the last evaluation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import report

_CONFIGS = flags.DEFINE_list("configs", ["default", "dino_tiny"], "Config names under configs/.")
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every_steps",
    0,
    "Evaluate (and stamp a point) every this many steps; 0: as each config says (runs whose batch sizes "
    "differ then evaluate as often per image seen as their recipes chose, not per step).",
    lower_bound=0,
)
_BUDGET = flags.DEFINE_float("budget_s", 420.0, "Stop a run still going after this many wall seconds.")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "KEY=VALUE config overrides for every run, e.g. total_steps=300 (as --config.KEY=VALUE)."
)
_WORKDIR_ROOT = flags.DEFINE_string("workdir_root", None, "Where the runs' workdirs go (default: a temporary dir).")

POLL_S = 0.5


def run_config(name: str, workdir: str) -> list[dict]:
    """Trains `configs/NAME.py` in `workdir`; returns its evaluations with their wall seconds."""
    command = [
        sys.executable,
        "-m",
        "detector.train",
        f"--config=configs/{name}.py",
        f"--workdir={workdir}",
        # Every run compiles from nothing: a program a user's earlier run left in the
        # persistent cache would shorten one config's time and not another's.
        "--compilation_cache_dir=",
        *([f"--config.eval_every_steps={_EVAL_EVERY.value}"] if _EVAL_EVERY.value > 0 else []),
        *[f"--config.{override}" for override in _OVERRIDES.value],
    ]
    eval_file = os.path.join(workdir, "eval_metrics.jsonl")
    log_path = os.path.join(workdir + ".log")
    points, seen = [], 0
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while True:
            finished = process.poll() is not None
            elapsed = time.monotonic() - start
            if os.path.exists(eval_file):
                with open(eval_file) as f:
                    lines = f.read().splitlines()
                for line in lines[seen:]:
                    points.append({"config": name, "wall_s": elapsed, **json.loads(line)})
                seen = len(lines)
            if finished:
                break
            if elapsed > _BUDGET.value:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
                break
            time.sleep(POLL_S)
    if process.returncode not in (0, None, -signal.SIGINT) and not points:
        with open(log_path) as f:
            sys.exit(f"error: {name} failed (exit {process.returncode}); its log ends:\n{f.read()[-3000:]}")
    print(f"{name}: {len(points)} evaluations in {time.monotonic() - start:.0f}s (log: {log_path})", flush=True)
    return points


def main(argv: list[str]) -> None:
    del argv
    root = _WORKDIR_ROOT.value or tempfile.mkdtemp(prefix="ap_vs_time_")
    os.makedirs(root, exist_ok=True)
    for name in _CONFIGS.value:
        if os.path.exists(os.path.join(root, name)):
            sys.exit(f"error: {os.path.join(root, name)} exists (a run would resume it); pick another --workdir_root")
    points = []
    for name in _CONFIGS.value:
        points += run_config(name, os.path.join(root, name))
    columns = ["config", "step", "wall s", "AP", "AP50", "AP75"]
    rows = [[p["config"], p["step"], round(p["wall_s"], 1), p["AP"], p["AP50"], p["AP75"]] for p in points]
    report.emit(
        "ap_vs_time",
        f"COCO AP against wall-clock time, runs one after the other ({', '.join(_CONFIGS.value)})",
        columns,
        rows,
        extra={"budget_s": _BUDGET.value, "overrides": _OVERRIDES.value},
    )


if __name__ == "__main__":
    app.run(main)

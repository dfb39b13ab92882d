"""Where a train step's time goes: a `jax.profiler` trace of the step, summed by module, pass and op.

  python -m benchmarks.profile_step --config=configs/retinanet_r50_coco.py \
      --config.input.image_size="(512,512)" --config.global_batch_size=2 \
      --config.model.backbone.norm=frozen_bn --config.model.backbone.freeze_stages=2 \
      --config.model.head_norm=none --num_classes=80

Traces `--steps` steps after a warm-up one (the trace stays in `--trace_dir`
for TensorBoard's profile plugin or Perfetto), then attributes every XLA op
the trace recorded to the model part (backbone, neck, head; loss and
optimizer for the rest), the pass (forward, or backward: JAX's transpose of
the forward) and the JAX operation it came from (its HLO op_name metadata),
and prints the largest groups. Op time is summed over the threads that ran
ops, so where ops overlap it exceeds the step's wall time; shares compare
groups with each other. The profiler times XLA:CPU's Eigen matmuls (dots
that XNNPACK does not take, such as the kernel gradients' leading-dim
contractions) only while they are started, not while they run on the thread
pool: their time is in the last line, the cores' time that no timed op
covers (wall time x cores - op time), together with idle time.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

from absl import app, flags
from ml_collections import config_flags

from benchmarks import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 1, "Traced steps (after one warm-up step).")
_TOP = flags.DEFINE_integer("top", 20, "Groups to print.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 4, "Classes of the detection head.")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "Where the trace is written (default: a temporary directory).")

_MODEL_PARTS = ("backbone", "neck", "head")
# Profiler events that are the runtime's own bookkeeping, not XLA ops.
_RUNTIME_EVENTS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener")


def op_names(hlo_text: str) -> dict[str, str]:
    """`{HLO instruction name: the op_name metadata JAX gave it}` from a compiled module's text."""
    return {
        m.group(1): m.group(2) for m in re.finditer(r"^\s*%?(\S+) = .*?metadata=\{op_name=\"([^\"]*)\"", hlo_text, re.M)
    }


def attribute(op_name: str, event_name: str) -> tuple[str, str, str]:
    """(model part, pass, operation) of one op, e.g. ('head', 'backward', 'dot_general')."""
    if not op_name:
        return "runtime", "-", re.sub(r"[.\d]+$", "", event_name)
    parts = op_name.split("/")
    part = next((p for p in parts if p in _MODEL_PARTS), "loss+optimizer")
    direction = "backward" if any(p.startswith("transpose(") for p in parts) else "forward"
    return part, direction, parts[-1]


def summarize(xspace_path: str, names: dict[str, str], num_steps: int) -> list[tuple[tuple[str, str, str], float]]:
    """Op milliseconds per step by (part, pass, operation), largest first."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(xspace_path)
    totals: collections.Counter = collections.Counter()
    for plane in profile.planes:
        if not plane.name.startswith("/host:CPU") and not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if event.name.startswith(_RUNTIME_EVENTS) or event.name.startswith("$"):
                    continue
                totals[attribute(names.get(event.name, ""), event.name)] += event.duration_ns / 1e6 / num_steps
    return totals.most_common()


def main(argv: list[str]) -> None:
    del argv
    import jax

    from benchmarks import jax_step

    config = _CONFIG.value
    step = jax_step.build(config, _NUM_CLASSES.value)
    step.run(1)
    trace_dir = _TRACE_DIR.value or tempfile.mkdtemp(prefix="profile_step_")
    jax.profiler.start_trace(trace_dir)
    seconds = step.run(_STEPS.value)
    jax.profiler.stop_trace()
    xspaces = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb")), key=os.path.getmtime)
    groups = summarize(xspaces[-1], op_names(step.compiled.as_text()), _STEPS.value)
    total = sum(ms for _, ms in groups) or 1.0
    cores = os.cpu_count() or 1
    by_part = collections.Counter()
    for (part, _, _), ms in groups:
        by_part[part] += ms
    rows = [(part, direction, op, ms, 100 * ms / total) for (part, direction, op), ms in groups[: _TOP.value]]
    height, width = config.input.image_size
    report.emit(
        "profile_step",
        f"Where the train step's time goes: {1000 * seconds:.0f} ms/step wall, {total:.0f} ms op time "
        f"(global batch {config.global_batch_size}, image {height}x{width}); trace in {trace_dir}",
        ["part", "pass", "operation", "op ms/step", "% of op time"],
        rows,
        extra={"step_ms": 1000 * seconds, "op_ms": total, "by_part": dict(by_part), "cores": cores},
    )
    print(
        "op time by model part: " + ", ".join(f"{part} {100 * ms / total:.0f}%" for part, ms in by_part.most_common())
    )
    untimed = max(0.0, 1000 * seconds * cores - total)
    print(
        f"not in any timed op: {untimed:.0f} ms/step of {cores} cores' time "
        "(idle, or Eigen matmuls, which are timed only while they start)"
    )


if __name__ == "__main__":
    from detector import cli

    cli.use_fast_cpu_convolutions()
    app.run(main)

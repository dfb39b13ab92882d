"""Where a train step's time and memory go, by model part: a `jax.profiler` trace and XLA's buffers at the peak.

  python -m benchmarks.profile_step --config=configs/retinanet_r50_coco.py \
      --config.input.image_size="(512,512)" --config.global_batch_size=2 \
      --config.model.backbone.norm=frozen_bn --config.model.backbone.freeze_stages=2 \
      --config.model.head_norm=none --num_classes=80
  python -m benchmarks.profile_step --config=configs/dino_r50_coco.py \
      --config.input.image_size="(512,512)" --config.global_batch_size=2 --num_classes=80

Traces `--steps` steps after a warm-up one (the trace stays in `--trace_dir`
for TensorBoard's profile plugin or Perfetto), then attributes every XLA op
the trace recorded to the model part (see below; `optimizer+other` for
what is outside the detector and its loss), the pass (forward, or backward: JAX's transpose of
the forward) and the JAX operation it came from (its HLO op_name metadata),
and prints the largest groups. Op time is summed over the threads that ran
ops, so where ops overlap it exceeds the step's wall time; shares compare
groups with each other. The profiler times XLA:CPU's Eigen matmuls (dots
that XNNPACK does not take, such as the kernel gradients' leading-dim
contractions) only while they are started, not while they run on the thread
pool: their time is in the last line, the cores' time that no timed op
covers (wall time x cores - op time), together with idle time.

Memory: XLA writes the train step's buffer live ranges as it compiles it
(`--xla_dump_to`, set here before JAX starts); the second table lists the
buffers live at the step's peak (parameters, optimizer state and batch
included), largest first, with the model part, pass and operation that
produced each, and the peak's total by part. Model parts are the detector's
top-level modules (backbone, neck, head; encoder and decoder layers summed
over layers) and the loss's named stages (denoising, matching, loss).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import tempfile

from absl import app, flags
from ml_collections import config_flags

from benchmarks import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 1, "Traced steps (after one warm-up step).")
_TOP = flags.DEFINE_integer("top", 20, "Groups to print.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 4, "Classes of the detection head.")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "Where the trace is written (default: a temporary directory).")

_MODEL_PARTS = ("backbone", "neck", "head", "encoder", "decoder", "denoising", "matching", "loss")
_DUMP_ENV = "PROFILE_STEP_XLA_DUMP"  # where __main__ asked XLA to write the step's buffer live ranges
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
    # encoder3 -> encoder; a DINO's class_head, box_head, query_position_head -> head.
    names = [re.sub(r"\d+$", "", p) for p in parts]
    names = ["head" if p.endswith("_head") else p for p in names]
    part = next((p for p in names if p in _MODEL_PARTS), None)
    if part is None:
        # Inside the detector's module (jvp(Dino), transpose(jvp(RetinaNet)), ...) but in no named part.
        in_model = any(re.search(r"\([A-Z]\w*\)+$", p) for p in parts)
        part = "model (other)" if in_model else "optimizer+other"
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


def peak_buffers(dump_dir: str) -> list[tuple[str, int]]:
    """`[(HLO instruction, bytes)]` live at the train step's memory peak, from XLA's dump of its live ranges.

    Empty when the dump has no train step (its compilation came from a cache).
    """
    reports = glob.glob(os.path.join(dump_dir, "*jit_train_step*after_optimizations-live-range.txt"))
    if not reports:
        return []
    buffers = []
    with open(max(reports, key=os.path.getmtime)) as f:
        at_peak = False
        for line in f:
            if re.match(r"\s*Live ranges at \d+ \(peak\):", line):
                at_peak = True
                continue
            match = re.match(r"\s+(\S+?)\{[^}]*\}: (\d+) bytes", line) if at_peak else None
            if at_peak and not match:
                break
            if match:
                buffers.append((match.group(1), int(match.group(2))))
    return buffers


def attribute_buffer(instruction: str, names: dict[str, str]) -> tuple[str, str, str]:
    """(model part, pass, operation) of a buffer; the step's inputs are 'state' (parameters, optimizer) or 'batch'."""
    if instruction.startswith("state"):
        return "state", "-", "parameters and optimizer state"
    if instruction.startswith("batch"):
        return "batch", "-", "input batch"
    if instruction not in names:
        return "unattributed", "-", re.sub(r"[.\d]+$", "", instruction)
    return attribute(names[instruction], instruction)


def _memory_report(names: dict[str, str], top: int) -> None:
    dump_dir = os.environ.get(_DUMP_ENV, "")
    buffers = peak_buffers(dump_dir)
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)  # XLA dumps every fusion's code too: hundreds of MB
    if not buffers:
        print("no buffer live ranges were dumped (was the step loaded from a compilation cache?)")
        return
    peak = sum(size for _, size in buffers)
    by_part: collections.Counter = collections.Counter()
    rows = []
    for instruction, size in buffers:
        part, direction, op = attribute_buffer(instruction, names)
        by_part[part] += size
        if len(rows) < top:
            rows.append((part, direction, op, instruction, size / 2**20, 100 * size / peak))
    report.emit(
        "profile_step_memory",
        f"The train step's largest buffers at its memory peak: {peak / 1e9:.3f} GB live per device "
        "(XLA's buffer assignment, inputs included)",
        ["part", "pass", "operation", "buffer", "MiB", "% of peak"],
        rows,
        extra={"peak_bytes": peak, "by_part": dict(by_part)},
    )
    print(
        "peak by model part: " + ", ".join(f"{part} {100 * size / peak:.0f}%" for part, size in by_part.most_common())
    )


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
    names = op_names(step.compiled.as_text())
    groups = summarize(xspaces[-1], names, _STEPS.value)
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
    _memory_report(names, _TOP.value)


if __name__ == "__main__":
    from detector import cli

    cli.use_cpu_xla_flags()
    # The step's buffer live ranges, written as XLA compiles it (and removed once read).
    os.environ[_DUMP_ENV] = tempfile.mkdtemp(prefix="profile_step_xla_")
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={os.environ[_DUMP_ENV]} "
        "--xla_dump_hlo_module_re=.*train_step.*"
    ).strip()
    app.run(main)

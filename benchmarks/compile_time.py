"""Time to the first finished train step of each shipped config, with a cold and a warm compilation cache.

  python -m benchmarks.compile_time                                 # the default list below, 256 px, batch 2
  python -m benchmarks.compile_time --configs=default,vitdet_l_coco --image_size=512

What a user waits for between launching a run and its first step, as the
trainer pays it: importing JAX and the model code, starting the backend,
compiling the train step (and the state initialiser), initialising the state
and running the first step. Each config keeps its shipped graph (depth,
widths, dtype, optimizer, anchors); only the input is shrunk to
--image_size and the global batch to --batch_size, on a mesh of data=-1 over
the local devices, so the numbers come in minutes on a CPU.

Every measurement runs in a fresh worker process (`--worker=CONFIG`), so
nothing is cached in memory. The worker points JAX's persistent compilation
cache (`jax_compilation_cache_dir`) at a directory of its own config and
caches every executable, however small or quick to compile. The first worker
finds that directory empty (cold); the second finds what the first wrote
(warm), as a relaunched or preempted run with a persistent
`jax_compilation_cache_dir` would. Times are seconds from the worker's first
line of Python (interpreter start-up itself is not counted):

  * setup: imports, JAX backend start, config built;
  * compile: compiling the train step (`jax_step.build`'s plan.compile_seconds);
  * model built: start to the compiled step with its initialised state and a
    batch on the device (so setup + compile + state initialisation);
  * first step: running the first step to completion;
  * to first step: start to the first step finished.

The table also counts the cache entries each run wrote: a warm run should
write none; one that does compiled that program again because its cache key
came out different (the warm row's compile time then shows it).
"""

from __future__ import annotations

import time

# Captured first, so every figure the worker reports counts from here.
WORKER_STARTED = time.monotonic()

import json  # noqa: E402  (after the start time, on purpose)
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402

from benchmarks import report  # noqa: E402

SHIPPED_CONFIGS = ("default", "vitdet_tiny", "retinanet_r50_coco", "vitdet_b_coco", "vitdet_l_coco", "vitdet_h_coco")
# The configs that finish on a 2-core, 24 GB CPU machine, each in under 5 minutes.
# vitdet_h_coco is left out: its step needs 20.1 GB at 256 px and batch 2
# (`python -m detector.plan`), and even at 128 px its worker grows past 20 GB
# while initialising, more than such a machine has to spare.
DEFAULT_CONFIGS = ("default", "vitdet_tiny", "retinanet_r50_coco", "vitdet_b_coco", "vitdet_l_coco")


# ----------------------------------------------------------------------------- the worker


def reduced_config(name: str, image_size: int, batch_size: int):
    """configs/NAME.py as shipped, with square `image_size` inputs and a global batch of `batch_size`."""
    import importlib

    config = importlib.import_module(f"configs.{name}").get_config()
    config.input.image_size = (image_size, image_size)
    config.global_batch_size = batch_size
    config.mesh.update(dict(data=-1, fsdp=1, model=1))
    return config


def _worker(name: str, cache_dir: str) -> None:
    import jax

    # Every executable goes to the cache, also the small and quick ones (the
    # state initialiser): the warm run should compile nothing.
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from benchmarks import jax_step

    config = reduced_config(name, _IMAGE_SIZE.value, _BATCH_SIZE.value)
    devices = jax.local_devices()  # starts the backend: part of setup
    setup_done = time.monotonic()
    step = jax_step.build(config, _NUM_CLASSES.value, devices=devices)
    built = time.monotonic()
    step.run(1)  # waits for the step to finish
    first_step_done = time.monotonic()
    record = {
        "config": name,
        "image_size": _IMAGE_SIZE.value,
        "global_batch_size": _BATCH_SIZE.value,
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "dtype": config.model.dtype,
        "setup_seconds": setup_done - WORKER_STARTED,
        "compile_seconds": step.plan.compile_seconds,
        "model_built_seconds": built - WORKER_STARTED,
        "first_step_seconds": first_step_done - built,
        "to_first_step_seconds": first_step_done - WORKER_STARTED,
        "per_device_bytes": step.plan.total_bytes,
    }
    # stdout carries the result, one JSON line; JAX and absl log to stderr.
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- the parent


def cache_entries(cache_dir: str) -> dict[str, int]:
    """Bytes of each entry of a persistent compilation cache, by file name (`jit_NAME-KEY-cache`)."""
    return {
        name: os.path.getsize(os.path.join(cache_dir, name))
        for name in os.listdir(cache_dir)
        if os.path.isfile(os.path.join(cache_dir, name))
    }


def run_worker(name: str, cache_dir: str) -> dict:
    """Runs one worker process for config `name` and returns its record (plus its wall time)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.compile_time",
        f"--worker={name}",
        f"--cache_dir={cache_dir}",
        f"--image_size={_IMAGE_SIZE.value}",
        f"--batch_size={_BATCH_SIZE.value}",
        f"--num_classes={_NUM_CLASSES.value}",
    ]
    start = time.monotonic()
    try:
        finished = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=_WORKER_TIMEOUT.value)
    except subprocess.TimeoutExpired:
        sys.exit(
            f"error: the {name} worker did not finish in {_WORKER_TIMEOUT.value} s; "
            "raise --worker_timeout_s or leave the config out of --configs"
        )
    wall = time.monotonic() - start
    lines = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    if finished.returncode != 0 or not lines:
        sys.exit(f"error: the {name} worker exited with status {finished.returncode} (its log is above)")
    return {**json.loads(lines[-1]), "process_wall_seconds": wall}


def main(argv: list[str]) -> None:
    del argv
    if _WORKER.value is not None:
        if not _CACHE_DIR.value:
            sys.exit("error: --worker needs --cache_dir")
        return _worker(_WORKER.value, _CACHE_DIR.value)
    unknown = [name for name in _CONFIGS.value if name not in SHIPPED_CONFIGS]
    if unknown:
        sys.exit(f"error: --configs: unknown {', '.join(unknown)}; use names of: {', '.join(SHIPPED_CONFIGS)}")

    cache_root = _CACHE_ROOT.value or tempfile.mkdtemp(prefix="compile_time_cache_")
    rows, records = [], []
    try:
        for name in _CONFIGS.value:
            cache_dir = os.path.join(cache_root, name)
            shutil.rmtree(cache_dir, ignore_errors=True)
            os.makedirs(cache_dir)
            for cache in ("cold", "warm"):
                before = cache_entries(cache_dir)
                record = run_worker(name, cache_dir)
                after = cache_entries(cache_dir)
                # A warm run that writes an entry compiled that program again: its
                # cache key differed from the cold run's. Named, not hidden.
                record.update(
                    cache=cache, cache_bytes=sum(after.values()), entries_written=sorted(set(after) - set(before))
                )
                records.append(record)
                print(
                    f"{name} ({cache}): first step done {record['to_first_step_seconds']:.1f} s after start, "
                    f"compile {record['compile_seconds']:.1f} s, "
                    f"{len(record['entries_written'])} cache entries written",
                    flush=True,
                )
                if cache == "warm" and record["entries_written"]:
                    print(
                        f"warning: {name}: the warm run missed the cache for "
                        f"{', '.join(entry.split('-')[0] for entry in record['entries_written'])}",
                        flush=True,
                    )
                rows.append(
                    (
                        name,
                        f"{_IMAGE_SIZE.value}x{_IMAGE_SIZE.value}",
                        _BATCH_SIZE.value,
                        record["dtype"],
                        cache,
                        record["setup_seconds"],
                        record["compile_seconds"],
                        record["model_built_seconds"],
                        record["first_step_seconds"],
                        record["to_first_step_seconds"],
                        len(record["entries_written"]),
                        record["cache_bytes"] / 2**20,
                    )
                )
    finally:
        if _CACHE_ROOT.value is None:
            shutil.rmtree(cache_root, ignore_errors=True)

    report.emit(
        "compile_time",
        f"Seconds from process start to the first finished train step, each config as shipped at "
        f"{_IMAGE_SIZE.value}x{_IMAGE_SIZE.value} px, global batch {_BATCH_SIZE.value}: a fresh process each, "
        "with an empty (cold) and then a filled (warm) persistent compilation cache",
        [
            "config",
            "image",
            "batch",
            "dtype",
            "cache",
            "setup s",
            "compile s",
            "start→model built s",
            "first step s",
            "start→first step s",
            "cache entries written",
            "cache MiB",
        ],
        rows,
        extra={"workers": records},
    )


if __name__ == "__main__":
    # Defined here, not on import, so that importing this module next to other
    # benchmarks with flags of the same names does not clash.
    _CONFIGS = flags.DEFINE_list(
        "configs",
        list(DEFAULT_CONFIGS),
        f"Shipped configs to measure (configs/NAME.py), of: {', '.join(SHIPPED_CONFIGS)}.",
    )
    _IMAGE_SIZE = flags.DEFINE_integer("image_size", 256, "Square input size in pixels.", lower_bound=32)
    _BATCH_SIZE = flags.DEFINE_integer("batch_size", 2, "Global batch size.", lower_bound=1)
    _NUM_CLASSES = flags.DEFINE_integer("num_classes", 80, "Classes of the detection head (COCO: 80).")
    _CACHE_ROOT = flags.DEFINE_string(
        "cache_root",
        None,
        "Where the per-config cache directories go (each is "
        "emptied before its cold run); default: a temporary directory, removed after.",
    )
    _WORKER_TIMEOUT = flags.DEFINE_integer("worker_timeout_s", 1800, "Give up on a worker after this many seconds.")
    _WORKER = flags.DEFINE_string("worker", None, "Internal: run as the worker for this config.")
    _CACHE_DIR = flags.DEFINE_string("cache_dir", None, "Internal: the worker's persistent compilation cache.")

    from detector import cli

    cli.use_cpu_xla_flags()
    app.run(main)

"""Command-line plumbing shared by the entry points: one-line errors for bad input.

A user who mistypes a config key or points at a missing dataset gets
`error: <cause and fix>` and a non-zero exit, not a traceback; `--verbose`
re-raises so the traceback is there when it is wanted.
"""

from __future__ import annotations

import logging as pylogging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from detector import compilation_cache
from detector.errors import ConfigError, OutputError, TrainingError, WeightsFileError
from input_pipeline import DatasetError
from sharding import MeshError, distributed
from sharding.distributed import DistributedError

flags.DEFINE_bool("verbose", False, "Show full tracebacks for errors.")
COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    compilation_cache.default_directory(),
    "Where compiled programs are kept, so a restarted or repeated run loads them instead of compiling: a local "
    "path or a gs:// URL, shared by all hosts on a cluster. Empty turns the cache off. Default: "
    "$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/detector/jax_compilation_cache (~/.cache without it).",
)

# Errors that describe bad input, not bugs: reported as one line.
USER_ERRORS = (
    ConfigError,
    DatasetError,
    DistributedError,
    MeshError,
    OutputError,
    TrainingError,
    WeightsFileError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
)

EXIT_USAGE = 2
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


def _fail(message: str, code: int) -> None:
    first_line = " ".join(str(message).split())
    print(f"error: {first_line}", file=sys.stderr, flush=True)
    sys.exit(code)


def _parse_flags(argv: Sequence[str]) -> list[str]:
    try:
        remaining = flags.FLAGS(argv)
        # ml_collections loads config files lazily, on first use; load them
        # here so a missing or broken file is reported like any bad flag.
        for name in list(flags.FLAGS):
            value = flags.FLAGS[name].value
            if type(value).__name__ == "_ErrorConfig":  # a config file that did not load
                cause = str(object.__getattribute__(value, "_error")).strip().splitlines()[-1].strip()
                _fail(f"cannot load the config file given as --{name}: {cause}", EXIT_USAGE)
        return remaining
    except flags.Error as e:
        _fail(f"{e} (see --helpfull for the flags)", EXIT_USAGE)
    except (KeyError, AttributeError) as e:
        # An override of a key the config does not have.
        key = str(e).strip("'\"")
        overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.") and key in a.split("=", 1)[0]]
        where = overrides[0] if overrides else f"config key {key!r}"
        _fail(f"{where}: unknown config key; check its spelling against the config file", EXIT_USAGE)
    except (OSError, SyntaxError, ValueError, TypeError) as e:
        # A config file that is missing or does not load, or a wrongly typed override.
        _fail(f"cannot load the config: {e}", EXIT_USAGE)


def define_trained_run_flags():
    """--config, --workdir, --checkpoint and --raw_params: which trained run, and which of its parameters, to use.

    For the commands that work on a trained workdir (evaluate, predict,
    export); returns their flag holders. Also marks --config and --workdir required.
    """
    config = config_flags.DEFINE_config_file("config", None, "Path to the training config file.", lock_config=True)
    workdir = flags.DEFINE_string("workdir", None, "The training run's directory (its checkpoints are read).")
    checkpoint = flags.DEFINE_string("checkpoint", "last", "Which parameters: last, best, or a checkpoint step.")
    raw_params = flags.DEFINE_bool(
        "raw_params",
        False,
        "Use the trained parameters themselves where the run kept an EMA of them (optimizer.ema_decay > 0), "
        "which is used by default.",
    )
    flags.mark_flags_as_required(["config", "workdir"])
    return config, workdir, checkpoint, raw_params


def use_fake_cpu_devices(count: int) -> None:
    """Makes JAX start on `count` CPU devices, e.g. to plan or benchmark a mesh on a laptop.

    Must run before JAX initialises its backend (its first device query).
    """
    flags_kept = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(flags_kept + [f"--xla_force_host_platform_device_count={count}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


# XLA:CPU flags the commands set unless XLA_FLAGS names them already;
# accelerators ignore them. XNNPACK: convolutions and matmuls through XNNPACK
# train the default detector about 1.6x faster on a CPU than XLA's own
# emitters, with the same losses.
XNNPACK_FLAGS = {"xla_cpu_use_xnnpack": "true"}
# For commands that run programs on a CPU mesh (fake devices, or several per
# process): XLA:CPU's concurrency-optimised scheduler lets its devices meet
# their collectives in different orders, and a 2x2x2 step with a scanned ViT
# deadlocked (6 devices waiting in an all-reduce, 2 in an all-gather inside
# the scan's loop; at the first step with one busy process beside it). The
# other schedule is one order for every device (200 steps under the same
# load). `detector.plan` only compiles: it keeps the default schedule, whose
# memory figures its tables give.
ORDERED_COLLECTIVE_FLAGS = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def use_cpu_xla_flags(runs_programs: bool = True) -> None:
    """Adds XNNPACK_FLAGS, and ORDERED_COLLECTIVE_FLAGS if `runs_programs`, to XLA_FLAGS (before JAX starts).

    A flag already named in XLA_FLAGS keeps its value.
    """
    wanted = {**XNNPACK_FLAGS, **(ORDERED_COLLECTIVE_FLAGS if runs_programs else {})}
    xla_flags = os.environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in wanted.items() if name not in xla_flags]
    os.environ["XLA_FLAGS"] = " ".join([xla_flags, *added]).strip()


class _ProcessPrefix(pylogging.Filter):
    """Prefixes every log line with `[process I/N]` so interleaved multi-host logs stay readable."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        prefix = f"[process {jax.process_index()}/{jax.process_count()}] "
        if not str(record.msg).startswith(prefix):
            record.msg = prefix + str(record.msg)
        return True


def _from_orbax(record: pylogging.LogRecord) -> bool:
    """Whether an asyncio report is about Orbax's I/O: its task names Orbax's code, or its error came from there.

    A task's repr names the file of its coroutine; a gathering future's names
    none, so the traceback of the exception it holds is looked at too.
    """
    if "/orbax/" in record.getMessage():
        return True
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return any("/orbax/" in frame.filename for frame in frames)


class _QuietLibraries(pylogging.Filter):
    """Keeps the libraries' INFO chatter (one line per checkpoint file) out of the log."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if record.name == "asyncio" and _from_orbax(record):
            # "Task (or _GatheringFuture) exception was never retrieved" for an
            # Orbax write that failed beside the one the command reports: the
            # same failure again.
            return bool(flags.FLAGS["verbose"].value)
        if "/orbax/" not in record.pathname:
            return True
        if record.exc_info and not flags.FLAGS["verbose"].value:
            # Orbax logs a failed write from each of its threads with the
            # traceback; the command reports the failure itself, in one line.
            record.exc_info, record.exc_text = None, None
        return record.levelno >= pylogging.WARNING


def start(argv: Sequence[str], *, takes_arguments: bool = False) -> None:
    """What every command does first: reject stray arguments, join the other processes, set up logging.

    And, before anything compiles, point JAX at the compilation cache.
    """
    if len(argv) > 1 and not takes_arguments:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    # Before anything touches the devices: join the other processes (flags or a detected cluster).
    distributed.initialize(distributed.options_from_flags())
    set_up_logging()
    compilation_cache.use_compilation_cache(COMPILATION_CACHE_DIR.value)


def set_up_logging() -> None:
    """Process 0 tells the story at INFO; other processes log warnings only, prefixed `[process I/N]`.

    Call after joining the other processes (`sharding.distributed.initialize`).
    """
    handler = logging.get_absl_handler()
    handler.addFilter(_QuietLibraries())
    if jax.process_count() > 1:
        handler.addFilter(_ProcessPrefix())
    logging.set_verbosity(logging.INFO if jax.process_index() == 0 else logging.WARNING)


def _is_closed_loop_noise(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def install_exception_hooks() -> None:
    """Drops the tracebacks Orbax's I/O leaves behind, and keeps a Ctrl-C that Python could not raise.

    When a checkpoint read or write fails, Orbax closes its asyncio loop while
    the reads or writes of the other arrays are still on their way: their
    TensorStore callbacks raise "Event loop is closed" in background threads,
    and their coroutines' own errors are never awaited. Python prints each
    of those tracebacks after the command has handled the failure and said
    what it is. They say nothing more, so they are dropped; every other
    exception still prints.

    A Ctrl-C whose KeyboardInterrupt is raised inside a garbage-collector
    callback (JAX registers one) or a `__del__` is not raised in the main
    thread: Python prints it as "Exception ignored" and runs on, and the
    interrupt is lost. It is delivered again to the main thread, so that
    whatever handles SIGINT at that moment (the start-up's one-line error or
    the training loop's checkpoint-and-stop) sees it.
    """
    import _thread
    import threading

    previous_excepthook, previous_thread_hook, previous_unraisable = (
        sys.excepthook,
        threading.excepthook,
        sys.unraisablehook,
    )

    def excepthook(kind, value, value_traceback):
        if not _is_closed_loop_noise(value):
            previous_excepthook(kind, value, value_traceback)

    def thread_hook(args):
        if not _is_closed_loop_noise(args.exc_value):
            previous_thread_hook(args)

    def unraisable_hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread and a moment later: raised here, in the main
            # thread, it would land in this hook and be swallowed again.
            redeliver = threading.Timer(0.05, _thread.interrupt_main, args=(signal.SIGINT,))
            redeliver.daemon = True
            try:
                redeliver.start()
            except RuntimeError:  # the interpreter is shutting down: nothing left to interrupt
                pass
            return
        # Also the failed reads of the other arrays of a step that did not
        # restore: coroutines of Orbax's whose errors nobody awaited any more.
        code = getattr(unraisable.object, "cr_code", None)
        from_orbax = code is not None and "/orbax/" in code.co_filename
        if not (_is_closed_loop_noise(unraisable.exc_value) or from_orbax):
            previous_unraisable(unraisable)

    sys.excepthook, threading.excepthook, sys.unraisablehook = excepthook, thread_hook, unraisable_hook


def run(main: Callable[[list[str]], None], *, runs_programs: bool = True) -> None:
    """`absl.app.run(main)` with one-line errors for bad flags and for USER_ERRORS.

    `runs_programs`: False for a command that only compiles (see `use_cpu_xla_flags`).
    """
    use_cpu_xla_flags(runs_programs)
    install_exception_hooks()

    def guarded_main(argv: list[str]) -> None:
        try:
            main(argv)
        except distributed.PeerLost as e:
            if flags.FLAGS.verbose:
                raise
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            # sys.exit would run JAX's exit hook, which waits for the dead process and then aborts.
            os._exit(EXIT_ERROR)
        except USER_ERRORS as e:
            if flags.FLAGS.verbose:
                raise
            _fail(str(e), EXIT_ERROR)
        except KeyboardInterrupt as e:
            # Ctrl-C before the training loop watches for it (while starting or
            # compiling), or a second one that aborts the preemption checkpoint.
            if flags.FLAGS.verbose:
                raise
            reason = str(e) or "Ctrl-C while starting"
            _fail(
                f"interrupted ({reason}); rerun the same command to resume from the newest checkpoint", EXIT_INTERRUPTED
            )

    app.run(guarded_main, flags_parser=_parse_flags)

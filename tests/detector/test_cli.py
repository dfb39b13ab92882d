"""`python -m detector.train` with bad input: one `error:` line naming the cause, no traceback.

Each case is a real subprocess (importing TensorFlow and JAX takes seconds),
so the cases of a tier start at once from one fixture and the tests read the results.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO_ROOT, quick_xla_flags
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import as_flags, make_config

TIMEOUT_S = 300


def _cases(tmp: pathlib.Path) -> dict[str, dict]:
    """name -> command-line arguments, expected exit code, patterns the error line must match."""
    empty_dir = tmp / "empty_data_dir"
    empty_dir.mkdir()
    missing_parent = tmp / "no_such_parent" / "data"
    return {
        "wrong_mesh": dict(
            args=["--config.mesh.data=3"],
            code=1,
            patterns=[r"mesh \(data=3, fsdp=1, model=1\) needs 3 devices but 8 are available", r"product is 8"],
        ),
        "indivisible_batch": dict(
            args=["--config.global_batch_size=12"],
            code=1,
            patterns=[r"global_batch_size=12 does not divide", r"multiple of 8"],
        ),
        "unknown_config_key": dict(
            args=["--config.no_such_key=1"],
            code=2,
            patterns=[r"--config\.no_such_key\b", r"(?i)unknown|does not exist|no such key|not a (known|valid)"],
        ),
        "unknown_nested_config_key": dict(
            args=["--config.model.no_such_key=1"],
            code=2,
            patterns=[r"--config\.model\.no_such_key\b", r"(?i)unknown|does not exist|no such key|not a (known|valid)"],
        ),
        "coco_not_prepared": dict(
            args=["--config.dataset.name=coco/2017", f"--config.dataset.data_dir={empty_dir}"],
            code=1,
            patterns=[re.escape(f"cannot read split 'train' of coco/2017 from {empty_dir}"), r"tfds build coco/2017"],
        ),
        "coco_json_without_paths": dict(
            args=["--config.dataset.name=coco_json", f"--config.dataset.data_dir={empty_dir}"],
            code=1,
            patterns=[
                r"dataset coco_json needs dataset\.train_json and dataset\.train_images",
                r"--config\.dataset\.train_json=PATH",
            ],
        ),
        "coco_json_missing_file": dict(
            args=[
                "--config.dataset.name=coco_json",
                f"--config.dataset.data_dir={empty_dir}",
                f"--config.dataset.train_json={tmp}/nope.json",
                f"--config.dataset.train_images={tmp}",
                f"--config.dataset.eval_json={tmp}/nope.json",
                f"--config.dataset.eval_images={tmp}",
            ],
            code=1,
            patterns=[re.escape(f"{tmp}/nope.json"), r"does not exist", r"--config\.dataset\.train_json"],
        ),
        "partial_distributed_flags": dict(
            args=["--num_processes=2"],
            code=1,
            patterns=[r"--coordinator_address, --num_processes and --process_id go together"],
        ),
        "data_dir_parent_missing": dict(
            args=[f"--config.dataset.data_dir={missing_parent}"],
            code=1,
            patterns=[re.escape(f"parent directory {missing_parent.parent} does not exist")],
        ),
        "config_file_missing": dict(
            args=[],
            config="configs/no_such_config.py",
            code=2,
            patterns=[r"no_such_config\.py", r"(?i)no such file|not found|does not exist|cannot (load|open|read)"],
        ),
        "bad_input_option": dict(
            args=["--config.input.scale_jitter=(2.0,1.0)"],
            code=1,
            patterns=[re.escape("input.scale_jitter must be 0 < min <= max, got (2.0, 1.0)")],
        ),
        # --verbose: the same bad mesh, now with the traceback (checked separately).
        "verbose_wrong_mesh": dict(args=["--verbose", "--config.mesh.data=3"], code=1, patterns=[]),
    }


CASE_NAMES = [
    "wrong_mesh",
    "indivisible_batch",
    "unknown_config_key",
    "unknown_nested_config_key",
    "coco_not_prepared",
    "coco_json_without_paths",
    "coco_json_missing_file",
    "partial_distributed_flags",
    "data_dir_parent_missing",
    "config_file_missing",
    "bad_input_option",
]


# The fast tier starts these 4 processes; the other cases start together in the slow tier
# (each process imports TensorFlow and JAX: 12 at once took a minute of 2 cores).
FAST_CASES = ("wrong_mesh", "unknown_config_key", "bad_input_option", "verbose_wrong_mesh")


def _run_cases(tmp_path_factory, names) -> dict[str, dict]:
    """Starts `detector.train` for each named case at once; {name: case, returncode, stdout, stderr, data_dir}."""
    tmp = tmp_path_factory.mktemp("cli")
    data_dir = tmp / "data"
    data_dir.mkdir()
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=quick_xla_flags(devices=8),
        JAX_PLATFORMS="cpu",
        DETECTOR_DATA_DIR=str(data_dir),
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
    )
    cases = _cases(tmp)
    assert sorted(cases) == sorted(CASE_NAMES + ["verbose_wrong_mesh"])
    processes = {}
    for name in names:
        case = cases[name]
        command = [
            sys.executable,
            "-m",
            "detector.train",
            f"--config={case.get('config', 'configs/default.py')}",
            f"--workdir={tmp / 'workdirs' / name}",
            *case["args"],
        ]
        processes[name] = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    deadline = time.monotonic() + TIMEOUT_S
    for name, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            stderr += f"\n(killed after {TIMEOUT_S}s)"
        results[name] = dict(
            case=cases[name], returncode=process.returncode, stdout=stdout, stderr=stderr, data_dir=data_dir
        )
    return results


@pytest.fixture(scope="module")
def fast_cli_results(tmp_path_factory):
    return _run_cases(tmp_path_factory, FAST_CASES)


@pytest.fixture(scope="module")
def slow_cli_results(tmp_path_factory):
    return _run_cases(tmp_path_factory, [name for name in CASE_NAMES if name not in FAST_CASES])


def _in_tier(names):
    return [name if name in FAST_CASES else pytest.param(name, marks=pytest.mark.slow) for name in names]


def cli_results(request, name: str) -> dict:
    return request.getfixturevalue("fast_cli_results" if name in FAST_CASES else "slow_cli_results")[name]


@pytest.mark.parametrize("name", _in_tier(CASE_NAMES))
def test_bad_input_fails_with_one_error_line(request, name):
    result = cli_results(request, name)
    stderr = result["stderr"]
    assert result["returncode"] != 0, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert last.startswith("error: "), stderr
    for pattern in result["case"]["patterns"]:
        assert re.search(pattern, last), f"{pattern!r} not in {last!r}"
    assert result["returncode"] == result["case"]["code"], stderr


# One case of each group: all the cases of a group share its data directory.
@pytest.mark.parametrize("name", _in_tier(["bad_input_option", "coco_not_prepared"]))
def test_bad_options_fail_before_any_data_is_read(request, name):
    """Every case stops before preparing the embedded dataset: a bad option costs seconds, not a conversion."""
    data_dir = cli_results(request, name)["data_dir"]
    assert data_dir.is_dir() and not any(data_dir.iterdir()), sorted(p.name for p in data_dir.iterdir())


def test_verbose_shows_the_traceback(request):
    result = cli_results(request, "verbose_wrong_mesh")
    assert result["returncode"] != 0
    assert "Traceback (most recent call last)" in result["stderr"]
    assert re.search(r"MeshError: mesh \(data=3, fsdp=1, model=1\) needs 3 devices", result["stderr"]), result["stderr"]


# Python as a terminal's foreground command starts: Ctrl-C raises KeyboardInterrupt. An ignored SIGINT is
# inherited across exec and Python then installs no handler, and a test process may have been left ignoring
# it, so the children set it themselves (a preexec_fn would run Python in a fork of a multithreaded process).
DEFAULT_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


@pytest.mark.slow
def test_ctrl_c_while_starting_is_one_error_line(tmp_path, tmp_path_factory):
    """A real SIGINT once the command has started (before the training loop's handlers): no traceback."""
    import input_pipeline

    # The integration tests' tiny dataset (generated once per run), so the signal lands in preparing or compiling.
    data_dir = once_per_run(tmp_path_factory, "data", lambda path: input_pipeline.get_dataset_info(make_config(path)))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    train = f"{DEFAULT_SIGINT}; import runpy; runpy.run_module('detector.train', run_name='__main__', alter_sys=True)"
    command = [sys.executable, "-c", train, "--config=configs/default.py", f"--workdir={tmp_path / 'run'}"]
    process = subprocess.Popen(
        command + as_flags(data_dir),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "compilation cache" in line:  # cli.start() has run; the dataset and compiling come next
            process.send_signal(signal.SIGINT)
            break
    lines += process.stdout.readlines()
    assert process.wait(timeout=TIMEOUT_S) == 130, "".join(lines[-30:])
    output = "".join(lines)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert [line for line in lines if line.strip()][-1].startswith(
        "error: interrupted (Ctrl-C while starting); rerun the same command"
    ), output[-3000:]


def test_asyncio_reports_of_orbax_writes_that_failed_beside_the_reported_one_are_dropped():
    """After a failed checkpoint write, asyncio logs each Orbax write task whose exception nobody awaited."""
    import logging

    from absl import flags

    from detector import cli

    def record(name, message, exc_info=None):
        return logging.LogRecord(name, logging.ERROR, "/x/asyncio/base_events.py", 1, message, None, exc_info)

    def raised_in(filename):
        namespace = {}
        exec(
            compile("def write_fragment():\n    raise ValueError('RESOURCE_EXHAUSTED')\n", filename, "exec"), namespace
        )
        try:
            namespace["write_fragment"]()
        except ValueError as error:
            return (ValueError, error, error.__traceback__)

    orbax_task = (
        "Task exception was never retrieved\nfuture: <Task finished coro=<write_fragment() done, defined at "
        "/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py:188>>"
    )
    quiet = cli._QuietLibraries()
    assert not quiet.filter(record("asyncio", orbax_task))
    assert quiet.filter(record("asyncio", "Task exception was never retrieved\nfuture: <Task ... /mine/app.py>"))
    assert quiet.filter(record("detector", orbax_task))  # only asyncio's reports
    # A gathering future's repr names no file: the traceback of its error does.
    gathering = "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished exception=...>"
    orbax_error = raised_in("/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
    assert not quiet.filter(record("asyncio", gathering, orbax_error))
    assert quiet.filter(record("asyncio", gathering, raised_in("/mine/app.py")))
    assert quiet.filter(record("asyncio", gathering))
    flags.FLAGS["verbose"].value = True
    try:
        assert quiet.filter(record("asyncio", orbax_task))  # --verbose shows everything
    finally:
        flags.FLAGS["verbose"].value = False


def test_a_ctrl_c_raised_inside_a_garbage_collector_callback_reaches_the_main_thread():
    """Python swallows (prints and ignores) exceptions of gc callbacks, and JAX registers one.

    A KeyboardInterrupt that lands there must not be lost: the run would go on
    as if Ctrl-C had never been pressed.
    """
    script = f"""
{DEFAULT_SIGINT}
import gc, time
from detector import cli
cli.install_exception_hooks()

def interrupted_callback(phase, info):
    gc.callbacks.remove(interrupted_callback)
    raise KeyboardInterrupt

gc.callbacks.append(interrupted_callback)
try:
    gc.collect()
    for _ in range(3000):  # up to 30 s on a loaded machine; delivery ends it at once
        time.sleep(0.01)
    print("lost")
except KeyboardInterrupt:
    print("delivered")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.stdout.split() == ["delivered"], result.stdout + result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "before, runs_programs, after",
    [
        ("", True, "--xla_cpu_use_xnnpack=true --xla_cpu_enable_concurrency_optimized_scheduler=false"),
        ("", False, "--xla_cpu_use_xnnpack=true"),
        (
            "--xla_cpu_use_xnnpack=false --xla_dump_to=/d",
            True,
            "--xla_cpu_use_xnnpack=false --xla_dump_to=/d --xla_cpu_enable_concurrency_optimized_scheduler=false",
        ),
        (
            "--xla_cpu_enable_concurrency_optimized_scheduler=true",
            True,
            "--xla_cpu_enable_concurrency_optimized_scheduler=true --xla_cpu_use_xnnpack=true",
        ),
    ],
    ids=["unset", "compile_only", "xnnpack_given", "scheduler_given"],
)
def test_cpu_xla_flags_are_added_unless_given(monkeypatch, before, runs_programs, after):
    from detector import cli

    monkeypatch.setenv("XLA_FLAGS", before)
    cli.use_cpu_xla_flags(runs_programs)
    assert os.environ["XLA_FLAGS"] == after

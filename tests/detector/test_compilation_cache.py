"""The persistent compilation cache: where it goes by default, turning it off, surviving a bad directory, reuse.

The end-to-end tests run `python -m detector.train` twice as real processes,
the way a relaunch after preemption does, with HOME pointed at a temporary
directory so that the default location can be looked at.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import pytest

from detector import cli
from detector.compilation_cache import MIN_COMPILE_TIME_SECS, default_directory, use_compilation_cache
from tests.helpers import REPO_ROOT
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import as_flags, make_config

CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
DEFAULT_UNDER_HOME = (".cache", "detector", "jax_compilation_cache")


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"JAX_COMPILATION_CACHE_DIR": "/jax", "XDG_CACHE_HOME": "/xdg", "HOME": "/home"}, "/jax"),
        ({"JAX_COMPILATION_CACHE_DIR": "", "XDG_CACHE_HOME": "/xdg", "HOME": "/home"}, ""),
        ({"XDG_CACHE_HOME": "/xdg", "HOME": "/home"}, "/xdg/detector/jax_compilation_cache"),
        ({"XDG_CACHE_HOME": "", "HOME": "/home"}, "/home/.cache/detector/jax_compilation_cache"),
        ({"XDG_CACHE_HOME": "relative", "HOME": "/home"}, "/home/.cache/detector/jax_compilation_cache"),
        ({"HOME": "/home"}, "/home/.cache/detector/jax_compilation_cache"),
    ],
    ids=["jax_variable_wins", "empty_jax_variable_is_off", "xdg", "empty_xdg", "relative_xdg", "home"],
)
def test_default_directory(environ, expected):
    assert default_directory(environ) == expected


def test_the_test_session_leaves_the_users_cache_alone():
    assert cli.COMPILATION_CACHE_DIR.default == os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture
def jax_cache_options(monkeypatch):
    """Restores JAX's cache options afterwards, and starts without JAX's minimum-compile-time variable."""
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_local_directory_is_created_and_used(jax_cache_options, tmp_path, caplog):
    directory = tmp_path / "not" / "yet" / "there"
    with caplog.at_level(logging.INFO):
        assert use_compilation_cache(str(directory)) == str(directory)
    assert list(directory.iterdir()) == []  # created, and the write check left nothing behind
    assert jax.config.jax_compilation_cache_dir == str(directory)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == MIN_COMPILE_TIME_SECS
    assert any(str(directory) in m for m in _messages(caplog, logging.INFO))
    assert _messages(caplog, logging.WARNING) == []


def test_jax_minimum_compile_time_variable_wins(jax_cache_options, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    use_compilation_cache(str(tmp_path))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0


def test_empty_turns_the_cache_off(jax_cache_options, caplog):
    jax.config.update("jax_compilation_cache_dir", "/somewhere/else")
    with caplog.at_level(logging.INFO):
        assert use_compilation_cache("") is None
    assert jax.config.jax_compilation_cache_dir is None
    assert "compilation cache off" in _messages(caplog, logging.INFO)


def test_a_remote_directory_is_left_to_jax(jax_cache_options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert use_compilation_cache("gs://bucket/cache") == "gs://bucket/cache"
    assert jax.config.jax_compilation_cache_dir == "gs://bucket/cache"
    assert list(tmp_path.iterdir()) == []  # nothing created locally


@pytest.mark.parametrize(
    "where, reason",
    [("under_a_file", "Not a directory"), ("is_a_file", "File exists")],
)
def test_a_directory_that_cannot_be_created_warns_once_and_turns_the_cache_off(
    jax_cache_options, tmp_path, caplog, where, reason
):
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("not a directory")
    directory = in_the_way / "cache" if where == "under_a_file" else in_the_way
    with caplog.at_level(logging.INFO):
        assert use_compilation_cache(str(directory)) is None
    assert jax.config.jax_compilation_cache_dir is None
    [warning] = _messages(caplog, logging.WARNING)
    assert str(directory) in warning and reason in warning and "--compilation_cache_dir=" in warning
    assert in_the_way.read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only directory")
def test_a_read_only_directory_warns_once_and_turns_the_cache_off(jax_cache_options, tmp_path, caplog):
    directory = tmp_path / "read_only"
    directory.mkdir(mode=0o555)
    with caplog.at_level(logging.INFO):
        assert use_compilation_cache(str(directory)) is None
    [warning] = _messages(caplog, logging.WARNING)
    assert str(directory) in warning and "Permission denied" in warning


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    import input_pipeline

    # Same name and contents as the integration tests' dataset: xdist workers share one.
    return once_per_run(tmp_path_factory, "data", lambda path: input_pipeline.get_dataset_info(make_config(path)))


@pytest.fixture(scope="module")
def matplotlib_dir(tmp_path_factory):
    # One font cache for all the runs here, instead of one per temporary HOME.
    return tmp_path_factory.mktemp("matplotlib")


def command_env(home, matplotlib_dir) -> dict[str, str]:
    """This process's environment for a command on 1 CPU device with HOME=`home` and no cache variable."""
    xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return {
        **{k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")},
        "HOME": str(home),
        "MPLCONFIGDIR": str(matplotlib_dir),
        "PYTHONPATH": str(REPO_ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(xla_flags + ["--xla_force_host_platform_device_count=1"]),
        # Every program is written, however fast it compiled, so that the
        # second run's hits do not depend on how long the first run's compiles took.
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def run(arguments: list[str], home, matplotlib_dir) -> subprocess.CompletedProcess:
    """`python -m ARGUMENTS` on 1 CPU device with HOME=`home`; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", *arguments],
        cwd=REPO_ROOT,
        env=command_env(home, matplotlib_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def train(data_dir, workdir, home, matplotlib_dir, *flags: str) -> str:
    """Runs a 1-step training; returns its log."""
    steps = dict(total_steps=1, checkpoint_every_steps=1, log_every_steps=1, eval_every_steps=1)
    command = ["detector.train", "--config=configs/default.py", f"--workdir={workdir}"]
    log = run(command + as_flags(data_dir, **steps) + list(flags), home, matplotlib_dir).stderr
    assert "compiled train and predict steps in" in log, log[-4000:]
    return log


def entries(directory):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.mark.slow
def test_a_second_run_loads_every_program_the_first_one_compiled(data_dir, matplotlib_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    cache = home.joinpath(*DEFAULT_UNDER_HOME)
    log = train(data_dir, tmp_path / "first", home, matplotlib_dir)  # the default location
    assert f"compilation cache: {cache}" in log
    written = entries(cache)
    assert any(name.startswith("jit_train_step-") for name in written), sorted(written)

    other_home = tmp_path / "other_home"
    other_home.mkdir()
    log = train(data_dir, tmp_path / "second", other_home, matplotlib_dir, f"--compilation_cache_dir={cache}")
    assert f"compilation cache: {cache}" in log
    assert entries(cache) == written  # every program loaded; none compiled and written again
    assert not other_home.joinpath(".cache", "detector").exists()


@pytest.mark.slow
def test_an_empty_compilation_cache_dir_writes_no_cache(data_dir, matplotlib_dir, tmp_path):
    # The flag is every command's (`detector.cli.start`): the plan compiles the train step, nothing else.
    home = tmp_path / "home"
    home.mkdir()
    plan = ["detector.plan", "--config=configs/default.py", "--devices=1"]
    result = run(plan + as_flags(data_dir) + ["--compilation_cache_dir="], home, matplotlib_dir)
    assert "| (1, 1, 1) |" in result.stdout, result.stdout  # a train step was compiled
    assert "compilation cache off" in result.stderr
    assert not home.joinpath(".cache", "detector").exists()

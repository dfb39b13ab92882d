"""Test setup: 8 fake CPU devices, configured before jax is imported."""

import os

from tests.helpers import quick_xla_flags  # imports no jax

# Quick XLA:CPU compiles (why: tests/helpers/__init__.py) on 8 fake devices.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {quick_xla_flags(devices=8)}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# TensorFlow is only the input pipeline here; keep it quiet and off any GPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import jax  # noqa: E402  (must come after the environment above)
import pytest  # noqa: E402

assert jax.device_count() == 8, (
    "tests need 8 fake CPU devices; jax was imported before tests/conftest.py "
    f"set XLA_FLAGS (found {jax.device_count()} devices)"
)
# Commands the tests run as subprocesses keep the compilation cache off, away
# from the user's ~/.cache, unless a test gives them one (the suite's, below):
# an empty JAX_COMPILATION_CACHE_DIR is --compilation_cache_dir's "off". Set
# after importing jax, which has read its environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")


# Scheduling is xdist's own (--dist loadfile: modules handed out by their
# number of tests, most first), so the short unit-test modules run beside the
# end-to-end ones. Handing out the longest modules first, measured on two
# cores, ran the multi-process ones side by side and made the suite slower
# (28:56, against 25:20 in xdist's order with four minutes more of tests), as
# their processes then compete for both cores.


_CACHE_OPTIONS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": 0}


def _use_suite_cache(directory: str) -> None:
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", directory)
    for name, value in _CACHE_OPTIONS.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX sets its cache up once per process: make it see this one.


@pytest.fixture(scope="session")
def suite_compilation_cache(tmp_path_factory) -> str:
    """One persistent compilation cache for the whole run, in its temporary directory, shared by the xdist
    workers: a program compiled once (the tiny models' steps recur across modules) is loaded after that.

    Each entry is keyed by the program, the devices and XLA_FLAGS, so a
    cached program is the one a compile would produce. Per run, never the
    user's: a test measures nothing that an earlier run left.
    """
    run_directory = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        run_directory = run_directory.parent  # the run's, above every worker's own
    directory = run_directory / "suite_compilation_cache"
    directory.mkdir(exist_ok=True)
    return str(directory)


@pytest.fixture(autouse=True)
def _compilation_cache(suite_compilation_cache):
    """Every test compiles through the suite's cache; one that points JAX elsewhere (a command run in-process,
    a test of the cache itself) gets it back afterwards."""
    if jax.config.jax_compilation_cache_dir != suite_compilation_cache:
        _use_suite_cache(suite_compilation_cache)
    yield
    if jax.config.jax_compilation_cache_dir != suite_compilation_cache or any(
        getattr(jax.config, name) != value for name, value in _CACHE_OPTIONS.items()
    ):
        _use_suite_cache(suite_compilation_cache)

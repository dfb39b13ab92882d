"""Test setup: 8 fake CPU devices, configured before jax is imported."""

import os

import pytest

from tests.helpers import quick_xla_flags  # imports no jax

# Quick XLA:CPU compiles (why: tests/helpers/__init__.py) on 8 fake devices.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {quick_xla_flags(devices=8)}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# TensorFlow is only the input pipeline here; keep it quiet and off any GPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import jax  # noqa: E402  (must come after the environment above)

assert jax.device_count() == 8, (
    "tests need 8 fake CPU devices; jax was imported before tests/conftest.py "
    f"set XLA_FLAGS (found {jax.device_count()} devices)"
)
# Commands the tests run (in-process or as subprocesses) keep the compilation
# cache off, away from the user's ~/.cache, unless a test gives them one: an
# empty JAX_COMPILATION_CACHE_DIR is --compilation_cache_dir's "off". Set after
# importing jax, which has read its environment and stays without a cache here.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")


# Scheduling is xdist's own (--dist loadfile: modules handed out by their
# number of tests, most first), so the short unit-test modules run beside the
# end-to-end ones. Handing out the longest modules first, measured on two
# cores, ran the multi-process ones side by side and made the suite slower
# (28:56, against 25:20 in xdist's order with four minutes more of tests), as
# their processes then compete for both cores.


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A crashed xdist worker ends the run, naming the test it was running, unless --max-worker-restart says otherwise.

    xdist's own default (restart up to 4 x workers) replaces the worker, and
    with --dist loadfile the replacement can wait for work forever
    (pytest-xdist 3.8): the suite would hang until CI's time runs out instead
    of saying which test took its process down.
    """
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"

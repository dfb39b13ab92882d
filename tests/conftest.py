"""Test setup: 8 fake CPU devices, configured before jax is imported."""

import os

# XNNPACK kernels make XLA:CPU convolutions ~1.6x faster (the CLIs turn it on too).
# The suite compiles far more than it runs: skipping LLVM's optimisation of the
# generated CPU code takes a third off its time. What XLA computes (HLO
# passes, partitioning, buffer assignment, so the memory figures) is unchanged.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=true --xla_backend_optimization_level=0"
).strip()
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


# Modules that start real processes or compile many programs, by their
# measured time on two cores, longest first (paths under tests/). Handed out
# first and in this order, the two xdist workers (--dist loadfile) finish
# together: longest-first scheduling, with the many short modules after them
# filling the gaps, instead of one worker still running a long module that
# started last.
SLOW_MODULES = (
    "integration/test_fault_tolerance.py",
    "benchmarks/test_benchmarks.py",
    "integration/test_recipe_parts.py",
    "integration/test_model_parallel.py",
    "integration/test_sharded_equivalence.py",
    "integration/test_train.py",
    "integration/test_dino.py",
    "integration/test_damaged_checkpoint.py",
    "detector/test_compilation_cache.py",
    "integration/test_workdir_mismatch.py",
)
TESTS_ROOT = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    # xdist would otherwise re-sort the modules by their number of tests, most
    # first, which puts the long end-to-end modules (a few tests each) last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item):
        module = os.path.relpath(str(item.path), TESTS_ROOT).replace(os.sep, "/")
        return SLOW_MODULES.index(module) if module in SLOW_MODULES else len(SLOW_MODULES)

    items.sort(key=rank)  # stable: the order within each module and among the rest is kept

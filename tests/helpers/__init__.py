"""Helpers shared by the test modules (importable before jax: tests/conftest.py uses them to configure it)."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# XNNPACK kernels make XLA:CPU convolutions ~1.6x faster (the CLIs turn it on
# too). The suite compiles far more than it runs: skipping LLVM's
# optimisation of the generated CPU code takes a third off its time. What XLA
# computes (HLO passes, partitioning, buffer assignment, so the memory
# figures) is unchanged. (XLA:CPU's classic fusion emitter,
# --xla_cpu_use_fusion_emitters=false, halves a tiny DINO's compile but left
# the full suite's time where it was, deadlocked a 2x2x2 LoRA ViT's
# collective-permutes under the concurrency-optimised scheduler, and without
# that scheduler changed exact results and compiled memory: not used.)
#
# XLA:CPU aborts the process (no Python exception, its message lost to
# pytest's capture) when a collective's devices have not all arrived within
# a timeout. With 8 fake devices' threads and the suite's other processes on
# two cores, a 2x2x2 step's rendezvous can be starved that long: a worker
# aborted mid-suite in a test that passes alone. The timeouts are raised
# far past anything a test needs; a real deadlock still ends there.
COLLECTIVE_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=1200 "
    "--xla_cpu_collective_timeout_seconds=1200"
)
QUICK_COMPILE_FLAGS = f"--xla_cpu_use_xnnpack=true --xla_backend_optimization_level=0 {COLLECTIVE_TIMEOUT_FLAGS}"


def quick_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process the tests start: quick compiles and, given `devices`, that many fake CPU devices."""
    if devices is None:
        return QUICK_COMPILE_FLAGS
    return f"{QUICK_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"

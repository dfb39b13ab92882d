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
# collective-permutes under the concurrency-optimised scheduler: not used.)
#
# What the commands run with on CPU (why: detector.cli.use_cpu_xla_flags):
# every device meets its collectives in one order. Under the concurrency-
# optimised scheduler a 2x2x2 step with a scanned ViT deadlocked about once
# in ten suite runs (6 devices in an all-reduce, 2 in an all-gather inside
# the scan's loop), and at its first step with one busy process beside it.
CPU_COLLECTIVE_ORDER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# XLA:CPU aborts the process (no Python exception, its message lost to
# pytest's capture) when a collective's devices have not all arrived within
# a timeout; with 8 fake devices' threads and the suite's other processes on
# two cores, a rendezvous can be starved for long. The timeouts are raised
# far past anything a test needs; a real deadlock still ends there.
COLLECTIVE_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=1200 "
    "--xla_cpu_collective_timeout_seconds=1200"
)
QUICK_COMPILE_FLAGS = (
    f"--xla_cpu_use_xnnpack=true --xla_backend_optimization_level=0 {CPU_COLLECTIVE_ORDER_FLAG} "
    f"{COLLECTIVE_TIMEOUT_FLAGS}"
)


def quick_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process the tests start: quick compiles and, given `devices`, that many fake CPU devices."""
    if devices is None:
        return QUICK_COMPILE_FLAGS
    return f"{QUICK_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"

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
QUICK_COMPILE_FLAGS = "--xla_cpu_use_xnnpack=true --xla_backend_optimization_level=0"


def quick_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process the tests start: quick compiles and, given `devices`, that many fake CPU devices."""
    if devices is None:
        return QUICK_COMPILE_FLAGS
    return f"{QUICK_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"

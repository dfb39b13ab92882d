"""Helpers shared by the test modules (importable before jax: tests/conftest.py uses them to configure it)."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# XNNPACK kernels make XLA:CPU convolutions ~1.6x faster (the CLIs turn it on
# too). The suite compiles far more than it runs: skipping LLVM's
# optimisation of the generated CPU code takes a third off its time, and
# emitting fusions through XLA:CPU's classic elemental emitter instead of its
# MLIR fusion emitters halves what is left (the tiny DINO's train step:
# 26 s -> 15 s; RetinaNet's: 9 s -> 4.6 s). With those fusions, XLA:CPU's
# concurrency-optimised scheduler let devices of a 2x2x2 mesh reach a LoRA
# ViT's collective-permutes in different orders and deadlock (jax 0.10); with
# that scheduler off they do not. What XLA computes (HLO passes,
# partitioning, buffer assignment, so the memory figures) is unchanged.
QUICK_COMPILE_FLAGS = (
    "--xla_cpu_use_xnnpack=true --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_enable_concurrency_optimized_scheduler=false"
)


def quick_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process the tests start: quick compiles and, given `devices`, that many fake CPU devices."""
    if devices is None:
        return QUICK_COMPILE_FLAGS
    return f"{QUICK_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"

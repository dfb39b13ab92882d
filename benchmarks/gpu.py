"""Single-GPU train-step throughput and MFU of the shipped detectors at the largest batch that fits.

  pip install -e ".[cuda12]"
  python -m benchmarks.gpu                       # on a machine with one (or more) NVIDIA GPUs
  python -m benchmarks.gpu --peak_tflops=989     # a GPU the peak table below does not know
  python -m benchmarks.gpu --smoke               # the same code on the CPU with tiny models (compiling
                                                 # 6 small steps: ~3 minutes on 2 cores): a check, not a number
  python -m benchmarks.gpu --models=dino         # only the models whose name contains one of these words

The models, all mixed precision (model.dtype=bfloat16, float32 parameters)
on one device (mesh data=1, fsdp=1, model=1), with the optimizer of their
shipped recipe:

  * RetinaNet ResNet-50-FPN (configs/retinanet_r50_coco.py) at 800x800 px;
  * ViTDet-B RetinaNet (configs/vitdet_b_coco.py) at 1024x1024 px;
  * DINO on DINOv3 ViTs at 1024x1024 px: ViT-L/16 fine-tuned in full
    (configs/dino_dinov3_l_coco.py) and the 7B frozen and with LoRA adapters
    (configs/dino_dinov3_7b_coco.py:frozen, :lora; the 7B's float32 weights
    alone are 27 GB, so full fine-tuning needs the sharded recipe, not one
    GPU). These keep their recipes' per-block remat, so their FLOPs include
    the recomputed forward pass of the blocks that train;
  * DINO-4scale ResNet-50 (configs/dino_r50_coco.py) at 800x800 px: 900
    queries, DINO's denoising budget of 100 positive-negative pairs per
    image (200 more query slots), matching on the device, with the recipe's
    lean step: recomputing attention softmax, gather deformable attention
    keeping only its inputs, ReLUs keeping sign bits, model.remat=none
    (per-layer remat buys the R50 DINO no memory: docs/performance.md).

For each, the per-device batch starts at --start_batch and doubles while the
compiled step fits: XLA's memory accounting of the step (per-device total)
must stay under the device's allocator limit, and running the step must not
fail with an out-of-memory error; --max_batch caps it (and is where the
search stops on a backend that reports no memory limit, such as the CPU).
Every fitting batch is timed (--steps steps after 2 warm-up steps); the
table reports the largest, the JSON keeps them all.

Inputs are random images with COCO's average of 7 boxes, already on the
device: the input pipeline is not measured (benchmarks/input_pipeline.py
measures it).

MFU (model FLOPs utilisation) = FLOPs per step / step time / peak FLOP/s.
FLOPs per step come from XLA's cost analysis of the compiled step
(`compiled.cost_analysis()`: forward, backward and optimizer, a multiply-add
counted as 2); with model.remat=none, as here, nothing is recomputed, so
these are the model's FLOPs. Peak is the device's dense bf16 tensor-core
figure from the table PEAK_BF16_FLOPS (no sparsity), looked up by
`jax.devices()[0].device_kind`; --peak_tflops overrides it. For a device
the table does not know MFU is reported as n/a.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from typing import Any

from absl import app, flags, logging

from benchmarks import report

WARMUP_STEPS = 2
SMOKE_MAX_BATCH = 4
SMOKE_STEPS = 2
SMOKE_IMAGE_SIZE = 64  # one 4x4-patch window for vitdet_tiny; P3-P5 of 8, 4 and 2 cells
SMOKE_PEAK_FLOPS = 1e12  # nominal, so the smoke run's MFU column is a number

# Dense (no sparsity) bf16 peak FLOP/s per device, matched in order against a
# substring of `device_kind` (case-insensitive): the more specific name comes
# first ("H100 PCIe" before "H100", "L40S" before "L4", "v5 lite" before "v5").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM; "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),  # also GH200
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),  # approximate: NVIDIA quotes 70 (dense) for the A10G in AWS g5
    ("V100", 125e12),  # fp16: the V100 has no bf16 tensor cores
    ("RTX 4090", 165e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e's device_kind
    ("v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p's device_kind
)


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device of this kind, or None when the table does not know it."""
    kind = device_kind.lower()
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in kind:
            return flops
    return None


def _model_configs(smoke: bool, only: list[str] | None = None) -> list[tuple[str, Any]]:
    """(name, config) of the models measured; each config's global batch is set per try.

    `only`: words, any of which a model's name must contain (case-insensitive); None or empty: every model.
    """
    from configs import (
        default,
        dino_dinov3_7b_coco,
        dino_dinov3_l_coco,
        dino_dinov3_tiny,
        dino_r50_coco,
        dino_tiny,
        retinanet_r50_coco,
        vitdet_b_coco,
        vitdet_tiny,
    )

    if smoke:
        small_dino = dino_tiny.get_config()
        small_dino.model.dino.num_queries = 32  # 64 px gives 85 encoder proposals
        models = [
            ("RetinaNet tiny ResNet (default.py)", default.get_config(), SMOKE_IMAGE_SIZE),
            ("ViTDet tiny (vitdet_tiny.py)", vitdet_tiny.get_config(), SMOKE_IMAGE_SIZE),
            ("DINO tiny (dino_tiny.py)", small_dino, SMOKE_IMAGE_SIZE),
            ("DINO tiny DINOv3-style LoRA (dino_dinov3_tiny.py:lora)", dino_dinov3_tiny.get_config("lora"), 64),
        ]
    else:
        models = [
            ("RetinaNet R50-FPN", retinanet_r50_coco.get_config(), 800),
            ("ViTDet-B", vitdet_b_coco.get_config(), 1024),
            ("DINO-4scale R50", dino_r50_coco.get_config(), 800),
            ("DINO DINOv3-L/16 full", dino_dinov3_l_coco.get_config(), 1024),
            ("DINO DINOv3-7B/16 frozen", dino_dinov3_7b_coco.get_config("frozen"), 1024),
            ("DINO DINOv3-7B/16 LoRA", dino_dinov3_7b_coco.get_config("lora"), 1024),
        ]
    if only:
        wanted = [word.lower() for word in only]
        kept = [model for model in models if any(word in model[0].lower() for word in wanted)]
        if not kept:
            raise ValueError(
                f"--models={','.join(only)} matches none of: {'; '.join(model[0] for model in models)}; "
                "give a word of one of these names, e.g. --models=dino"
            )
        models = kept
    named = []
    for name, config, image_size in models:
        config.input.image_size = (image_size, image_size)
        config.model.dtype = "bfloat16"
        config.mesh.update(dict(data=1, fsdp=1, model=1))
        named.append((name, config))
    return named


def _is_out_of_memory(error: Exception) -> bool:
    message = str(error)
    return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


def _free_device_memory() -> None:
    # The step just dropped holds the train state, the batch and the
    # executable; collect them now, not whenever Python gets to it, so the
    # next (twice as large) step does not find the device half full.
    gc.collect()
    import jax

    jax.clear_caches()


def measure(
    config, batch_size: int, device, memory_limit: int | None, steps: int, num_classes: int
) -> dict[str, Any] | None:
    """Compiles and times `config`'s step at a per-device batch of `batch_size` on `device`.

    Returns seconds per step, FLOPs per step and per-device bytes, or None when
    the step does not fit: XLA's accounting says it needs more than
    `memory_limit` bytes, or allocating or running it runs out of memory.
    """
    import jax

    from benchmarks import jax_step

    config.global_batch_size = batch_size
    # The step lives in this frame only: the caller frees its device memory
    # once the frame, and any out-of-memory traceback holding it, are gone.
    try:
        step = jax_step.build(config, num_classes, devices=[device])
        if memory_limit is not None and step.plan.total_bytes > memory_limit:
            logging.info(
                "batch %d: the step needs %.2f GiB, the device has %.2f GiB",
                batch_size,
                step.plan.total_bytes / 2**30,
                memory_limit / 2**30,
            )
            return None
        step.run(WARMUP_STEPS)
        seconds_per_step = step.run(steps)
        return {
            "batch": batch_size,
            "seconds_per_step": seconds_per_step,
            "flops_per_step": step.plan.flops,
            "per_device_bytes": step.plan.total_bytes,
            "compile_seconds": step.plan.compile_seconds,
        }
    except jax.errors.JaxRuntimeError as e:
        if not _is_out_of_memory(e):
            raise
        logging.info("batch %d: out of memory (%s)", batch_size, str(e).splitlines()[0])
        return None


def largest_fitting_batch(
    name: str, config, device, memory_limit: int | None, start_batch: int, max_batch: int, steps: int, num_classes: int
) -> list[dict[str, Any]]:
    """Measures per-device batches start_batch, 2x, 4x, ... up to max_batch until one does not fit.

    Returns the measurements of the batches that fit, smallest first (empty
    when not even `start_batch` fits).
    """
    fitting = []
    batch_size = start_batch
    while batch_size <= max_batch:
        result = measure(config, batch_size, device, memory_limit, steps, num_classes)
        _free_device_memory()
        if result is None:
            break
        print(
            f"{name}: batch {batch_size}: {batch_size / result['seconds_per_step']:.2f} images/s, "
            f"{result['seconds_per_step'] * 1e3:.1f} ms/step, "
            f"{result['per_device_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
        fitting.append(result)
        batch_size *= 2
    return fitting


def main(argv: list[str]) -> None:
    del argv
    import jax

    smoke = _SMOKE.value
    if smoke:
        # Both before anything asks JAX for a device: no accelerator is touched,
        # and XLA:CPU generates code without LLVM's optimisations, which halves
        # the compiling that is most of a smoke run (its numbers mean nothing).
        jax.config.update("jax_platforms", "cpu")
        if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    elif jax.default_backend() != "gpu":
        sys.exit(
            f"error: benchmarks.gpu measures a GPU but JAX's backend here is {jax.default_backend()!r}; "
            "add --smoke for a quick CPU check of the benchmark, or run it on a GPU machine "
            '(pip install -e ".[cuda12]")'
        )
    from sharding import memory

    max_batch = SMOKE_MAX_BATCH if smoke and not flags.FLAGS["max_batch"].present else _MAX_BATCH.value
    steps = SMOKE_STEPS if smoke and not flags.FLAGS["steps"].present else _STEPS.value
    device = jax.local_devices()[0]
    memory_limit = memory.device_memory_limit_bytes(device)

    if _PEAK_TFLOPS.value is not None:
        peak, peak_source = _PEAK_TFLOPS.value * 1e12, "--peak_tflops"
    elif (peak := peak_flops(device.device_kind)) is not None:
        peak_source = f"table ({device.device_kind})"
    elif smoke:
        peak, peak_source = SMOKE_PEAK_FLOPS, "nominal (--smoke)"
    else:
        peak, peak_source = math.nan, "unknown"
        print(
            f"warning: no peak FLOP/s known for {device.device_kind!r}, so MFU is n/a; "
            "pass --peak_tflops=N (its dense bf16 TFLOP/s)",
            file=sys.stderr,
            flush=True,
        )

    try:
        models = _model_configs(smoke, _MODELS.value)
    except ValueError as error:
        sys.exit(f"error: {error}")
    rows, searches = [], {}
    for name, config in models:
        height, width = config.input.image_size
        fitting = largest_fitting_batch(
            name, config, device, memory_limit, _START_BATCH.value, max_batch, steps, _NUM_CLASSES.value
        )
        searches[name] = fitting
        image = f"{height}x{width}"
        if not fitting:
            print(f"{name}: not even batch {_START_BATCH.value} fits on {device.device_kind}", flush=True)
            rows.append((name, image, config.model.dtype, 0) + (math.nan,) * 6)
            continue
        best = fitting[-1]
        seconds = best["seconds_per_step"]
        achieved = best["flops_per_step"] / seconds
        rows.append(
            (
                name,
                image,
                config.model.dtype,
                best["batch"],
                best["batch"] / seconds,
                seconds * 1e3,
                best["flops_per_step"] / 1e12,
                achieved / 1e12,
                achieved / peak,
                best["per_device_bytes"] / 2**30,
            )
        )

    limit_text = f"{memory_limit / 2**30:.1f} GiB" if memory_limit is not None else "no limit reported"
    peak_text = (
        f"MFU against {peak / 1e12:g} TFLOP/s bf16 peak ({peak_source})"
        if not math.isnan(peak)
        else "MFU n/a: peak FLOP/s unknown, pass --peak_tflops"
    )
    report.emit(
        "gpu",
        f"Train step on one {device.device_kind} ({limit_text}) at the largest per-device batch that fits "
        f"(tried {_START_BATCH.value}..{max_batch}, doubling): {steps} timed steps after {WARMUP_STEPS} warm-up; "
        f"{peak_text}",
        [
            "model",
            "image",
            "precision",
            "per-device batch",
            "images/s",
            "step ms",
            "TFLOP/step",
            "achieved TFLOP/s",
            "MFU",
            "per-device GiB",
        ],
        rows,
        extra={
            "smoke": smoke,
            "peak_flops": peak,
            "peak_flops_source": peak_source,
            "device_memory_limit_bytes": memory_limit,
            "steps": steps,
            "warmup_steps": WARMUP_STEPS,
            "batches_tried": searches,
        },
    )


if __name__ == "__main__":
    # Defined here, not on import, so that tests can import the functions above
    # next to other benchmarks that define flags of the same names.
    _SMOKE = flags.DEFINE_bool(
        "smoke",
        False,
        "Run on the CPU with the tiny configs (default.py, vitdet_tiny.py) "
        "at 64 px: checks the benchmark end to end; the numbers mean nothing.",
    )
    _START_BATCH = flags.DEFINE_integer("start_batch", 1, "First per-device batch tried.", lower_bound=1)
    _MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Largest per-device batch tried (--smoke: 4).", lower_bound=1)
    _STEPS = flags.DEFINE_integer(
        "steps", 10, "Timed steps per batch, after 2 warm-up steps (--smoke: 2).", lower_bound=1
    )
    _PEAK_TFLOPS = flags.DEFINE_float(
        "peak_tflops",
        None,
        "The device's peak dense bf16 TFLOP/s, for MFU; default: looked up by device kind (--smoke: a nominal 1).",
    )
    _NUM_CLASSES = flags.DEFINE_integer("num_classes", 80, "Classes of the detection head (COCO: 80).")
    _MODELS = flags.DEFINE_list(
        "models", [], "Measure only the models whose name contains one of these words (e.g. dino); default: all."
    )

    from detector import cli

    cli.use_cpu_xla_flags()
    app.run(main)

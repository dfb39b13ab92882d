"""Train-step speed and memory of our DINO-R50 against Hugging Face transformers' Deformable-DETR, side by side.

  python -m benchmarks.vs_transformers                         # batch 2 at 512 px, float32
  python -m benchmarks.vs_transformers --batch_size=8 --image_size=800    # on a GPU: bf16 on both

The model a user would otherwise pick: transformers'
`DeformableDetrForObjectDetection` as DINO's deformable transformer is built
- two-stage, iterative box refinement, 900 queries, 6 + 6 layers, 8 heads,
4 levels x 4 points, FFN 2048, hidden 256, on a ResNet-50 (timm's, with
frozen BatchNorm, stem and first stage frozen as in detectron2's
FREEZE_AT=2), eager PyTorch with its pure-PyTorch deformable attention, its
Hungarian-matched loss on every decoder layer and the encoder proposals.
Ours: configs/dino_r50_coco.py as it trains (frozen BatchNorm, stem and first
stage frozen, contrastive denoising on: `2 x max(denoising_pairs,
input.max_boxes)` more decoder queries than the peer, 200 in the recipe). Both: the same random images and boxes,
AdamW (lr 1e-4, weight decay 1e-4), gradients clipped at norm 0.1, the same
number of classes.

Each side trains in its own worker process (see benchmarks/peer_workers.py):
compiling and warm-up are not timed; the parent alternates timed runs of
`--steps` steps and reports the median images/s of each and their ratio.
Memory, per side: the worker process's peak resident set size (everything
the process ever held, libraries included); for ours also XLA's accounting
of the compiled step (parameters, optimizer state, batch and temporaries per
device). torch, timm and transformers are optional (`pip install -e
".[bench]"`); without them the benchmark says how to get them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

from benchmarks import peer_workers, report

_BATCH_SIZE = flags.DEFINE_integer("batch_size", 2, "Global batch size of both sides.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 512, "Square input size in pixels.")
_STEPS = flags.DEFINE_integer("steps", 1, "Train steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per side; the median is reported.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 80, "Classes of the detection heads.")
_PRECISION = flags.DEFINE_enum(
    "precision", "auto", ["auto", "float32", "bfloat16"], "Compute precision; auto: bfloat16 on a GPU, else float32."
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/dino_r50_coco.py", "Our side's config; --config.KEY=VALUE overrides it (e.g. model.remat=full)."
)
_WORKER = flags.DEFINE_enum("worker", None, ["jax", "torch"], "Internal: run as a worker process.")

PEER_PACKAGES = ("torch", "timm", "transformers")
INSTALL_HINT = (
    'torch, timm and transformers are not installed; install them with `pip install -e ".[bench]"` '
    "(several GB; only this benchmark needs them)"
)
LEARNING_RATE, WEIGHT_DECAY, CLIP_NORM = 1e-4, 1e-4, 0.1
PEER_QUERIES = 900


def our_config(config, batch_size: int, image_size: int, precision: str):
    """Our DINO config at the benchmark's batch, size and precision and the peer's optimizer, data-parallel."""
    config = config.copy_and_resolve_references()
    config.input.image_size = (image_size, image_size)
    config.global_batch_size = batch_size
    config.model.dtype = precision
    config.mesh.update(dict(data=-1, fsdp=1, model=1))
    config.optimizer.update(
        dict(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, grad_clip_norm=CLIP_NORM, lr_multipliers=())
    )
    return config


def _jax_worker() -> None:
    import jax

    from benchmarks import jax_step

    config = our_config(_CONFIG.value, _BATCH_SIZE.value, _IMAGE_SIZE.value, _PRECISION.value)
    step = jax_step.build(config, _NUM_CLASSES.value)
    # The high-water mark of initialising and compiling, before any step runs.
    compile_rss_bytes = peer_workers.peak_rss_bytes()
    step.run(1)  # first execution: buffer allocation, thread-pool start
    dino = config.model.dino
    from detector.ops.denoising import num_denoising_queries

    peer_workers.serve(
        step.run,
        {
            "compile_seconds": step.plan.compile_seconds,
            "compile_peak_rss_bytes": compile_rss_bytes,
            "step_bytes": step.plan.total_bytes * jax.device_count(),
            "temp_bytes": step.plan.memory.temp_bytes * jax.device_count(),
            "parameters": int(sum(leaf.size for leaf in jax.tree.leaves(step.state.params))),
            "queries": f"{dino.num_queries} + {num_denoising_queries(dino.denoising_pairs, config.input.max_boxes)}"
            " denoising",
        },
    )


def transformers_model(num_classes: int):
    """transformers' two-stage Deformable-DETR with box refinement on a timm ResNet-50, random weights."""
    from transformers import DeformableDetrConfig, DeformableDetrForObjectDetection

    config = DeformableDetrConfig(
        use_timm_backbone=True,
        backbone="resnet50",
        use_pretrained_backbone=False,
        num_labels=num_classes,
        num_queries=PEER_QUERIES,
        two_stage=True,
        two_stage_num_proposals=PEER_QUERIES,
        with_box_refine=True,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
        d_model=256,
        num_feature_levels=4,
        encoder_n_points=4,
        decoder_n_points=4,
        disable_custom_kernels=True,  # the pure-PyTorch deformable attention
    )
    model = DeformableDetrForObjectDetection(config)
    # detectron2's FREEZE_AT=2, as our recipe: the stem and the first stage keep their weights.
    for name, parameter in model.model.backbone.named_parameters():
        if not any(stage in name for stage in ("layer2", "layer3", "layer4")):
            parameter.requires_grad_(False)
    return model


def _torch_worker() -> None:
    import torch

    from benchmarks.synthetic import random_batch

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch_size, size = _BATCH_SIZE.value, _IMAGE_SIZE.value
    model = transformers_model(_NUM_CLASSES.value).to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    # Our worker's boxes, as normalised (cx, cy, w, h).
    batch = random_batch(our_config(_CONFIG.value, batch_size, size, "float32"), _NUM_CLASSES.value)
    pixels = torch.rand(batch_size, 3, size, size, device=device)
    labels = []
    for boxes, classes, mask in zip(batch["boxes"], batch["labels"], batch["boxes_mask"]):
        y0, x0, y1, x1 = (torch.as_tensor(boxes[mask][:, i] / size) for i in range(4))
        cxcywh = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], -1).float().to(device)
        classes = torch.as_tensor(classes[mask], dtype=torch.int64, device=device)
        labels.append({"class_labels": classes, "boxes": cxcywh})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=_PRECISION.value == "bfloat16")

    def train_step() -> None:
        with autocast:
            loss = model(pixel_values=pixels, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
        optimizer.step()

    run_steps = peer_workers.torch_steps(train_step, device)
    run_steps(1)
    peer_workers.serve(
        run_steps,
        {
            "threads": torch.get_num_threads(),
            "device": str(device),
            "parameters": sum(p.numel() for p in model.parameters()),
            "queries": str(model.config.num_queries),
        },
    )


def pyramid_positions(image_size: int, min_level: int, max_level: int) -> int:
    """Positions of the encoder's pyramid (strides 2**min_level .. 2**max_level, sides rounded up)."""
    return sum(math.ceil(image_size / 2**level) ** 2 for level in range(min_level, max_level + 1))


def main(argv: list[str]) -> None:
    del argv
    if _WORKER.value == "jax":
        return _jax_worker()
    if _WORKER.value == "torch":
        return _torch_worker()
    dino = _CONFIG.value.model.dino
    positions = pyramid_positions(_IMAGE_SIZE.value, dino.min_level, dino.max_level)
    if positions < PEER_QUERIES:
        # Both sides pick their queries among the encoder's positions.
        sys.exit(
            f"error: --image_size={_IMAGE_SIZE.value} gives a pyramid of {positions} positions, fewer than the "
            f"{PEER_QUERIES} queries both models select from it; use --image_size=256 or more"
        )
    if any(importlib.util.find_spec(name) is None for name in PEER_PACKAGES):
        sys.exit(f"error: {INSTALL_HINT}")
    # torch is only imported by its worker: next to TensorFlow (which the
    # detector package loads for tf.data) it can crash on import.
    versions = {name: importlib.metadata.version(name) for name in PEER_PACKAGES}
    precision, batch_size, size = peer_workers.precision(_PRECISION.value), _BATCH_SIZE.value, _IMAGE_SIZE.value
    args = [
        f"--batch_size={batch_size}",
        f"--image_size={size}",
        f"--precision={precision}",
        f"--num_classes={_NUM_CLASSES.value}",
        *[arg for arg in sys.argv[1:] if arg.startswith("--config")],
    ]
    workers = []
    try:
        # The peer first: a missing or broken peer fails before our step spends minutes compiling.
        theirs = peer_workers.Worker("benchmarks.vs_transformers", "torch", args)
        workers.append(theirs)
        ours = peer_workers.Worker("benchmarks.vs_transformers", "jax", args)
        workers.append(ours)
        times = peer_workers.alternate([ours, theirs], _REPEATS.value, _STEPS.value, f"batch {batch_size}", batch_size)
    except peer_workers.WorkerFailed as failed:
        sys.exit(f"error: {failed}")
    finally:
        for worker in workers:
            worker.close()
    rows = []
    for name, worker in (("ours: DINO-R50 (JAX)", ours), ("transformers Deformable-DETR (PyTorch)", theirs)):
        seconds = statistics.median(times[worker.framework])
        rows.append(
            (
                name,
                seconds,
                batch_size / seconds,
                worker.peak_rss_bytes / 1e9,
                worker.ready.get("compile_peak_rss_bytes", float("nan")) / 1e9,
                worker.ready["step_bytes"] / 1e9 if "step_bytes" in worker.ready else float("nan"),
                worker.ready["parameters"] / 1e6,
                worker.ready["queries"],
            )
        )
    ratio_speed = rows[0][2] / rows[1][2]
    ratio_memory = rows[0][3] / rows[1][3]
    report.emit(
        "vs_transformers",
        f"DINO-R50 train step against transformers' Deformable-DETR: batch {batch_size}, {size}x{size}, {precision}, "
        f"median of {_REPEATS.value} runs of {_STEPS.value} steps; ours {ratio_speed:.2f}x the images/s "
        f"at {ratio_memory:.2f}x the peak memory",
        [
            "model",
            "s/step",
            "images/s",
            "peak RSS GB",
            "peak RSS before the first step GB",
            "XLA step GB",
            "parameters M",
            "decoder queries",
        ],
        rows,
        extra={
            "seconds_per_step": times,
            "ours": ours.ready,
            "transformers": theirs.ready,
            "images_per_second_ratio": ratio_speed,
            "peak_rss_ratio": ratio_memory,
        },
        versions=versions,
    )


if __name__ == "__main__":
    if "--worker=torch" not in sys.argv:  # keep TensorFlow and JAX out of the torch worker
        from detector import cli

        cli.use_cpu_xla_flags()
    app.run(main)

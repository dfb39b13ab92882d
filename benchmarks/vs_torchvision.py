"""Train-step throughput of our RetinaNet R50-FPN against torchvision's, side by side on one machine.

  python -m benchmarks.vs_torchvision                       # batch 2 and 4 at 512 px, float32
  python -m benchmarks.vs_torchvision --batch_sizes=8 --image_size=800    # on a GPU: bf16 on both

The same network on both sides. torchvision: `retinanet_resnet50_fpn` as its
builder assembles it for fine-tuning - ResNet-50 with frozen BatchNorm, the
stem and first stage frozen, FPN P3-P7 with P6/P7 from P5, heads without
normalisation, 9 anchors per location, sigmoid focal loss. Ours:
configs/retinanet_r50_coco.py with model.backbone.norm=frozen_bn,
freeze_stages=2 and model.head_norm=none. Same image size, batch, number of
classes, boxes per image and optimizer (SGD, lr 0.01, momentum 0.9, weight
decay 1e-4). Mixed precision: bf16 autocast for torchvision and
model.dtype=bfloat16 for ours (the default on GPUs; float32 on CPUs).

Each framework trains in its own worker process, started once per batch
size (compilation and warm-up are not timed). The parent then alternates
timed runs of `--steps` steps, swapping which goes first every repeat, so
both see the same machine state, and reports the median images/s of each
and their ratio. torch and torchvision are optional (`pip install -e
".[bench]"`, several GB); without them the benchmark says how to get them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import statistics
import sys

from absl import app, flags

from benchmarks import peer_workers, report

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["2", "4"], "Global batch sizes to compare.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 512, "Square input size in pixels.")
_STEPS = flags.DEFINE_integer("steps", 2, "Train steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per framework; the median is reported.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 80, "Classes of the detection head.")
_PRECISION = flags.DEFINE_enum(
    "precision",
    "auto",
    ["auto", "float32", "bfloat16"],
    "Compute precision; auto: bfloat16 on a GPU, float32 on a CPU.",
)
_WORKER = flags.DEFINE_enum("worker", None, ["jax", "torch"], "Internal: run as a worker process.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 2, "Internal: the worker's global batch size.")

INSTALL_HINT = (
    'torch and torchvision are not installed; install them with `pip install -e ".[bench]"` '
    "(several GB; for a CPU-only machine PyTorch's CPU wheels are much smaller)"
)


# ----------------------------------------------------------------------------- workers


def our_config(batch_size: int, image_size: int, precision: str):
    """configs/retinanet_r50_coco.py reshaped to torchvision's fine-tuning RetinaNet (see the module docstring)."""
    from configs import retinanet_r50_coco

    config = retinanet_r50_coco.get_config()
    config.input.image_size = (image_size, image_size)
    config.global_batch_size = batch_size
    config.model.backbone.norm = "frozen_bn"
    config.model.backbone.freeze_stages = 2
    config.model.head_norm = "none"
    config.model.dtype = precision
    config.mesh.update(dict(data=-1, fsdp=1, model=1))
    config.optimizer.update(
        dict(
            name="sgd",
            learning_rate=0.01,
            momentum=0.9,
            weight_decay=1e-4,
            warmup_steps=0,
            schedule="cosine",
            grad_clip_norm=0.0,
        )
    )
    return config


def _jax_worker(batch_size: int, precision: str) -> None:
    from benchmarks import jax_step

    config = our_config(batch_size, _IMAGE_SIZE.value, precision)
    step = jax_step.build(config, _NUM_CLASSES.value)
    step.run(1)  # first execution: buffer allocation, thread-pool start
    peer_workers.serve(
        step.run,
        {
            "compile_seconds": step.plan.compile_seconds,
            "gflop_per_device_step": step.plan.flops / 1e9,
            "per_device_mib": step.plan.total_bytes / 2**20,
        },
    )


def torchvision_model(num_classes: int, image_size: int):
    """torchvision's `retinanet_resnet50_fpn` with a frozen-BN backbone, built without downloading weights."""
    from torchvision.models import resnet50
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.models.detection.retinanet import RetinaNet
    from torchvision.ops import misc as misc_nn_ops
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    # The body of torchvision's retinanet_resnet50_fpn when backbone weights are
    # given: FrozenBatchNorm2d, 3 trainable stages (conv1 and layer1 frozen).
    backbone = resnet50(weights=None, norm_layer=misc_nn_ops.FrozenBatchNorm2d)
    backbone = _resnet_fpn_extractor(backbone, 3, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
    # min_size = max_size = image size: the model's transform keeps square inputs as they are.
    return RetinaNet(backbone, num_classes, min_size=image_size, max_size=image_size)


def _torch_worker(batch_size: int, precision: str) -> None:
    import torch

    from benchmarks.synthetic import random_batch

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torchvision_model(_NUM_CLASSES.value, _IMAGE_SIZE.value).to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.01, momentum=0.9, weight_decay=1e-4)
    # The same boxes as our worker's batch; torchvision wants xyxy and labels >= 1.
    config = our_config(batch_size, _IMAGE_SIZE.value, "float32")
    batch = random_batch(config, _NUM_CLASSES.value)
    images = [torch.rand(3, _IMAGE_SIZE.value, _IMAGE_SIZE.value, device=device) for _ in range(batch_size)]
    targets = []
    for boxes, labels, mask in zip(batch["boxes"], batch["labels"], batch["boxes_mask"]):
        boxes_xyxy = torch.as_tensor(boxes[mask][:, [1, 0, 3, 2]], device=device)
        targets.append(
            {"boxes": boxes_xyxy, "labels": torch.as_tensor(labels[mask] % (_NUM_CLASSES.value - 1) + 1, device=device)}
        )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")

    def train_step() -> None:
        with autocast:
            losses = model(images, targets)
        loss = sum(losses.values())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    run_steps = peer_workers.torch_steps(train_step, device)
    run_steps(1)
    peer_workers.serve(
        run_steps,
        {
            "threads": torch.get_num_threads(),
            "device": str(device),
            "trainable_parameters": sum(p.numel() for p in trainable),
        },
    )


# ----------------------------------------------------------------------------- the comparison


def main(argv: list[str]) -> None:
    del argv
    if _WORKER.value == "jax":
        return _jax_worker(_BATCH_SIZE.value, _PRECISION.value)
    if _WORKER.value == "torch":
        return _torch_worker(_BATCH_SIZE.value, _PRECISION.value)
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
        sys.exit(f"error: {INSTALL_HINT}")
    # torch is only imported by its worker: in one process with TensorFlow
    # (which the detector package loads for tf.data) it can crash on import.
    versions = {name: importlib.metadata.version(name) for name in ("torch", "torchvision")}
    precision = peer_workers.precision(_PRECISION.value)
    rows, runs = [], {}
    for batch_size in (int(b) for b in _BATCH_SIZES.value):
        args = [
            f"--batch_size={batch_size}",
            f"--precision={precision}",
            f"--image_size={_IMAGE_SIZE.value}",
            f"--num_classes={_NUM_CLASSES.value}",
        ]
        workers = []
        try:
            ours = peer_workers.Worker("benchmarks.vs_torchvision", "jax", args)
            workers.append(ours)
            theirs = peer_workers.Worker("benchmarks.vs_torchvision", "torch", args)
            workers.append(theirs)
            times = peer_workers.alternate(
                [ours, theirs], _REPEATS.value, _STEPS.value, f"batch {batch_size}", batch_size
            )
        except peer_workers.WorkerFailed as failed:
            sys.exit(f"error: {failed}")
        finally:
            for worker in workers:
                worker.close()
        ours_ips = batch_size / statistics.median(times["jax"])
        theirs_ips = batch_size / statistics.median(times["torch"])
        rows.append(
            (
                batch_size,
                f"{_IMAGE_SIZE.value}x{_IMAGE_SIZE.value}",
                precision,
                ours_ips,
                theirs_ips,
                ours_ips / theirs_ips,
                statistics.median(times["jax"]),
                statistics.median(times["torch"]),
                ours.ready["compile_seconds"],
                ours.ready["per_device_mib"],
            )
        )
        runs[str(batch_size)] = {"seconds_per_step": times, "ours": ours.ready, "torchvision": theirs.ready}
    report.emit(
        "vs_torchvision",
        f"RetinaNet R50-FPN train step, ours (JAX) vs torchvision: median of {_REPEATS.value} runs "
        f"of {_STEPS.value} steps, {_NUM_CLASSES.value} classes",
        [
            "batch",
            "image",
            "precision",
            "ours images/s",
            "torchvision images/s",
            "ratio (ours/tv)",
            "ours s/step",
            "torchvision s/step",
            "ours compile s",
            "ours per-device MiB",
        ],
        rows,
        extra={"runs": runs},
        versions=versions,
    )


if __name__ == "__main__":
    if "--worker=torch" not in sys.argv:  # keep TensorFlow and JAX out of the torch worker
        from detector import cli

        cli.use_cpu_xla_flags()
    app.run(main)

"""A trained detector as one self-contained file: a serialized `jax.export` (StableHLO) program.

`export_predictor` turns a loaded `Predictor` into a `jax.export.Exported`
of `(images, image_hw) -> detections` with the parameters baked in as constants, for
both XLA:CPU and CUDA GPUs (one artifact runs on either). `write_artifact`
saves it next to a JSON file that says everything a user needs without this
project's config: how to preprocess an image, what the outputs are, which
class each label is. `load_artifact` reads both back and predicts on
images of any size the way `python -m detector.predict` does (through the
same eval transform, so the resize is identical); the program itself needs
only JAX: `jax.export.deserialize(bytes).call(images, image_hw)`.

  DIR/model.jax_exported  `Exported.serialize()` bytes; `jax.export.deserialize`
                          restores it in any process with a compatible JAX
  DIR/model.json          preprocessing, classes, outputs, provenance

A mask model (Mask DINO: `model.dino.mask_dim` > 0) also returns `masks`,
each detection's mask logits at `mask_stride` network pixels per cell;
`serving.masks.instance_masks` pastes them to the original image as the
predictor does (and rescores the detections as Mask DINO does), which
`ExportedDetector.predict` calls.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from detector.errors import ConfigError
from detector.models import families, mask_branch, transformer
from detector.serving import masks
from detector.serving.predictor import Predictor, network_input
from input_pipeline import transforms

EXPORTED_FILE = "model.jax_exported"
METADATA_FILE = "model.json"
# Lowering for "cuda" needs no GPU: one artifact serves both kinds of machine.
PLATFORMS = ("cpu", "cuda")
OUTPUT_NAMES = ("boxes", "scores", "classes", "valid")
# A mask model's further outputs.
MASK_OUTPUT_NAMES = ("masks",)
# What model.json's "program_format" names: a serialized jax.export or an ONNX model.
PROGRAM_JAX = "jax"
PROGRAM_ONNX = "onnx"
# Images per call of a program with a dynamic batch dimension, in `ExportedDetector.predict`.
DYNAMIC_BATCH_CHUNK = 8
# 2: uint8 images and their sizes in, normalised inside the program (1 took normalised float32 images).
FORMAT_VERSION = 2


def host_params(params: Any) -> Any:
    """The (possibly sharded, possibly multi-host) parameters as numpy arrays on this host."""
    if all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params)):
        return params  # gathered already
    if jax.process_count() > 1:
        # Shards on other hosts are not addressable here; every process must join the gather.
        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


def detection_function(predictor: Predictor) -> Callable[[jax.Array, jax.Array], dict[str, jax.Array]]:
    """`(images, image_hw) -> detections` with the predictor's parameters closed over as host constants.

    The function maps images uint8 `[B, H, W, 3]` (the eval transform's
    output: resized, rounded, padded bottom/right) and image_hw int32
    `[B, 2]` (each image's (h, w) inside the padding) to boxes float32
    `[B, D, 4]` yxyx in network-input pixels, scores float32 `[B, D]`
    (descending), classes int32 `[B, D]` (contiguous labels) and valid bool
    `[B, D]`; D is `config.postprocess.max_detections`; a mask model adds
    masks float32 `[B, D, H / s, W / s]`, each detection's mask logits at
    `mask_branch.STRIDE` s over the padded input. It normalises the
    pixels itself, as the train and predict steps do. A backbone trained with
    LoRA adapters (`model.backbone.lora_rank` > 0) runs with them merged into
    its kernels: the plain backbone, computing what the adapted one does.
    """
    objective, params = _program_objective(predictor)

    def detect(images: jax.Array, image_hw: jax.Array) -> dict[str, jax.Array]:
        outputs = objective.detect(params, images, image_hw)
        return {name: outputs[name] for name in (*OUTPUT_NAMES, *MASK_OUTPUT_NAMES) if name in outputs}

    return detect


def network_function(predictor: Predictor) -> Callable[[jax.Array, jax.Array], Any]:
    """`(images, image_hw) -> the network's raw outputs` (before top-k and NMS), as `detection_function`'s
    program computes them: the same parameters, constants, normalisation; for checking an exported program's
    network (see `families.Objective.network`)."""
    objective, params = _program_objective(predictor)
    return functools.partial(objective.network, params)


def _program_objective(predictor: Predictor) -> tuple[families.Objective, Any]:
    """The objective an exported program runs and its parameters on this host (LoRA adapters merged)."""
    config = predictor.config
    objective = predictor.run.objective
    params = host_params(predictor.params)
    num_classes = predictor.dataset_info.num_classes
    backbone = config.model.backbone
    if backbone.get("lora_rank", 0):
        # The program is the plain backbone: each low-rank adapter folded into
        # its kernel once here, not two extra matmuls per projection per call.
        params = {
            **params,
            "backbone": transformer.merge_lora(params["backbone"], backbone.lora_alpha / backbone.lora_rank),
        }
        config = copy.deepcopy(config)
        with config.unlocked():
            config.model.backbone.lora_rank = 0
            config.model.backbone.training = "full"
        # Another network (no adapters): its own objective.
        objective = families.objective(config, families.create_model(config, num_classes), num_classes)
    return objective, params


def _check_batch_size(batch_size: int) -> int:
    if int(batch_size) != batch_size or batch_size < 1:
        raise ConfigError(f"batch size {batch_size} must be a whole number of images, at least 1")
    return int(batch_size)


def export_predictor(
    predictor: Predictor, batch_size: int, platforms: Sequence[str] = PLATFORMS
) -> jax.export.Exported:
    """Exports the predictor's detection for fixed batches of `batch_size` images.

    The exported program takes images uint8 `[batch_size, H, W, 3]` (H, W =
    `config.input.image_size`) and image_hw int32 `[batch_size, 2]` (see
    `detection_function` for what they hold)
    and returns `{"boxes", "scores", "classes", "valid"}` as
    `detection_function` describes. The parameters are constants inside the
    program, so the serialized artifact stands alone; the program runs on one
    device of any of `platforms` (default: CPU and CUDA GPUs; lowering for
    CUDA needs no GPU).
    """
    batch_size = _check_batch_size(batch_size)
    height, width = predictor.config.input.image_size
    images = jax.ShapeDtypeStruct((batch_size, int(height), int(width), 3), jnp.uint8)
    image_hw = jax.ShapeDtypeStruct((batch_size, 2), jnp.int32)
    detect = detection_function(predictor)
    # No sharding rules while tracing: the model's logical constraints become
    # no-ops and the program is a plain single-device one.
    with nn.logical_axis_rules(()):
        return jax.export.export(jax.jit(detect), platforms=tuple(platforms))(images, image_hw)


def artifact_metadata(
    predictor: Predictor, inputs: Sequence[Any], outputs: dict[str, Any], program: dict[str, Any]
) -> dict[str, Any]:
    """model.json's content: what a user of the artifact needs to know, in plain JSON types.

    `inputs`: the program's (images, image_hw) shapes and dtypes (a symbolic
    batch dimension is written as its name, and batch_size as null);
    `outputs`: name -> shape and dtype; `program`: the program file's own
    entries (its file, format and what runs it).
    """
    config = predictor.config
    images, image_hw = inputs
    batch_size, height, width, _ = images.shape
    info = predictor.dataset_info
    postprocess = config.postprocess
    output_meaning = {
        "boxes": "y0, x0, y1, x1 in network-input pixels; divide by scale for original pixels",
        "scores": "sigmoid class scores, descending per image",
        "classes": "contiguous labels: index into class_names and label_to_category_id",
        "valid": "False marks unused slots (zeros): read the other outputs through it",
    }
    if "masks" in outputs:
        output_meaning["masks"] = (
            f"mask logits at mask_stride ({mask_branch.STRIDE}) network-input pixels per cell over the padded "
            "input: upsample bilinearly x mask_stride, keep the top-left image_hw, resize bilinearly to the "
            "original size (half-pixel centres, no antialiasing), mask = logit > 0; the instance score is the "
            "class score x the mean sigmoid(logit) over the cells inside the mask "
            "(detector.serving.masks.instance_masks does both)"
        )
    return {
        "format_version": FORMAT_VERSION,
        **program,
        "step": int(predictor.step),
        "backbone": str(config.model.backbone.name),
        "dataset": config.dataset.name,
        "batch_size": int(batch_size) if isinstance(batch_size, int) else None,
        "input": {
            "name": "images",
            "shape": _json_shape(images.shape),
            "dtype": str(images.dtype),
            "image_size": [int(height), int(width)],
            "sizes": {"name": "image_hw", "shape": _json_shape(image_hw.shape), "dtype": str(image_hw.dtype)},
            "preprocessing": (
                "RGB image h x w (0-255); scale = min(H / h, W / w); resize to (round(h * scale), "
                "round(w * scale)) (bilinear, antialiased, TF2 half-pixel centres); round to uint8; pad "
                "bottom/right to H x W (any value); image_hw = the resized (h, w)"
            ),
            # Applied inside the program; for information.
            "mean_rgb": [float(v) for v in config.input.mean_rgb],
            "std_rgb": [float(v) for v in config.input.std_rgb],
        },
        "outputs": {
            name: {"shape": _json_shape(aval.shape), "dtype": str(aval.dtype)} for name, aval in outputs.items()
        },
        "output_meaning": output_meaning,
        **({"mask_stride": mask_branch.STRIDE} if "masks" in outputs else {}),
        "class_names": [str(name) for name in info.class_names],
        "label_to_category_id": [int(c) for c in info.label_to_category_id],
        "postprocess": {
            key: float(postprocess[key]) if key.endswith("threshold") else int(postprocess[key])
            for key in (
                "pre_nms_top_k",
                "score_threshold",
                "iou_threshold",
                "max_detections",
                "query_nms_iou_threshold",
            )
        },
    }


def _json_shape(shape) -> list[int | str]:
    """A shape in JSON: a symbolic dimension as its name (e.g. "batch")."""
    return [int(d) if isinstance(d, int) else str(d) for d in shape]


def write_artifact(exported: jax.export.Exported, predictor: Predictor, directory: str | epath.PathLike) -> epath.Path:
    """Writes DIRECTORY/model.jax_exported and DIRECTORY/model.json; returns the directory."""
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / EXPORTED_FILE).write_bytes(bytes(exported.serialize()))
    program = {
        "exported_file": EXPORTED_FILE,
        "program_format": PROGRAM_JAX,
        "jax_version": jax.__version__,
        "platforms": list(exported.platforms),
    }
    outputs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    metadata = artifact_metadata(predictor, exported.in_avals, outputs, program)
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
    return directory


def export_to_directory(
    predictor: Predictor, batch_size: int, directory: str | epath.PathLike, *, checkpoint: str = ""
) -> str | None:
    """Exports the predictor for batches of `batch_size` and writes the artifact to `directory` (process 0).

    Every process takes part in gathering the parameters; returns, on process
    0, one line saying what was written where (None on the others).
    `checkpoint` names where the parameters came from ("last", "best", a step).
    """
    exported = export_predictor(predictor, batch_size)
    if jax.process_index() != 0:
        return None
    directory = write_artifact(exported, predictor, directory)
    written = [directory / EXPORTED_FILE, directory / METADATA_FILE]
    sizes = ", ".join(f"{path.name} ({format_size(path.stat().length)})" for path in written)
    return (
        f"exported step {predictor.step}{f' ({checkpoint})' if checkpoint else ''} for batches of {batch_size} "
        f"on {'/'.join(exported.platforms)} to {directory}: {sizes}"
    )


def format_size(num_bytes: int) -> str:
    size, unit = float(num_bytes), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{num_bytes} B" if unit == "B" else f"{size:.1f} {unit}"


@dataclasses.dataclass(frozen=True)
class ExportedDetector:
    """A loaded artifact and its metadata: predicts on RGB images of any size.

    Attributes:
      call: the program, `(images, image_hw) -> {output name: array}` on numpy
        arrays (a deserialized jax.export, see `export_predictor`, or an ONNX
        Runtime session, see `onnx_export`).
      metadata: model.json's content (see `artifact_metadata`).
    """

    call: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]
    metadata: dict[str, Any]

    @property
    def batch_size(self) -> int | None:
        """The program's fixed batch size; None for a dynamic batch dimension (an ONNX model)."""
        size = self.metadata["batch_size"]
        return None if size is None else int(size)

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(self.metadata["class_names"])

    @property
    def label_to_category_id(self) -> tuple[int, ...]:
        return tuple(self.metadata["label_to_category_id"])

    def transform_options(self) -> transforms.TransformOptions:
        """The eval transform's settings the artifact was exported with."""
        spec = self.metadata["input"]
        return transforms.TransformOptions(image_size=tuple(spec["image_size"]), max_boxes=1)

    def predict(self, images: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Detections per image, in its original pixels.

        Args:
          images: uint8 RGB arrays `[h, w, 3]`, any sizes.

        Returns:
          per image, in order: {"boxes_yxyx": float32 `[N, 4]` y0, x0, y1, x1 in
          the image's pixels (clipped to it), "scores": float32 `[N]` (descending class scores),
          "labels": int32 `[N]` (index into `class_names`)}; N <= max_detections.
          A mask model's add "masks" (`RleMasks`, N masks in the image's
          pixels) and their scores are Mask DINO's instance scores, in the
          class scores' order, as `detector.predict` gives them
          (`masks.instance_masks`).
        """
        for index, image in enumerate(images):
            if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
                raise ValueError(f"image {index}: expected uint8 [h, w, 3] RGB, got {image.dtype} {image.shape}")
        opts = self.transform_options()
        rows = [network_input(image, index, opts) for index, image in enumerate(images)]
        blank = {key: np.zeros_like(rows[0][key]) for key in ("image", "image_hw")} if rows else None
        results: list[dict[str, np.ndarray]] = []
        step = self.batch_size or DYNAMIC_BATCH_CHUNK
        for first in range(0, len(rows), step):
            chunk = rows[first : first + step]
            # A fixed batch size: the last batch is filled with blank images.
            filled = chunk + [blank] * (step - len(chunk)) if self.batch_size else chunk
            outputs = self.call(
                np.stack([row["image"] for row in filled]), np.stack([row["image_hw"] for row in filled])
            )
            for i, row in enumerate(chunk):
                keep = outputs["valid"][i]
                height, width = (float(v) for v in row["original_size"])
                boxes = np.asarray(outputs["boxes"][i][keep], np.float32) / np.float32(row["scale"])
                result = {
                    "boxes_yxyx": np.clip(boxes, 0.0, np.array([height, width, height, width], np.float32)),
                    "scores": np.asarray(outputs["scores"][i][keep], np.float32),
                    "labels": np.asarray(outputs["classes"][i][keep], np.int32),
                }
                if "masks" in outputs:
                    result["masks"], result["scores"] = masks.instance_masks(
                        result["scores"],
                        outputs["masks"][i][keep],
                        row["image_hw"],
                        row["original_size"],
                        int(self.metadata["mask_stride"]),
                    )
                results.append(result)
        return results


def load_artifact(directory: str | epath.PathLike) -> ExportedDetector:
    """Reads what `write_artifact` (or `onnx_export.export_to_directory`) wrote to `directory`.

    An ONNX model runs in ONNX Runtime (`pip install -e ".[onnx]"`), on its CPU provider.
    """
    directory = epath.Path(directory)
    if not (directory / METADATA_FILE).exists():
        raise FileNotFoundError(
            f"{directory / METADATA_FILE} does not exist: export a model there first (python -m detector.export)"
        )
    metadata = json.loads((directory / METADATA_FILE).read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{directory} holds an artifact of format {metadata.get('format_version')}; this version reads format "
            f"{FORMAT_VERSION} (uint8 images in): export the model again with python -m detector.export"
        )
    program_file = directory / metadata["exported_file"]
    if not program_file.exists():
        raise FileNotFoundError(
            f"{program_file} does not exist: export a model there first (python -m detector.export)"
        )
    if metadata.get("program_format", PROGRAM_JAX) == PROGRAM_ONNX:
        return ExportedDetector(call=_onnx_runtime_call(str(program_file)), metadata=metadata)
    exported = jax.export.deserialize(bytearray(program_file.read_bytes()))
    return ExportedDetector(call=lambda *inputs: jax.device_get(exported.call(*inputs)), metadata=metadata)


def _onnx_runtime_call(path: str) -> Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]:
    """An ONNX Runtime session of the model at `path`, as `(images, image_hw) -> {output name: array}`."""
    try:
        import onnxruntime
    except ImportError as e:
        raise ConfigError(f'{path} is an ONNX model, which needs onnxruntime: pip install -e ".[onnx]"') from e
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # its shape-merging warnings name the converter's internal values
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]

    def call(images: np.ndarray, image_hw: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"images": images, "image_hw": image_hw}), strict=True))

    return call

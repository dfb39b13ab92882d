"""Synthetic shapes: a small, deterministic detection dataset generated locally.

Square RGB images with 1-8 objects of 4 classes (rectangle, ellipse, triangle,
cross), each filled or outlined, on textured backgrounds (colour gradients,
a low-frequency wave, faint distractor lines/blobs and sensor noise). It needs
no download, so the trainer, the tests and the benchmarks can run anywhere.

Features follow TFDS `coco/2017` so the pipeline reads both the same way:
  image:   uint8 [S, S, 3] (PNG)
  image/id: int64 (index + 1 within the split)
  objects: Sequence of {bbox: BBoxFeature (normalized y0, x0, y1, x1),
                        label: ClassLabel(CLASS_NAMES),
                        rle: Text, the object's visible pixels as COCO's
                        compressed RLE `counts` over the S x S image}

Boxes are the exact pixel extent of the visible pixels of each drawn shape:
y0/x0 are the first covered row/column and y1/x1 are exclusive pixel edges,
so in absolute pixels `image[y0:y1, x0:x1]` is the tightest crop.

Every example is a pure function of (split, index, image_size); the sizes of
the splits are part of the builder config name, so differently sized
datasets never share prepared files.
"""

from __future__ import annotations

import dataclasses
import io
import zlib

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from PIL import Image, ImageDraw

from input_pipeline import masks

CLASS_NAMES = ("rectangle", "ellipse", "triangle", "cross")

MIN_OBJECTS, MAX_OBJECTS = 1, 8
# Object side lengths as fractions of the image side (per dimension).
MIN_REL_SIZE, MAX_REL_SIZE = 0.12, 0.55
MIN_ASPECT, MAX_ASPECT = 0.5, 2.0  # width / height
# Placement rejection: a new object may overlap earlier ones, but not by more
# than this IoU, and must leave this fraction of each earlier object visible.
MAX_IOU = 0.3
MIN_VISIBLE_FRACTION = 0.6
# Euclidean RGB distance (0-255 units) an object's colour keeps from (almost)
# all pixels under and around it. Distractors stay well below it so they
# cannot be mistaken for objects.
MIN_CONTRAST = 80.0
DISTRACTOR_CONTRAST = (12.0, 35.0)
PLACEMENT_TRIES = 30
COLOR_TRIES = 24


@dataclasses.dataclass(frozen=True)
class ShapesExample:
    """One generated example (absolute pixel units).

    Attributes:
      image: uint8 [S, S, 3].
      boxes: float32 [N, 4], y0, x0, y1, x1 of the visible pixels (y1, x1
        exclusive).
      labels: int32 [N], indices into CLASS_NAMES.
      masks: bool [N, S, S], visible pixels of each object in the final image.
      colors: float32 [N, 3], RGB colour (whole numbers, 0-255) of every
        pixel of each object; noise is only added to the background.
      filled: bool [N], False for outlined shapes.
      shape_pixels: int32 [N], pixel count of each whole shape as drawn,
        before later shapes covered parts of it.
    """

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    masks: np.ndarray
    colors: np.ndarray
    filled: np.ndarray
    shape_pixels: np.ndarray


def _rng(split: str, index: int) -> np.random.Generator:
    # crc32, not hash(): Python string hashing is salted per process.
    return np.random.default_rng([zlib.crc32(split.encode("utf-8")), int(index)])


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Smooth two-colour gradient plus a faint wave; float32 [S, S, 3], 0-255."""
    coords = np.arange(size, dtype=np.float32) / np.float32(max(size - 1, 1))
    # Linear ramps are separable: ramp(y, x) = a * y + b * x.
    theta = rng.uniform(0.0, 2.0 * np.pi)
    t = np.float32(np.sin(theta)) * coords[:, None] + np.float32(np.cos(theta)) * coords[None, :]
    t -= t.min()
    t /= max(float(t.max()), 1e-6)
    c0, c1 = rng.uniform(0.0, 255.0, size=(2, 3)).astype(np.float32)
    phi = rng.uniform(0.0, 2.0 * np.pi)
    freq = 2.0 * np.pi * rng.uniform(0.5, 2.5)
    # sin(u + v) = sin(u)cos(v) + cos(u)sin(v) with u along y, v along x:
    # two outer products instead of a full-image sin.
    u = (freq * np.sin(phi)) * coords[:, None]
    v = (freq * np.cos(phi)) * coords[None, :] + rng.uniform(0.0, 2.0 * np.pi)
    amplitude = np.float32(rng.uniform(3.0, 12.0))
    wave = (np.sin(u) * np.cos(v) + np.cos(u) * np.sin(v)).astype(np.float32)
    wave *= amplitude
    bg = c0 + t[..., None] * (c1 - c0) + wave[..., None]
    return np.clip(bg, 0.0, 255.0, out=bg)


def _draw_distractors(rng, canvas: np.ndarray) -> None:
    """Faint lines and blobs that are not objects, in place on float canvas."""
    size = canvas.shape[0]
    for _ in range(rng.integers(1, 5)):
        layer = Image.new("L", (size, size), 0)
        draw = ImageDraw.Draw(layer)
        if rng.random() < 0.5:
            p = rng.uniform(0, size - 1, size=4)
            draw.line([float(v) for v in p], fill=1, width=int(rng.integers(1, 3)))
        else:
            cx, cy = rng.uniform(0, size - 1, size=2)
            ry, rx = rng.uniform(0.03, 0.15, size=2) * size
            draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=1)
        mask = np.asarray(layer, dtype=bool)
        if not mask.any():
            continue
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction) + 1e-6
        color = canvas[mask].mean(axis=0) + direction * rng.uniform(*DISTRACTOR_CONTRAST)
        canvas[mask] = np.clip(color, 0.0, 255.0)


def _shape_mask(rng, size: int, label: int, x0: int, y0: int, w: int, h: int, filled: bool, width: int) -> np.ndarray:
    """Rasterizes one shape in the box [x0, x0+w) x [y0, y0+h); bool [S, S]."""
    layer = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(layer)
    x1, y1 = x0 + w - 1, y0 + h - 1  # PIL coordinates are inclusive pixels.
    fill = 1 if filled else None
    outline = None if filled else 1
    name = CLASS_NAMES[label]
    if name == "rectangle":
        draw.rectangle([x0, y0, x1, y1], fill=fill, outline=outline, width=width)
    elif name == "ellipse":
        draw.ellipse([x0, y0, x1, y1], fill=fill, outline=outline, width=width)
    elif name == "triangle":
        t = rng.uniform(0.0, 1.0)
        orientation = rng.integers(4)
        if orientation == 0:  # apex on the top edge
            pts = [(x0 + t * (w - 1), y0), (x1, y1), (x0, y1)]
        elif orientation == 1:  # apex on the bottom edge
            pts = [(x0, y0), (x1, y0), (x0 + t * (w - 1), y1)]
        elif orientation == 2:  # apex on the left edge
            pts = [(x0, y0 + t * (h - 1)), (x1, y0), (x1, y1)]
        else:  # apex on the right edge
            pts = [(x0, y0), (x1, y0 + t * (h - 1)), (x0, y1)]
        draw.polygon(pts, fill=fill, outline=outline, width=width)
    else:  # cross (plus sign)
        ty = max(2, int(round(h * rng.uniform(0.25, 0.4))))
        tx = max(2, int(round(w * rng.uniform(0.25, 0.4))))
        by0 = y0 + (h - ty) // 2
        bx0 = x0 + (w - tx) // 2
        by1, bx1 = by0 + ty - 1, bx0 + tx - 1
        if filled:
            draw.rectangle([x0, by0, x1, by1], fill=1)
            draw.rectangle([bx0, y0, bx1, y1], fill=1)
        else:
            pts = [
                (bx0, y0),
                (bx1, y0),
                (bx1, by0),
                (x1, by0),
                (x1, by1),
                (bx1, by1),
                (bx1, y1),
                (bx0, y1),
                (bx0, by1),
                (x0, by1),
                (x0, by0),
                (bx0, by0),
            ]
            draw.polygon(pts, outline=1, width=width)
    return np.asarray(layer, dtype=bool)


def _extent(mask: np.ndarray) -> np.ndarray:
    """Pixel extent of a non-empty bool [S, S] mask: float32 y0, x0, y1, x1."""
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    return np.array([rows[0], cols[0], rows[-1] + 1, cols[-1] + 1], np.float32)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    ih = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iw = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ih * iw
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _pick_color(rng, canvas: np.ndarray, box: np.ndarray) -> np.ndarray:
    """A colour that contrasts with nearly every pixel under and around `box`."""
    size = canvas.shape[0]
    y0, x0, y1, x1 = (int(v) for v in box)
    region = canvas[max(0, y0 - 2) : min(size, y1 + 2), max(0, x0 - 2) : min(size, x1 + 2)].reshape(-1, 3)
    candidates = rng.uniform(0.0, 255.0, size=(COLOR_TRIES, 3)).astype(np.float32)
    k = int(0.05 * (region.shape[0] - 1))
    best, best_score = candidates[0], -1.0
    for color in candidates:
        # 5th percentile of the squared distance to the region's pixels.
        score = float(np.partition(np.square(region - color).sum(-1), k)[k])
        if score >= MIN_CONTRAST**2:
            return np.round(color)
        if score > best_score:
            best, best_score = color, score
    return np.round(best)


def generate_example(split: str, index: int, image_size: int = 128) -> ShapesExample:
    """Deterministically draws example `index` of `split` at side `image_size`."""
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16 pixels, got {image_size}")
    rng = _rng(split, index)
    size = image_size
    canvas = _background(rng, size)
    _draw_distractors(rng, canvas)
    # Noise belongs to the background texture; objects keep exact colours.
    # Luminance noise, shared by the channels (a third of the random draws).
    sigma = np.float32(rng.uniform(2.0, 5.0))
    canvas += sigma * rng.standard_normal(size=(size, size, 1), dtype=np.float32)
    np.clip(canvas, 0.0, 255.0, out=canvas)

    # full_*: each object's whole drawn shape; visible: what later shapes left.
    full_counts, full_boxes, visible = [], [], []
    labels, colors, filled_flags = [], [], []
    min_px = max(4, int(round(MIN_REL_SIZE * size)))
    max_px = max(min_px, int(round(MAX_REL_SIZE * size)))
    for _ in range(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1)):
        for _ in range(PLACEMENT_TRIES):
            label = int(rng.integers(len(CLASS_NAMES)))
            h_rel = rng.uniform(MIN_REL_SIZE, MAX_REL_SIZE)
            aspect = np.exp(rng.uniform(np.log(MIN_ASPECT), np.log(MAX_ASPECT)))
            # Python min/max: np.clip on scalars costs more than drawing a shape.
            w_rel = min(max(h_rel * aspect, MIN_REL_SIZE), MAX_REL_SIZE)
            h = min(max(int(round(h_rel * size)), min_px), max_px)
            w = min(max(int(round(w_rel * size)), min_px), max_px)
            y0 = int(rng.integers(0, size - h + 1))
            x0 = int(rng.integers(0, size - w + 1))
            filled = bool(rng.random() < 0.5)
            width = int(rng.integers(2, 4))
            # Cheap rejection on the nominal box before rasterizing.
            nominal = np.array([y0, x0, y0 + h, x0 + w], np.float32)
            if any(_iou(nominal, b) > MAX_IOU for b in full_boxes):
                continue
            mask = _shape_mask(rng, size, label, x0, y0, w, h, filled, width)
            if not mask.any():
                continue
            box = _extent(mask)
            if any(_iou(box, b) > MAX_IOU for b in full_boxes):
                continue
            # Never let the new shape hide most of an earlier one.
            if any(np.count_nonzero(v & ~mask) < MIN_VISIBLE_FRACTION * n for v, n in zip(visible, full_counts)):
                continue
            color = _pick_color(rng, canvas, box)
            canvas[mask] = color
            visible = [v & ~mask for v in visible] + [mask]
            full_counts.append(np.count_nonzero(mask))
            full_boxes.append(box)
            labels.append(label)
            colors.append(color)
            filled_flags.append(filled)
            break

    image = np.clip(np.round(canvas), 0, 255).astype(np.uint8)
    return ShapesExample(
        image=image,
        boxes=np.stack([_extent(v) for v in visible]).astype(np.float32),
        labels=np.asarray(labels, np.int32),
        masks=np.stack(visible),
        colors=np.stack(colors).astype(np.float32),
        filled=np.asarray(filled_flags, bool),
        shape_pixels=np.asarray(full_counts, np.int32),
    )


def _encode_png(image: np.ndarray) -> bytes:
    # In-process PIL beats TFDS's per-example TF graph encoder; the lightest
    # compression keeps generation quick (noise barely compresses anyway).
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def config_name(num_train: int, num_eval: int, image_size: int) -> str:
    """Builder config name; it encodes every size so prepared files never mix."""
    return f"n{num_train}_{num_eval}_s{image_size}"


@dataclasses.dataclass(eq=False)
class SyntheticShapesConfig(tfds.core.BuilderConfig):
    """Split sizes (examples) and image side (pixels) of one prepared variant."""

    num_train_examples: int = 4096
    num_eval_examples: int = 256
    image_size: int = 128

    @classmethod
    def make(cls, num_train_examples: int, num_eval_examples: int, image_size: int) -> SyntheticShapesConfig:
        return cls(
            name=config_name(num_train_examples, num_eval_examples, image_size),
            description=(
                f"{num_train_examples} train / {num_eval_examples} validation images of {image_size}x{image_size} px"
            ),
            num_train_examples=num_train_examples,
            num_eval_examples=num_eval_examples,
            image_size=image_size,
        )


class SyntheticShapes(tfds.core.GeneratorBasedBuilder):
    """Locally generated shapes detection dataset, named `synthetic_shapes`."""

    # Bump whenever generate_example changes what it draws: prepared files are
    # keyed by config name and version.
    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Initial release.", "1.1.0": "objects/rle: each object's mask (COCO compressed RLE)."}
    BUILDER_CONFIGS = [SyntheticShapesConfig.make(4096, 256, 128)]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS 4.9.10 derives this through `importlib_resources`, which it only
        # declares as a dependency for Python < 3.9, so the lookup fails on 3.11.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        size = self.builder_config.image_size
        return self.dataset_info_from_configs(
            description=__doc__.split("\n\n")[0],
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(size, size, 3), encoding_format="png"),
                    "image/id": np.int64,
                    "objects": tfds.features.Sequence(
                        {
                            "bbox": tfds.features.BBoxFeature(),
                            "label": tfds.features.ClassLabel(names=CLASS_NAMES),
                            "rle": tfds.features.Text(),
                        }
                    ),
                }
            ),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        cfg = self.builder_config
        return {
            "train": self._generate_examples("train", cfg.num_train_examples),
            "validation": self._generate_examples("validation", cfg.num_eval_examples),
        }

    def _generate_examples(self, split: str, num_examples: int):
        size = self.builder_config.image_size
        for index in range(num_examples):
            ex = generate_example(split, index, size)
            rel = ex.boxes.astype(np.float64) / size
            yield (
                index,
                {
                    "image": _encode_png(ex.image),
                    "image/id": index + 1,
                    "objects": [
                        {
                            "bbox": b,
                            "label": int(label),
                            "rle": masks.run_lengths_to_string(masks.run_lengths_of_mask(m)),
                        }
                        for b, label, m in zip(rel, ex.labels, ex.masks)
                    ],
                },
            )

"""Pictures of detections: boxes with class/score tags, side-by-side panels, PNG files.

Pure numpy + PIL, so it runs in any process (no JAX, no accelerator). Boxes
follow the project convention: float ``[N, 4]`` absolute pixels ordered
``(y0, x0, y1, x1)``, where pixel ``(r, c)`` covers ``[r, r+1) x [c, c+1)``.
A box is outlined on the outermost pixel rows/columns it covers, so the
integer box ``(10, 20, 30, 40)`` gets its outline on rows 10 and 29 and
columns 20 and 39, ``line_width`` pixels thick growing inwards.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping, Sequence

import numpy as np
from etils import epath
from PIL import Image, ImageDraw, ImageFont

# Distinct, saturated colours (Tableau 10 followed by a second set of strong
# hues), none close to black or white so outlines show on dark and light images.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (255, 215, 0),
    (0, 128, 128),
    (220, 20, 160),
    (106, 61, 154),
    (0, 200, 120),
    (255, 80, 80),
    (70, 130, 255),
    (160, 82, 45),
    (154, 205, 50),
    (255, 160, 122),
)

_COLOR_BY = ("label", "instance")
# Tag text switches from white to black above this luma (ITU-R BT.601 weights),
# the point where black text has the better contrast on the tag's colour.
_LIGHT_BACKGROUND_LUMA = 140.0
_TAG_PADDING = 1  # pixels between the tag's edge and its text
# A mask's fill against the image: the object shows through, the colour says which box it is.
MASK_OPACITY = 0.45


def class_color(label: int) -> tuple[int, int, int]:
    """The ``(r, g, b)`` colour (0-255) of class ``label``; classes beyond the palette wrap around."""
    return PALETTE[int(label) % len(PALETTE)]


def _text_color(background: tuple[int, int, int]) -> tuple[int, int, int]:
    r, g, b = background
    luma = 0.299 * r + 0.587 * g + 0.114 * b
    return (0, 0, 0) if luma > _LIGHT_BACKGROUND_LUMA else (255, 255, 255)


def to_uint8_rgb(image) -> np.ndarray:
    """A new ``[H, W, 3]`` uint8 copy of ``image``.

    Accepts ``[H, W, 3]``, ``[H, W, 1]`` or ``[H, W]`` (grey is repeated into
    three channels). Integer images are clipped to ``[0, 255]``. Float images
    whose finite values all lie in ``[0, 1]`` are read as ``[0, 1]`` and scaled
    by 255; any other float image is read as ``[0, 255]`` and clipped. NaNs
    become 0 and infinities the nearer end of the range. Mean/std-normalised
    images must be un-normalised by the caller.
    """
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3):
        raise ValueError(f"expected an [H, W, 3], [H, W, 1] or [H, W] image, got shape {array.shape}")
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    if array.dtype == np.uint8:
        return array.copy()
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float64)
        finite = np.isfinite(array)
        if not finite.any() or array[finite].max() <= 1.0:
            array = array * 255.0
        array = np.nan_to_num(array, nan=0.0, posinf=255.0, neginf=0.0)
        return np.clip(np.rint(array), 0, 255).astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        return np.clip(array, 0, 255).astype(np.uint8)
    raise ValueError(f"unsupported image dtype {array.dtype}")


@functools.lru_cache(maxsize=16)
def _default_font(size: int):
    """PIL's built-in font (no file to download); scalable from Pillow 10.1 on."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: only the fixed-size bitmap font
        return ImageFont.load_default()


def _font_size_for(height: int, width: int) -> int:
    # About 1/40 of the shorter side keeps tags legible on thumbnails without
    # covering small objects on full-resolution images.
    return max(10, round(min(height, width) / 40))


def _class_name(label: int, class_names) -> str:
    if class_names is None:
        return str(label)
    if isinstance(class_names, Mapping):
        return str(class_names.get(label, label))
    if 0 <= label < len(class_names):
        return str(class_names[label])
    return str(label)


def _outline_rectangle(box_yxyx: np.ndarray, height: int, width: int) -> tuple[int, int, int, int] | None:
    """Inclusive pixel rectangle ``(left, top, right, bottom)`` of a box clipped to the image, or None."""
    if not np.all(np.isfinite(box_yxyx)):
        return None
    y0, x0, y1, x1 = (float(v) for v in box_yxyx)
    if y1 <= y0 or x1 <= x0:
        return None
    # Last covered pixel of [x0, x1) is ceil(x1) - 1; rounding both ends first
    # keeps sub-pixel jitter of predictions from moving edges by a whole pixel.
    top, left = math.floor(round(y0, 3)), math.floor(round(x0, 3))
    bottom, right = math.ceil(round(y1, 3)) - 1, math.ceil(round(x1, 3)) - 1
    top, left = max(top, 0), max(left, 0)
    bottom, right = min(bottom, height - 1), min(right, width - 1)
    if bottom < top or right < left:
        return None  # empty, or entirely outside the image
    return left, top, right, bottom


def draw_detections(
    image,
    boxes_yxyx,
    labels,
    scores=None,
    class_names: Sequence[str] | Mapping[int, str] | None = None,
    *,
    color_by: str = "label",
    line_width: int = 2,
    font=None,
    masks=None,
    mask_opacity: float = MASK_OPACITY,
) -> np.ndarray:
    """Draws boxes with "name 0.87" tags, and masks filled translucent beneath them, on a copy of ``image``.

    Args:
        image: ``[H, W, 3]`` uint8; float images in ``[0, 1]`` or ``[0, 255]``
            and grey images are converted as :func:`to_uint8_rgb` describes.
        boxes_yxyx: float ``[N, 4]`` absolute pixels ``(y0, x0, y1, x1)``.
            Boxes are clipped to the image; empty (``y1 <= y0`` or
            ``x1 <= x0``), non-finite and fully outside boxes are skipped, so
            the zero boxes of invalid detection slots draw nothing.
        labels: int ``[N]`` contiguous class indices; negative labels are
            padding and skipped.
        scores: float ``[N]`` in ``[0, 1]``, or None for ground truth (tags
            show the name only). Detections with a non-finite score are
            skipped. Higher scores are drawn last, so on top.
        class_names: names indexed by label (a sequence or a mapping); labels
            without a name are shown as their number.
        color_by: ``"label"`` (each class its :func:`class_color`) or
            ``"instance"`` (each box its own palette colour, for telling
            apart overlapping objects of one class).
        line_width: outline thickness in pixels, growing into the box.
        font: a PIL font; by default PIL's built-in font sized to the image.
        masks: bool ``[N, H, W]`` instance masks in the image's pixels (or
            None): each filled with its box's colour at ``mask_opacity``,
            lowest score first, before any outline.
        mask_opacity: the fill's weight against the image, in ``(0, 1]``.

    Returns:
        A new ``[H, W, 3]`` uint8 array; ``image`` is not modified.
    """
    if color_by not in _COLOR_BY:
        raise ValueError(f"color_by must be one of {_COLOR_BY}, got {color_by!r}")
    if line_width < 1:
        raise ValueError(f"line_width must be at least 1, got {line_width}")
    canvas = to_uint8_rgb(image)
    boxes = np.asarray(boxes_yxyx, np.float64).reshape(-1, 4)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if labels.shape[0] != boxes.shape[0]:
        raise ValueError(f"{boxes.shape[0]} boxes but {labels.shape[0]} labels")
    if scores is not None:
        scores = np.asarray(scores, np.float64).reshape(-1)
        if scores.shape[0] != boxes.shape[0]:
            raise ValueError(f"{boxes.shape[0]} boxes but {scores.shape[0]} scores")
    if boxes.shape[0] == 0:
        return canvas

    height, width = canvas.shape[:2]
    if masks is not None:
        masks = np.asarray(masks, bool)
        if masks.shape != (boxes.shape[0], height, width):
            raise ValueError(f"masks {masks.shape} must be [N, H, W] = {(boxes.shape[0], height, width)}")
        if not 0.0 < mask_opacity <= 1.0:
            raise ValueError(f"mask_opacity must be in (0, 1], got {mask_opacity}")
    order = np.arange(boxes.shape[0]) if scores is None else np.argsort(scores, kind="stable")
    to_draw = []
    for index in order:
        label = int(labels[index])
        if label < 0 or (scores is not None and not math.isfinite(scores[index])):
            continue
        rectangle = _outline_rectangle(boxes[index], height, width)
        if rectangle is None:
            continue
        color = class_color(label if color_by == "label" else index)
        text = _class_name(label, class_names)
        if scores is not None:
            text = f"{text} {scores[index]:.2f}"
        to_draw.append((rectangle, color, text))
        if masks is not None:
            # Lowest score first, so a better detection's fill lies over a worse one's.
            fill = masks[index]
            canvas[fill] = np.round(
                (1.0 - mask_opacity) * canvas[fill] + mask_opacity * np.asarray(color, np.float64)
            ).astype(np.uint8)
    if not to_draw:
        return canvas

    pil_image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(pil_image)
    if font is None:
        font = _default_font(_font_size_for(height, width))
    # All outlines before any tag, so no box edge crosses another box's text.
    for rectangle, color, _ in to_draw:
        draw.rectangle(rectangle, outline=color, width=line_width)
    for (left, top, _, _), color, text in to_draw:
        text_left, text_top, text_right, text_bottom = draw.textbbox((0, 0), text, font=font)
        tag_width = text_right - text_left + 2 * _TAG_PADDING
        tag_height = text_bottom - text_top + 2 * _TAG_PADDING
        # Above the box when it fits, else just inside its top edge; shifted
        # left where needed so the whole tag stays inside the image.
        tag_top = top - tag_height if top - tag_height >= 0 else top
        tag_top = max(0, min(tag_top, height - tag_height))
        tag_left = max(0, min(left, width - tag_width))
        draw.rectangle((tag_left, tag_top, tag_left + tag_width - 1, tag_top + tag_height - 1), fill=color)
        draw.text(
            (tag_left + _TAG_PADDING - text_left, tag_top + _TAG_PADDING - text_top),
            text,
            fill=_text_color(color),
            font=font,
        )
    return np.asarray(pil_image, np.uint8).copy()


def side_by_side(left, right, *, gap: int = 4) -> np.ndarray:
    """``left | right`` as one ``[max(H_l, H_r), W_l + gap + W_r, 3]`` uint8 image.

    For "prediction | ground truth" panels. The shorter image is padded at the
    bottom; padding and the ``gap`` pixel wide separator are white. Inputs are
    converted as :func:`to_uint8_rgb` describes.
    """
    if gap < 0:
        raise ValueError(f"gap must be non-negative, got {gap}")
    left, right = to_uint8_rgb(left), to_uint8_rgb(right)
    height = max(left.shape[0], right.shape[0])
    panel = np.full((height, left.shape[1] + gap + right.shape[1], 3), 255, np.uint8)
    panel[: left.shape[0], : left.shape[1]] = left
    panel[: right.shape[0], left.shape[1] + gap :] = right
    return panel


def save_png(image, path) -> epath.Path:
    """Writes ``image`` (converted as :func:`to_uint8_rgb` describes) as a PNG file.

    ``path`` may be any location ``etils.epath`` can write (local or e.g.
    ``gs://``); missing parent directories are created. Returns the path.
    """
    path = epath.Path(path)
    buffer = io.BytesIO()
    Image.fromarray(to_uint8_rgb(image)).save(buffer, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def prediction_panels(
    batch: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    *,
    class_names=None,
    score_threshold: float = 0.3,
) -> np.ndarray:
    """ "predictions | ground truth" pictures of a batch as the network saw it.

    Args:
      batch: host numpy of an eval batch: image uint8 `[B, H, W, 3]`,
        image_hw `[B, 2]`, boxes `[B, M, 4]` yxyx network pixels, labels /
        boxes_mask `[B, M]`, example_mask `[B]`.
      outputs: `steps.predict_step`'s outputs for it (boxes in network pixels).
      score_threshold: predictions below it are not drawn.
    Returns:
      uint8 `[N, H', W' * 2 + gap, 3]`, one panel per real example, cropped to
      the resized image (no padding).
    """
    panels = []
    for i in np.flatnonzero(batch["example_mask"]):
        height, width = (max(1, int(v)) for v in batch["image_hw"][i])
        image = np.asarray(batch["image"][i, :height, :width], np.uint8)
        keep = outputs["valid"][i] & (outputs["scores"][i] >= score_threshold)
        predicted = draw_detections(
            image, outputs["boxes"][i][keep], outputs["classes"][i][keep], outputs["scores"][i][keep], class_names
        )
        real = batch["boxes_mask"][i]
        truth = draw_detections(image, batch["boxes"][i][real], batch["labels"][i][real], None, class_names)
        panels.append(side_by_side(predicted, truth))
    if not panels:
        return np.zeros((0, 1, 1, 3), np.uint8)
    height = max(p.shape[0] for p in panels)
    width = max(p.shape[1] for p in panels)
    padded = np.full((len(panels), height, width, 3), 255, np.uint8)
    for padded_panel, panel in zip(padded, panels):
        padded_panel[: panel.shape[0], : panel.shape[1]] = panel
    return padded

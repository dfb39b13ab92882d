"""Box-aware per-example transforms (pure TF functions, static output shapes).

Conventions used throughout the project:
  * images are RGB, height x width;
  * boxes are float32 [N, 4] y0, x0, y1, x1 in absolute pixels, where pixel
    (i, j) covers [i, i+1) x [j, j+1), so y1/x1 are exclusive pixel edges
    and a box [0, 0, H, W] covers a whole H x W image;
  * labels are contiguous int32 class indices, -1 marks padding.

With that convention, resizing an image by per-axis factors (sy, sx) maps a
box exactly by multiplying its coordinates by (sy, sx, sy, sx) (TF2 resize
uses half-pixel centres), and mirroring a width-W image maps x to W - x.

Random transforms use stateless ops with an explicit int [2] seed, so the
output is a pure function of (example, seed).

Training augmentation is large-scale jitter (LSJ): random flip, resize by a
random factor of the fit-to-target scale, random crop / zero pad to the
target, optional colour jitter; boxes follow the pixels through every step.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from input_pipeline import batch as batch_layout
from input_pipeline import box_geometry, masks
from input_pipeline.dataset_errors import DatasetError


@dataclasses.dataclass(frozen=True)
class TransformOptions:
    """Static transform settings (units in the attribute comments).

    Attributes:
      image_size: (H, W) network input size, pixels.
      max_boxes: boxes per example after padding/truncation.
      scale_jitter: (min, max) random factor on the fit-to-target scale.
      horizontal_flip: whether training flips with probability 1/2.
      min_box_size: boxes smaller than this (pixels, either side) after
        crop/clip are dropped in training.
      min_visible_fraction: in training, a box whose visible (clipped) area is
        less than this fraction of its area before clipping (both after the
        resize) is dropped; in [0, 1], 0 keeps every non-empty box.
      color_jitter: colour jitter strength in [0, 1] (0 = off); see
        random_color_jitter.
      resize_on_device: training ships the decoded pixels a crop window
        needs, with the geometry that maps them to it, and the jitted step
        resizes and mirrors them (`detector.ops.images.resample_images`);
        windows whose source region does not fit in source_size are still
        resized on the host. Needs color_jitter 0 (the jitter acts on the
        resized pixels).
      source_size: (H', W') of training images with resize_on_device, at
        least image_size: the largest source region shipped as it is.
      mask_stride: training examples carry each box's mask in the network
        geometry at this stride (network pixels per cell), bit-packed; 0 for
        none. The examples then need 'mask_run_lengths'.
    """

    image_size: tuple[int, int]
    max_boxes: int
    scale_jitter: tuple[float, float] = (1.0, 1.0)
    horizontal_flip: bool = True
    min_box_size: float = 0.0
    min_visible_fraction: float = 0.0
    color_jitter: float = 0.0
    resize_on_device: bool = False
    source_size: tuple[int, int] | None = None
    mask_stride: int = 0

    @property
    def training_image_size(self) -> tuple[int, int]:
        """(H, W) of the training examples' `image`: source_size with resize_on_device, else image_size."""
        return batch_layout.training_image_size(self)

    @classmethod
    def from_config(cls, config) -> TransformOptions:
        inp = config.input
        size = tuple(int(v) for v in inp.image_size)
        jitter = tuple(float(v) for v in inp.scale_jitter)
        if len(size) != 2 or min(size) <= 0:
            raise DatasetError(f"input.image_size must be (H, W) > 0, got {size}")
        if len(jitter) != 2 or not 0 < jitter[0] <= jitter[1]:
            raise DatasetError(f"input.scale_jitter must be 0 < min <= max, got {jitter}")
        min_visible = float(inp.min_visible_fraction)
        color_jitter = float(inp.color_jitter)
        for name, value in (("min_visible_fraction", min_visible), ("color_jitter", color_jitter)):
            if not 0.0 <= value <= 1.0:  # Also rejects NaN.
                raise DatasetError(f"input.{name} must be in [0, 1], got {value}")
        resize_on_device = bool(inp.resize_on_device)
        if resize_on_device and color_jitter > 0:
            raise DatasetError(
                f"input.color_jitter={color_jitter} needs the host to resize: set input.resize_on_device=False, "
                "or input.color_jitter=0"
            )
        source_size = None if inp.source_size is None else tuple(int(v) for v in inp.source_size)
        if source_size is not None and not resize_on_device:
            raise DatasetError(
                f"input.source_size={source_size} applies only with input.resize_on_device=True; set "
                "that, or input.source_size=None"
            )
        if source_size is not None and (len(source_size) != 2 or source_size[0] < size[0] or source_size[1] < size[1]):
            raise DatasetError(
                f"input.source_size={source_size} must be (H, W) at least input.image_size={size} (or None: the same)"
            )
        mask_stride = int(inp.mask_stride)
        if mask_stride < 0:
            raise DatasetError(f"input.mask_stride must be >= 0 (0: no masks), got {mask_stride}")
        return cls(
            mask_stride=mask_stride,
            image_size=size,
            max_boxes=int(inp.max_boxes),
            scale_jitter=jitter,
            horizontal_flip=bool(inp.horizontal_flip),
            min_box_size=float(inp.min_box_size),
            min_visible_fraction=min_visible,
            color_jitter=color_jitter,
            resize_on_device=resize_on_device,
            source_size=source_size,
        )


def decode_example(example: dict, *, drop_crowd: bool = False) -> dict:
    """TFDS COCO-layout example -> common source example.

    Args:
      example: {'image': encoded string or uint8 [h, w, C], 'image/id': int,
        'objects': {'bbox': float [N, 4] normalized y0, x0, y1, x1,
        'label': int [N], optional 'is_crowd': bool [N]}}.
      drop_crowd: drop boxes whose `objects/is_crowd` is True (if present).

    Returns:
      {'image': uint8 [h, w, 3], 'boxes': float32 [N, 4] absolute pixels,
       'labels': int32 [N], 'image_id': int32 []}.
    """
    image = example["image"]
    if image.dtype == tf.string:
        image = tf.io.decode_image(image, channels=3, dtype=tf.uint8, expand_animations=False)
    elif image.shape.rank == 3 and image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    image = tf.ensure_shape(tf.cast(image, tf.uint8), [None, None, 3])
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    objects = example["objects"]
    boxes = tf.reshape(tf.cast(objects["bbox"], tf.float32), [-1, 4])
    boxes = boxes * tf.tile(shape, [2])[None, :]
    labels = tf.cast(objects["label"], tf.int32)
    if drop_crowd and "is_crowd" in objects:
        keep = tf.logical_not(tf.cast(objects["is_crowd"], tf.bool))
        boxes = tf.boolean_mask(boxes, keep)
        labels = tf.boolean_mask(labels, keep)
    return {
        "image": image,
        "boxes": boxes,
        "labels": labels,
        "image_id": tf.cast(example["image/id"], tf.int32),
    }


def flip_boxes_left_right(boxes: tf.Tensor, width) -> tf.Tensor:
    """Mirrors float32 [N, 4] boxes of an image `width` pixels wide."""
    y0, x0, y1, x1 = tf.unstack(boxes, axis=-1)
    width = tf.cast(width, boxes.dtype)
    return tf.stack([y0, width - x1, y1, width - x0], axis=-1)


def _flip_drawn(seed: tf.Tensor) -> tf.Tensor:
    """bool []: whether the example with this flip seed is mirrored (probability 1/2)."""
    return tf.random.stateless_uniform([], seed) < 0.5


def random_horizontal_flip(image: tf.Tensor, boxes: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Flips image [h, w, C] and boxes [N, 4] together with probability 1/2."""
    do_flip = _flip_drawn(seed)
    width = tf.shape(image)[1]
    image = tf.cond(do_flip, lambda: tf.image.flip_left_right(image), lambda: image)
    boxes = tf.cond(do_flip, lambda: flip_boxes_left_right(boxes, width), lambda: boxes)
    return image, boxes


def to_pixels(image: tf.Tensor) -> tf.Tensor:
    """float32 image in [0, 255] -> uint8, rounded to the nearest grey level (halves up): what the batch carries.

    One pass instead of round, clip and cast: every producer here stays in
    [0, 255] (bilinear and triangle weights are non-negative and sum to 1,
    colour jitter clips), and a cast truncates, so adding 0.5 rounds.
    """
    return tf.cast(image + 0.5, tf.uint8)


# Folded into the example seed for the colour jitter, so the four geometric
# sub-seeds (and outputs with color_jitter=0) do not depend on it.
_COLOR_SEED_TAG = 0x636F6C


def _blend(image: tf.Tensor, other: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """factor * image + (1 - factor) * other, clipped to [0, 255]."""
    return tf.clip_by_value(other + factor * (image - other), 0.0, 255.0)


def random_color_jitter(image: tf.Tensor, seed: tf.Tensor, strength: float) -> tf.Tensor:
    """Random brightness, contrast and saturation (detectron2-style), in order.

    Each factor is uniform in [1 - 0.4 * strength, 1 + 0.4 * strength]:
    brightness scales the pixels, contrast blends with the image's mean grey
    level, saturation blends with each pixel's grey level (ITU-R 601 luma);
    the result is clipped to [0, 255] after each step. Pure function of
    (image, seed, strength); strength 0 returns `image` unchanged.

    Args:
      image: float32 [h, w, 3] RGB, 0-255 units.
      seed: int32/int64 [2] stateless seed.
      strength: Python float in [0, 1].

    Returns:
      float32 [h, w, 3] RGB in [0, 255].
    """
    strength = float(strength)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"color jitter strength must be in [0, 1], got {strength}")
    if strength == 0.0:
        return image
    image = tf.cast(image, tf.float32)
    lo, hi = 1.0 - 0.4 * strength, 1.0 + 0.4 * strength
    seeds = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
    brightness, contrast, saturation = (tf.random.stateless_uniform([], s, lo, hi) for s in seeds)
    image = tf.clip_by_value(image * brightness, 0.0, 255.0)
    grey = tf.tensordot(image, tf.constant([0.299, 0.587, 0.114]), 1)[..., None]
    image = _blend(image, tf.reduce_mean(grey), contrast)
    grey = tf.tensordot(image, tf.constant([0.299, 0.587, 0.114]), 1)[..., None]
    return _blend(image, grey, saturation)


def _resize(image: tf.Tensor, scale: tf.Tensor, max_size=None):
    """Resizes by `scale` (rounded to whole pixels); float32 image, new (h, w)."""
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    new_hw = tf.maximum(tf.cast(tf.round(hw * scale), tf.int32), 1)
    if max_size is not None:
        new_hw = tf.minimum(new_hw, tf.constant(max_size, tf.int32))
    # Antialiasing matters when large photos are shrunk to network size.
    image = tf.image.resize(image, new_hw, method=tf.image.ResizeMethod.BILINEAR, antialias=True)
    return image, new_hw


# Resizing the whole image and cropping beats resizing only the window while
# the whole is at most this many times the window: the bilinear kernel costs
# about a third of the general one per pixel (a 640x480 JPEG to 1536x1152,
# cropped to 1024x1024: 10.5 ms against 18.8 ms on one core).
_WHOLE_RESIZE_MAX_AREA_RATIO = 2.0


def _resize_window(image: tf.Tensor, new_hw: tf.Tensor, offset_yx: tf.Tensor, window_hw: tf.Tensor) -> tf.Tensor:
    """The window [offset, offset + window) of `image` resized to `new_hw`.

    Equals resizing the whole image (bilinear, antialiased, as _resize) and
    cropping, but computes only the window's pixels: with large-scale jitter
    the resized image can be 4x the crop, and resizing it all dominated the
    pipeline's time. When both axes grow and the whole resized image is not
    much larger than the window, it does resize the whole image, with the
    plain bilinear kernel: upscaled, the antialiased triangle kernel is the
    bilinear one (a 1-pixel radius, half-pixel centres, edge pixels
    repeated), so the pixels are the same to float rounding, and that kernel
    is about 3x cheaper per pixel.

    Args:
      image: uint8 or float32 [h, w, C].
      new_hw: int32 [2], the size of the whole resized image.
      offset_yx: int32 [2], the window's top-left in the resized image.
      window_hw: int32 [2], the window's size, inside the resized image.

    Returns:
      float32 [window_h, window_w, C], 0-255 units.
    """
    hw = tf.shape(image)[:2]

    def whole_then_crop():
        resized = tf.raw_ops.ResizeBilinear(images=image[None], size=new_hw, half_pixel_centers=True)[0]
        return tf.slice(resized, tf.concat([offset_yx, [0]], 0), tf.concat([window_hw, [-1]], 0))

    def window_only():
        window = tf.raw_ops.ScaleAndTranslate(
            images=image[None],  # uint8 in, float32 out: no float copy of the whole source image
            size=window_hw,
            scale=tf.cast(new_hw, tf.float32) / tf.cast(hw, tf.float32),
            translation=-tf.cast(offset_yx, tf.float32),
            kernel_type="triangle",
            antialias=True,
        )
        return window[0]

    new_area = tf.cast(tf.reduce_prod(new_hw), tf.float32)
    window_area = tf.cast(tf.reduce_prod(window_hw), tf.float32)
    upscaled = tf.reduce_all(new_hw >= hw)
    cheap_whole = upscaled & (new_area <= _WHOLE_RESIZE_MAX_AREA_RATIO * window_area)
    return tf.cond(cheap_whole, whole_then_crop, window_only)


def _source_region(source_hw: tf.Tensor, axis_scale: tf.Tensor, offset_yx: tf.Tensor, window_hw: tf.Tensor):
    """The source rows and columns [start, stop) that a crop window's pixels sample (the mirrored image's, if flipped).

    Window pixel o (a resized-image pixel o + offset) samples the source at
    s = (o + offset + 0.5) / scale with support max(1 / scale, 1) either
    side (the antialiased triangle kernel); one pixel more each side keeps
    float rounding from dropping a pixel of non-zero weight. Inside the
    region, each window pixel sees exactly the pixels it would see in the
    whole image, and a region edge that is not the image's own is never
    reached by the kernel.

    Args:
      source_hw: int32 [2] (h, w) of the source image.
      axis_scale: float32 [2] resized px per source px.
      offset_yx: int32 [2] the window's top-left in the resized image.
      window_hw: int32 [2] the window's size.

    Returns:
      int32 [2] start and int32 [2] stop, within [0, source_hw].
    """
    support = tf.maximum(1.0 / axis_scale, 1.0)
    first_sample = (tf.cast(offset_yx, tf.float32) + 0.5) / axis_scale
    last_sample = (tf.cast(offset_yx + window_hw, tf.float32) - 0.5) / axis_scale
    start = tf.maximum(tf.cast(tf.floor(first_sample - support - 0.5), tf.int32) - 1, 0)
    stop = tf.minimum(tf.cast(tf.math.ceil(last_sample + support - 0.5), tf.int32) + 2, source_hw)
    return start, stop


def pad_bottom_right(image: tf.Tensor, size) -> tf.Tensor:
    """uint8 [h, w, 3] at the top-left of a zero [H, W, 3] (h <= H, w <= W).

    Pads rows of h x 3w bytes: TensorFlow's 3-D pad of a uint8 image is
    about 7x slower (2.6 ms against 0.4 ms for 480x640 to 1024x1024 on one
    core), a cost every training image paid.
    """
    height, width = size
    h, w = tf.shape(image)[0], tf.shape(image)[1]
    rows = tf.pad(tf.reshape(image, [h, w * 3]), [[0, height - h], [0, (width - w) * 3]])
    return tf.reshape(rows, [height, width, 3])


def drop_small_boxes(boxes: tf.Tensor, labels: tf.Tensor, min_size: float) -> tuple[tf.Tensor, tf.Tensor]:
    """Keeps boxes whose height and width are > 0 and >= min_size pixels."""
    h = boxes[:, 2] - boxes[:, 0]
    w = boxes[:, 3] - boxes[:, 1]
    keep = (h > 0) & (w > 0) & (h >= min_size) & (w >= min_size)
    return tf.boolean_mask(boxes, keep), tf.boolean_mask(labels, keep)


def drop_hidden_boxes(
    boxes: tf.Tensor, clipped_boxes: tf.Tensor, labels: tf.Tensor, min_visible_fraction: float
) -> tuple[tf.Tensor, tf.Tensor]:
    """Drops boxes mostly cut off by a crop.

    Args:
      boxes: float32 [N, 4] boxes before clipping to the visible window.
      clipped_boxes: float32 [N, 4] the same boxes after clipping (same units).
      labels: int32 [N].
      min_visible_fraction: keep a box iff area(clipped) >= this fraction of
        area(boxes).

    Returns:
      The kept clipped boxes [M, 4] and their labels [M].
    """
    keep = box_geometry.area(clipped_boxes, xp=tf) >= min_visible_fraction * box_geometry.area(boxes, xp=tf)
    return tf.boolean_mask(clipped_boxes, keep), tf.boolean_mask(labels, keep)


def pad_boxes(boxes: tf.Tensor, labels: tf.Tensor, max_boxes: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Keeps the first max_boxes boxes and pads to exactly max_boxes.

    Returns:
      boxes float32 [max_boxes, 4] (zeros as padding), labels int32
      [max_boxes] (-1 as padding), mask bool [max_boxes] (True = real box).
    """
    boxes = boxes[:max_boxes]
    labels = labels[:max_boxes]
    n = tf.shape(boxes)[0]
    boxes = tf.pad(boxes, [[0, max_boxes - n], [0, 0]])
    labels = tf.pad(labels, [[0, max_boxes - n]], constant_values=-1)
    mask = tf.range(max_boxes) < n
    return (
        tf.ensure_shape(boxes, [max_boxes, 4]),
        tf.ensure_shape(labels, [max_boxes]),
        tf.ensure_shape(mask, [max_boxes]),
    )


def _clip_boxes(boxes: tf.Tensor, height, width) -> tf.Tensor:
    """float32 [N, 4] boxes clipped to a height x width (int pixels) image."""
    return box_geometry.clip(boxes, tf.cast(height, tf.float32), tf.cast(width, tf.float32), xp=tf)


def _identity_geometry(image_hw: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(source_hw, source_to_image, source_flipped) of pixels the host already resized: nothing left to do."""
    return image_hw, tf.constant(batch_layout.IDENTITY_GEOMETRY), tf.constant(False)


def _finish(
    image,
    image_hw,
    boxes,
    labels,
    image_id,
    scale,
    original_hw,
    source,
    opts: TransformOptions,
    canvas_size,
    instance_masks=None,
) -> dict:
    """The example's dict; `instance_masks` (bool [k, Hm, Wm] cells, bool [k] valid) are the first k <= max_boxes
    boxes' masks, unpacked: the public transforms pack them (`_packed`)."""
    truncated = tf.shape(boxes)[0] > opts.max_boxes
    boxes, labels, mask = pad_boxes(boxes, labels, opts.max_boxes)
    source_hw, source_to_image, source_flipped = source
    extra = {}
    if instance_masks is not None:
        cells, valid = instance_masks
        cells, valid = cells[: opts.max_boxes], valid[: opts.max_boxes]
        missing = opts.max_boxes - tf.shape(valid)[0]
        grid = batch_layout.mask_grid(opts.image_size, opts.mask_stride)
        extra = {
            "masks": tf.ensure_shape(tf.pad(cells, [[0, missing], [0, 0], [0, 0]]), [opts.max_boxes, *grid]),
            "masks_valid": tf.ensure_shape(tf.pad(valid, [[0, missing]]), [opts.max_boxes]),
        }
    return {
        **extra,
        "image": tf.ensure_shape(pad_bottom_right(image, canvas_size), [*canvas_size, 3]),
        "image_hw": tf.ensure_shape(tf.cast(image_hw, tf.int32), [2]),
        "source_hw": tf.ensure_shape(tf.cast(source_hw, tf.int32), [2]),
        "source_to_image": tf.ensure_shape(source_to_image, [4]),
        "source_flipped": tf.ensure_shape(source_flipped, []),
        "boxes": boxes,
        "labels": labels,
        "boxes_mask": mask,
        "boxes_truncated": tf.ensure_shape(truncated, []),
        "image_id": tf.cast(image_id, tf.int32),
        "scale": tf.cast(scale, tf.float32),
        "original_size": tf.cast(original_hw, tf.int32),
        "example_mask": tf.constant(True),
    }


def _packed(example: dict) -> dict:
    """The example with its mask cells bit-packed for the batch (`batch_layout.MASK_FIELDS`)."""
    if "masks" in example:
        example = {**example, "masks": masks.pack_bits(example["masks"])}
    return example


def _instance_masks(run_lengths: tf.RaggedTensor, original_hw: tf.Tensor, kept: tf.Tensor, rows, columns):
    """(bool [k, Hm, Wm] cells, bool [k] valid) of the `kept` instances' masks at the cells' original pixels.

    A mask is valid when it has runs covering exactly the original image
    (preparation checks this too; a mismatch here trains the box alone).
    """
    chosen = tf.gather(run_lengths, kept)
    pixels = tf.cast(original_hw[0], tf.int64) * tf.cast(original_hw[1], tf.int64)
    valid = (chosen.row_lengths() > 0) & (tf.reduce_sum(chosen, axis=1) == pixels)
    cells = masks.sample_masks(chosen, original_hw[0], rows, columns)
    return cells & valid[:, None, None], valid


def train_transform(example: dict, seed: tf.Tensor, opts: TransformOptions) -> dict:
    """LSJ: random flip, scale jitter, crop/pad to opts.image_size, colour.

    The image is resized so it fits (H, W) times a random factor from
    opts.scale_jitter (aspect kept), then a random (H, W) window is cropped
    where it is larger and zeros are padded bottom/right where it is
    smaller. With opts.color_jitter > 0 the visible pixels get
    random_color_jitter. Pixels stay uint8 0-255 (rounded after the resize
    and the jitter); the steps normalise them on the device. With
    opts.resize_on_device, 'image' instead holds the source pixels the
    window samples, unflipped and not resized, whenever they fit in
    image_size (else the host resizes as without it); 'source_hw',
    'source_to_image' and 'source_flipped' say how the train step maps them
    onto the window (`detector.ops.images.resample_images`), to the same
    pixels up to the host's rounding to uint8. Boxes follow the pixels exactly, are
    clipped to the visible image, and are dropped when less than
    opts.min_visible_fraction of their area is visible or when smaller than
    opts.min_box_size; the first max_boxes survivors are kept.

    Args:
      example: decode_example() output.
      seed: int32/int64 [2] stateless seed of this example.
      opts: static settings.

    Returns:
      {'image': uint8 [H, W, 3] RGB (zeros in the padding), 'image_hw':
       int32 [2] (h, w) of the network image at the top-left, 'source_hw':
       int32 [2] (h, w) of the pixels in 'image', 'source_to_image': float32
       [4] (scale_y, scale_x, offset_y, offset_x), 'source_flipped': bool []
       (the identity geometry, (h, w) = image_hw, when the host resized),
       'boxes': float32 [max_boxes, 4] y0, x0, y1, x1 in network
       pixels (zeros as padding), 'labels': int32 [max_boxes] (-1 as padding),
       'boxes_mask': bool [max_boxes] (True = real box), 'boxes_truncated':
       bool [] (True when more than max_boxes boxes survived and the rest were
       cut), 'image_id': int32 [], 'scale': float32 [] (network px per
       original px), 'original_size': int32 [2] (h, w) original pixels,
       'example_mask': bool [] (True)}; with opts.mask_stride, 'masks':
       uint8 [max_boxes, Hm, ceil(Wm / 8)] each kept box's mask cells
       bit-packed and 'masks_valid': bool [max_boxes] (`batch_layout`), from
       the example's 'mask_run_lengths' (int64 RaggedTensor [n, (runs)], one
       row per box).
    """
    return _packed(_train_transform(example, seed, opts))


def _train_transform(example: dict, seed: tf.Tensor, opts: TransformOptions) -> dict:
    """`train_transform` with the mask cells unpacked (a mosaic's tiles are placed before packing)."""
    out_h, out_w = opts.image_size
    flip_seed, scale_seed, crop_y_seed, crop_x_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 4))
    image, boxes, labels = example["image"], example["boxes"], example["labels"]
    original_hw = tf.shape(image)[:2]
    flipped = _flip_drawn(flip_seed) if opts.horizontal_flip else tf.constant(False)
    if opts.horizontal_flip:
        boxes = tf.cond(flipped, lambda: flip_boxes_left_right(boxes, original_hw[1]), lambda: boxes)

    hw = tf.cast(original_hw, tf.float32)
    fit = tf.minimum(out_h / hw[0], out_w / hw[1])
    lo, hi = opts.scale_jitter
    factor = tf.random.stateless_uniform([], scale_seed, lo, hi) if hi > lo else (tf.constant(lo, tf.float32))
    scale = fit * factor
    new_hw = tf.maximum(tf.cast(tf.round(hw * scale), tf.int32), 1)
    # Per-axis factors of the whole-pixel size actually produced, so boxes stay
    # on the resized pixels.
    axis_scale = tf.cast(new_hw, tf.float32) / hw
    boxes = boxes * tf.tile(axis_scale, [2])[None, :]

    # Random crop offsets (zero where the image is smaller than the target).
    off_y = tf.random.stateless_uniform([], crop_y_seed, 0, tf.maximum(new_hw[0] - out_h, 0) + 1, dtype=tf.int32)
    off_x = tf.random.stateless_uniform([], crop_x_seed, 0, tf.maximum(new_hw[1] - out_w, 0) + 1, dtype=tf.int32)
    visible_h = tf.minimum(new_hw[0] - off_y, out_h)
    visible_w = tf.minimum(new_hw[1] - off_x, out_w)
    offset_yx, window_hw = tf.stack([off_y, off_x]), tf.stack([visible_h, visible_w])

    def resized_on_host():
        mirrored = tf.cond(flipped, lambda: tf.reverse(image, [1]), lambda: image)
        window = _resize_window(mirrored, new_hw, offset_yx, window_hw)
        if opts.color_jitter > 0:
            color_seed = tf.random.experimental.stateless_fold_in(seed, _COLOR_SEED_TAG)
            window = random_color_jitter(window, color_seed, opts.color_jitter)
        return (to_pixels(window), *_identity_geometry(window_hw))

    if opts.resize_on_device:
        start, stop = _source_region(original_hw, axis_scale, offset_yx, window_hw)
        region_hw = stop - start

        def resized_on_device():
            # Columns of the mirrored image [start, stop) are the original's [w - stop, w - start).
            first_column = tf.where(flipped, original_hw[1] - stop[1], start[1])
            region = tf.slice(image, tf.stack([start[0], first_column, 0]), tf.stack([region_hw[0], region_hw[1], -1]))
            offset = tf.cast(start, tf.float32) * axis_scale - tf.cast(offset_yx, tf.float32)
            return region, region_hw, tf.concat([axis_scale, offset], 0), flipped

        fits = tf.reduce_all(region_hw <= tf.constant(opts.training_image_size, tf.int32))
        pixels, *source = tf.cond(fits, resized_on_device, resized_on_host)
    else:
        pixels, *source = resized_on_host()
    offset = tf.cast(tf.stack([off_y, off_x, off_y, off_x]), tf.float32)
    boxes = boxes - offset[None, :]
    clipped = _clip_boxes(boxes, visible_h, visible_w)
    if opts.mask_stride:  # each box's instance index rides along with its label through the drops
        labels = tf.stack([labels, tf.range(tf.shape(labels)[0])], axis=1)
    if opts.min_visible_fraction > 0:
        boxes, labels = drop_hidden_boxes(boxes, clipped, labels, opts.min_visible_fraction)
    else:
        boxes = clipped
    boxes, labels = drop_small_boxes(boxes, labels, opts.min_box_size)
    instance_masks = None
    if opts.mask_stride:
        labels, kept = labels[:, 0], labels[:, 1]
        grid = batch_layout.mask_grid(opts.image_size, opts.mask_stride)
        rows, columns = masks.network_sample_grid(
            original_hw, axis_scale, offset_yx, window_hw, flipped, grid, opts.mask_stride
        )
        instance_masks = _instance_masks(
            example["mask_run_lengths"], original_hw, kept[: opts.max_boxes], rows, columns
        )
    canvas_size = opts.training_image_size
    return _finish(
        pixels,
        window_hw,
        boxes,
        labels,
        example["image_id"],
        scale,
        original_hw,
        source,
        opts,
        canvas_size,
        instance_masks,
    )


_MOSAIC_SEED_TAG = 0x4D4F53  # "MOS": the tiles' seeds, apart from every other draw of the example's seed


def mosaic_transform(examples: list[dict], seed: tf.Tensor, opts: TransformOptions) -> dict:
    """Four examples tiled 2 x 2 into one: DEIM's dense one-to-one input (more boxes per image).

    Tile i (row-major: top-left, top-right, bottom-left, bottom-right) is
    `train_transform` of examples[i] at the tile's size (half the target,
    the bottom and right tiles taking an odd pixel), with its own seed drawn
    from `seed`: flip, scale jitter, crop or pad, colour, box dropping as
    any training example. Boxes are moved with their tile; the first
    opts.max_boxes in tile order are kept (`boxes_truncated` when more were).
    The pixels are resized on the host whatever opts.resize_on_device says
    (the identity geometry), on the same canvas as `train_transform`'s.
    image_id, scale and original_size are the top-left tile's.

    Returns: `train_transform`'s dict, of the same shapes.
    """
    if len(examples) != 4:
        raise ValueError(f"a mosaic takes 4 examples, got {len(examples)}")
    out_h, out_w = opts.image_size
    heights, widths = (out_h // 2, out_h - out_h // 2), (out_w // 2, out_w - out_w // 2)
    stride = opts.mask_stride
    if stride and (heights[0] % stride or widths[0] % stride):
        raise DatasetError(
            f"mosaics with masks need input.image_size={opts.image_size} to be a multiple of twice "
            f"input.mask_stride={stride}, so the tiles' mask cells line up; change either"
        )
    tile_seeds = tf.unstack(
        tf.random.experimental.stateless_split(tf.random.experimental.stateless_fold_in(seed, _MOSAIC_SEED_TAG), 4)
    )
    tiles_out, tiles, boxes, labels, real = [], [], [], [], []
    cells, valid = [], []
    truncated = tf.constant(False)
    grid = batch_layout.mask_grid(opts.image_size, stride) if stride else None
    for i, (example, tile_seed) in enumerate(zip(examples, tile_seeds)):
        row, column = divmod(i, 2)
        tile_opts = dataclasses.replace(
            opts, image_size=(heights[row], widths[column]), resize_on_device=False, source_size=None
        )
        tile = _train_transform(example, tile_seed, tile_opts)
        tiles_out.append(tile)
        tiles.append(tile["image"])
        offset = tf.constant([row * heights[0], column * widths[0]] * 2, tf.float32)
        boxes.append(tile["boxes"] + offset[None, :])
        labels.append(tile["labels"])
        real.append(tile["boxes_mask"])
        truncated = truncated | tile["boxes_truncated"]
        if stride:  # the tile's cells moved to its place on the canvas's grid
            top, left = row * heights[0] // stride, column * widths[0] // stride
            tile_rows, tile_columns = tile["masks"].shape[1:]
            placement = [[0, 0], [top, grid[0] - top - tile_rows], [left, grid[1] - left - tile_columns]]
            cells.append(tf.pad(tile["masks"], placement))
            valid.append(tile["masks_valid"])
    image = tf.concat([tf.concat(tiles[:2], axis=1), tf.concat(tiles[2:], axis=1)], axis=0)
    mask = tf.concat(real, axis=0)
    kept_boxes, kept_labels = tf.boolean_mask(tf.concat(boxes, 0), mask), tf.boolean_mask(tf.concat(labels, 0), mask)
    instance_masks = None
    if stride:
        instance_masks = (tf.boolean_mask(tf.concat(cells, 0), mask), tf.boolean_mask(tf.concat(valid, 0), mask))
    first = tiles_out[0]
    out = _finish(
        image,
        tf.constant([out_h, out_w], tf.int32),
        kept_boxes,
        kept_labels,
        first["image_id"],
        first["scale"],
        first["original_size"],
        _identity_geometry(tf.constant([out_h, out_w], tf.int32)),
        opts,
        opts.training_image_size,
        instance_masks,
    )
    out["boxes_truncated"] = out["boxes_truncated"] | truncated
    return _packed(out)


def eval_transform(example: dict, opts: TransformOptions) -> dict:
    """Deterministic resize to fit opts.image_size, round to uint8, pad bottom/right with zeros.

    The scale is min(H / h, W / w), i.e. the longer side (relative to the
    target) fills the target; boxes are multiplied by exactly `scale`, so
    `boxes / scale` are original-image pixels. Degenerate (empty) boxes are
    dropped; no minimum size or visibility is applied, no colour jitter.

    Returns:
      Same keys, shapes and units as train_transform ('boxes_truncated' True
      when the image has more than max_boxes non-empty boxes).
    """
    out_h, out_w = opts.image_size
    image, boxes, labels = example["image"], example["boxes"], example["labels"]
    original_hw = tf.shape(image)[:2]
    hw = tf.cast(original_hw, tf.float32)
    scale = tf.minimum(out_h / hw[0], out_w / hw[1])
    image, new_hw = _resize(image, scale, max_size=(out_h, out_w))
    boxes = _clip_boxes(boxes * scale, out_h, out_w)
    boxes, labels = drop_small_boxes(boxes, labels, 0.0)
    source = _identity_geometry(new_hw)
    return _finish(
        to_pixels(image), new_hw, boxes, labels, example["image_id"], scale, original_hw, source, opts, opts.image_size
    )

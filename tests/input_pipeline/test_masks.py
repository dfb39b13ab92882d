"""Mask run lengths decoded as pycocotools does, rasterised into the network geometry, packed as numpy packs bits."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from pycocotools import mask as coco_mask

from input_pipeline import masks


def _random_masks(rng, height, width, count):
    """bool [count, h, w]: blobs with holes, an empty mask, a full one, single pixels at the corners."""
    yy, xx = np.mgrid[:height, :width]
    out = []
    for _ in range(count):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(2, height / 2), rng.uniform(2, width / 2)
        blob = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        hole = ((yy - cy) / (ry / 3)) ** 2 + ((xx - cx) / (rx / 3)) ** 2 < 1
        out.append(blob & ~hole)
    out.append(np.zeros([height, width], bool))
    out.append(np.ones([height, width], bool))
    corners = np.zeros([height, width], bool)
    corners[0, 0] = corners[-1, -1] = True
    out.append(corners)
    return np.stack(out)


def _run_lengths_of(mask: np.ndarray) -> np.ndarray:
    rle = coco_mask.encode(np.asfortranarray(mask.astype(np.uint8)))
    return masks.run_lengths_from_string(rle["counts"])


def _decode(run_lengths: np.ndarray, height: int, width: int) -> np.ndarray:
    values = np.arange(len(run_lengths)) % 2 == 1
    return np.repeat(values, run_lengths).reshape(width, height).T


@pytest.mark.parametrize("height, width", [(37, 53), (480, 640)])
def test_run_lengths_from_the_compressed_string_decode_to_pycocotools_masks(height, width):
    rng = np.random.default_rng(0)
    for mask in _random_masks(rng, height, width, 6):
        run_lengths = _run_lengths_of(mask)
        assert run_lengths.sum() == height * width
        np.testing.assert_array_equal(_decode(run_lengths, height, width), mask)
    # The strings COCO's own files hold: a crowd region's uncompressed runs, compressed by pycocotools.
    counts = [272, 2, 4, 4, 4, 4, 2, 9, 1, 1, 1, 100000 - 304]
    compressed = coco_mask.frPyObjects({"size": [250, 400], "counts": counts}, 250, 400)["counts"]
    np.testing.assert_array_equal(masks.run_lengths_from_string(compressed), counts)
    np.testing.assert_array_equal(masks.run_lengths_from_string(compressed.decode("ascii")), counts)


def test_masks_encode_to_pycocotools_strings():
    for mask in _random_masks(np.random.default_rng(4), 45, 61, 5):
        expected = coco_mask.encode(np.asfortranarray(mask.astype(np.uint8)))["counts"]
        run_lengths = masks.run_lengths_of_mask(mask)
        np.testing.assert_array_equal(run_lengths, masks.run_lengths_from_string(expected))
        assert masks.run_lengths_to_string(run_lengths) == expected


@pytest.mark.parametrize("bad", [b"1 2", b"\x7f", b"@", b"o"], ids=["space", "high", "negative", "unfinished"])
def test_a_damaged_counts_string_is_a_value_error(bad):
    with pytest.raises(ValueError, match="RLE counts string"):
        masks.run_lengths_from_string(bad)


def _ragged(run_lengths_list):
    return tf.RaggedTensor.from_row_lengths(
        tf.constant(np.concatenate(run_lengths_list), tf.int64), [len(r) for r in run_lengths_list]
    )


def test_sampling_every_pixel_gives_the_masks_back():
    height, width = 41, 29
    source = _random_masks(np.random.default_rng(1), height, width, 4)
    sampled = masks.sample_masks(
        _ragged([_run_lengths_of(m) for m in source]),
        height,
        tf.range(height, dtype=tf.int32),
        tf.range(width, dtype=tf.int32),
    )
    np.testing.assert_array_equal(sampled.numpy(), source)


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize(
    "axis_scale, offset_yx, window_hw",
    [((0.5, 0.5), (0, 0), (24, 32)), ((1.7, 1.6), (10, 33), (64, 64)), ((0.8, 0.75), (0, 0), (38, 36))],
    ids=["shrunk", "enlarged_and_cropped", "padded"],
)
def test_masks_follow_flip_scale_and_crop_to_the_cell_centres(flipped, axis_scale, offset_yx, window_hw):
    height, width, stride, grid = 48, 64, 4, (16, 16)
    source = _random_masks(np.random.default_rng(2), height, width, 3)
    rows, columns = masks.network_sample_grid(
        tf.constant([height, width]),
        tf.constant(axis_scale, tf.float32),
        tf.constant(offset_yx),
        tf.constant(window_hw),
        tf.constant(flipped),
        grid,
        stride,
    )
    sampled = masks.sample_masks(_ragged([_run_lengths_of(m) for m in source]), height, rows, columns).numpy()

    # The numpy reference: each cell's centre mapped back through crop, scale and mirror.
    expected = np.zeros([len(source), *grid], bool)
    for i in range(grid[0]):
        for j in range(grid[1]):
            y, x = (i + 0.5) * stride, (j + 0.5) * stride
            if y >= window_hw[0] or x >= window_hw[1]:
                continue
            source_y = (y + offset_yx[0]) / np.float32(axis_scale[0])
            source_x = (x + offset_yx[1]) / np.float32(axis_scale[1])
            if flipped:
                source_x = width - source_x
            row, column = int(np.floor(source_y)), int(np.floor(source_x))
            if 0 <= row < height and 0 <= column < width:
                expected[:, i, j] = source[:, row, column]
    np.testing.assert_array_equal(sampled, expected)
    assert sampled.any()


@pytest.mark.parametrize("width", [8, 13, 16, 1])
def test_pack_bits_is_numpys_packbits(width):
    cells = np.random.default_rng(3).random([3, 5, width]) < 0.5
    packed = masks.pack_bits(tf.constant(cells)).numpy()
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, masks.packed_width(width))
    np.testing.assert_array_equal(packed, np.packbits(cells, axis=-1))


def _shapes_example(seed, height=60, width=76, count=6):
    """An image of `count` shapes with holes, each's box its exact extent: rectangular rings (even labels) and
    ellipses (odd); the last box has no mask."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:height, :width]
    instance_masks, boxes = [], []
    while len(instance_masks) < count:
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(6, height / 3), rng.uniform(6, width / 3)
        if len(instance_masks) % 2 == 0:
            blob = (abs(yy - cy) < ry) & (abs(xx - cx) < rx) & ~((abs(yy - cy) < ry / 3) & (abs(xx - cx) < rx / 3))
        else:
            blob = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
            blob &= ~(((yy - cy) / (ry / 3)) ** 2 + ((xx - cx) / (rx / 3)) ** 2 < 1)
        rows, columns = np.flatnonzero(blob.any(1)), np.flatnonzero(blob.any(0))
        if rows.size < 8 or columns.size < 8:
            continue
        instance_masks.append(blob)
        boxes.append([rows[0], columns[0], rows[-1] + 1, columns[-1] + 1])
    run_lengths = [_run_lengths_of(m) for m in instance_masks[:-1]] + [np.zeros([0], np.int64)]
    example = {
        "image": tf.constant(rng.integers(0, 256, [height, width, 3], np.uint8)),
        "boxes": tf.constant(boxes, tf.float32),
        "labels": tf.range(count, dtype=tf.int32),  # label i is instance i: which mask is which after the drops
        "image_id": tf.constant(seed, tf.int32),
        "mask_run_lengths": _ragged(run_lengths),
    }
    return example, np.stack(instance_masks)


def _cells(example, grid):
    return np.unpackbits(example["masks"].numpy(), axis=-1, count=grid[1]).astype(bool)


def _assert_masks_cover_their_boxes(out, stride, grid, count):
    """Every real box with a mask: its cells within one cell of the box; a rectangle's reach each side of it.

    (An ellipse's tips can fall between cell centres: sampled at the centres, its cells may end more than a
    cell short of its box.)"""
    cells, valid = _cells(out, grid), out["masks_valid"].numpy()
    labels, real = out["labels"].numpy(), out["boxes_mask"].numpy()
    assert not valid[~real].any() and not cells[~real].any()
    checked = 0
    for box, label, box_cells, has_mask in zip(out["boxes"].numpy()[real], labels[real], cells[real], valid[real]):
        assert has_mask == (label != count - 1), label  # the instance without runs has no mask, the rest have one
        if not has_mask:
            assert not box_cells.any()
            continue
        if (box[2:] - box[:2]).min() < 2 * stride:  # a box under two cells may fall between cell centres
            continue
        rows, columns = np.flatnonzero(box_cells.any(1)), np.flatnonzero(box_cells.any(0))
        extent = np.array([rows[0], columns[0], rows[-1] + 1, columns[-1] + 1], np.float32) * stride
        assert (extent[:2] >= box[:2] - stride).all() and (extent[2:] <= box[2:] + stride).all(), (extent, box)
        if label % 2 == 0:
            np.testing.assert_allclose(extent, box, atol=stride, err_msg=f"instance {label}")
            checked += 1
    return checked


@pytest.mark.parametrize("resize_on_device", [False, True])
def test_training_masks_follow_their_boxes_through_flip_jitter_crop_and_drops(resize_on_device):
    from input_pipeline import transforms

    stride, count = 4, 6
    opts = transforms.TransformOptions(
        image_size=(64, 64),
        max_boxes=4,  # fewer than the boxes: the cut keeps masks with their boxes
        scale_jitter=(0.6, 1.8),
        min_box_size=3.0,
        min_visible_fraction=0.3,
        resize_on_device=resize_on_device,
        source_size=(96, 96) if resize_on_device else None,
        mask_stride=stride,
    )
    grid = (16, 16)
    checked = 0
    for seed in range(12):
        example, _ = _shapes_example(seed, count=count)
        out = transforms.train_transform(example, tf.constant([seed, 7], tf.int64), opts)
        assert out["masks"].dtype == tf.uint8 and out["masks"].shape == (4, 16, 2)
        checked += _assert_masks_cover_their_boxes(out, stride, grid, count)
    assert checked >= 20


def test_mosaic_masks_sit_in_their_tiles():
    from input_pipeline import transforms

    stride, count = 4, 6
    opts = transforms.TransformOptions(image_size=(64, 64), max_boxes=12, scale_jitter=(1.5, 2.0), mask_stride=stride)
    examples = [_shapes_example(seed, count=count)[0] for seed in range(4)]
    out = transforms.mosaic_transform(examples, tf.constant([1, 2], tf.int64), opts)
    assert out["masks"].shape == (12, 16, 2)
    assert _assert_masks_cover_their_boxes(out, stride, (16, 16), count) >= 1
    assert out["masks_valid"].numpy().sum() >= 4
    with pytest.raises(Exception, match="multiple of twice input.mask_stride"):
        transforms.mosaic_transform(
            examples, tf.constant([1, 2], tf.int64), opts.__class__(**{**opts.__dict__, "image_size": (60, 60)})
        )


def test_records_keep_masks_and_box_only_records_train_boxes_alone():
    from input_pipeline import records, transforms

    example, instance_masks = _shapes_example(3)
    run_lengths = [_run_lengths_of(m) for m in instance_masks]
    source = records.SourceExample(
        image_bytes=tf.io.encode_png(example["image"]).numpy(),
        image_id=3,
        height=60,
        width=76,
        boxes_yxyx=example["boxes"].numpy(),
        labels=np.arange(6),
        is_crowd=np.zeros(6, bool),
        mask_runs=np.array([len(r) for r in run_lengths]),
        mask_run_lengths=np.concatenate(run_lengths),
    )
    serialized = records.serialize(source)
    back = records.parse_numpy(serialized)
    np.testing.assert_array_equal(back.mask_runs, source.mask_runs)
    np.testing.assert_array_equal(back.mask_run_lengths, source.mask_run_lengths)
    parsed = records.parse(tf.constant(serialized), with_masks=True)
    for i, expected in enumerate(run_lengths):
        np.testing.assert_array_equal(parsed["mask_run_lengths"][i].numpy(), expected)

    # A box-only record (no mask features): every box without a mask.
    box_only = records.serialize(dataclasses_replace(source, mask_runs=None, mask_run_lengths=None))
    parsed = records.parse(tf.constant(box_only), with_masks=True)
    assert parsed["mask_run_lengths"].row_lengths().numpy().tolist() == [0] * 6
    opts = transforms.TransformOptions(image_size=(64, 64), max_boxes=8, mask_stride=4)
    decoded = {
        "image": tf.io.decode_png(parsed["image"], channels=3),
        "boxes": parsed["boxes"],
        "labels": parsed["labels"],
        "image_id": tf.constant(3),
        "mask_run_lengths": parsed["mask_run_lengths"],
    }
    out = transforms.train_transform(decoded, tf.constant([0, 0], tf.int64), opts)
    assert out["boxes_mask"].numpy().sum() > 0 and not out["masks_valid"].numpy().any()
    assert not out["masks"].numpy().any()
    with pytest.raises(ValueError, match="mask run counts"):
        records.serialize(dataclasses_replace(source, mask_runs=np.array([1, 2])))


def dataclasses_replace(instance, **changes):
    import dataclasses

    return dataclasses.replace(instance, **changes)

"""Detection pictures: outline pixels where the box edges are, tags, clipping, skipped boxes, PNG files."""

import numpy as np
import pytest
from PIL import Image

from detector.serving import drawing
from detector.serving.drawing import PALETTE, class_color, draw_detections, save_png, side_by_side

HEIGHT, WIDTH = 48, 64
BLACK = np.zeros((HEIGHT, WIDTH, 3), np.uint8)


def _is_color(pixels, color):
    return np.all(pixels == np.asarray(color, np.uint8), axis=-1)


def _non_black(pixels):
    return np.any(pixels != 0, axis=-1)


def test_palette_is_distinct_and_deterministic():
    assert len(set(PALETTE)) == len(PALETTE)
    assert all(color not in ((0, 0, 0), (255, 255, 255)) for color in PALETTE)
    assert class_color(3) == class_color(3) == PALETTE[3]
    assert class_color(3 + len(PALETTE)) == PALETTE[3]


def test_outline_lies_on_the_box_edges_and_the_interior_stays_black():
    label = 3
    # Tall enough for the tag to sit above the box (rows < 10).
    out = draw_detections(BLACK, [[10, 20, 30, 40]], [label], [0.87], ["a", "b", "c", "cat"], line_width=1)
    color = class_color(label)
    # Pixels covered by [10, 30) x [20, 40): outline on rows 10, 29 and columns 20, 39.
    assert _is_color(out[29, 20:40], color).all()
    assert _is_color(out[10:30, 20], color).all()
    assert _is_color(out[10:30, 39], color).all()
    assert _is_color(out[10, 20:40], color).all()  # the tag is above the box, not over its edge
    assert not _non_black(out[11:29, 21:39]).any()
    assert not _non_black(out[30:]).any() and not _non_black(out[10:, 40:]).any()
    # The tag: a filled block in the class colour just above the top-left corner, with text on it.
    tag = out[:10, 20:40]
    assert _is_color(tag, color).mean() > 0.3
    assert (_non_black(tag) & ~_is_color(tag, color)).any()


def test_line_width_grows_inwards():
    out = draw_detections(BLACK, [[20, 20, 40, 40]], [0], line_width=3)
    color = class_color(0)
    assert _is_color(out[30, 20:23], color).all()
    assert _is_color(out[30, 37:40], color).all()
    assert not _non_black(out[30, 23:37]).any()
    assert not _non_black(out[30, :20]).any() and not _non_black(out[30, 40:]).any()


def test_tag_goes_inside_the_box_when_there_is_no_room_above():
    out = draw_detections(BLACK, [[1, 5, 40, 60]], [1], None, ["person"], line_width=1)
    color = class_color(1)
    assert _is_color(out[1, 5:60], color).all()
    # The tag hangs from the top-left corner over the top edge: class colour with text on it.
    tag = out[1:9, 5:30]
    assert _is_color(tag, color).mean() > 0.3
    assert (~_is_color(tag, color)).any()
    assert not _non_black(out[20:39, 6:59]).any()  # the interior below the tag


def test_boxes_partly_outside_are_clipped_to_the_border():
    out = draw_detections(BLACK, [[-10.0, -5.0, 20.0, 100.0]], [2], [0.5], line_width=1)
    color = class_color(2)
    # Top, left and right edges fall on the image border, the bottom edge inside.
    assert _is_color(out[0, :], color).sum() >= WIDTH // 2  # the tag covers part of the top row
    assert _is_color(out[:20, 0], color).all()
    assert _is_color(out[:20, WIDTH - 1], color).all()
    assert _is_color(out[19, :], color).all()
    assert not _non_black(out[20:]).any()


def test_degenerate_nonfinite_padding_and_outside_boxes_draw_nothing():
    boxes = np.array(
        [
            [np.nan, 1, 10, 10],
            [5, 5, 5, 20],  # zero height
            [10, 10, 5, 20],  # inverted
            [0, 0, 0, 0],  # an invalid detection slot
            [100, 100, 120, 120],  # entirely outside
            [1, 1, 20, 20],  # padding label
            [1, 1, 20, np.inf],
        ],
        np.float32,
    )
    labels = [0, 1, 2, 3, 4, -1, 5]
    assert np.array_equal(draw_detections(BLACK, boxes, labels), BLACK)
    assert np.array_equal(draw_detections(BLACK, [[1, 1, 20, 20]], [0], [np.nan]), BLACK)
    empty = draw_detections(BLACK, np.zeros((0, 4)), np.zeros((0,), np.int32))
    assert np.array_equal(empty, BLACK) and empty is not BLACK


def test_input_is_not_modified_and_float_images_are_converted():
    image = np.full((HEIGHT, WIDTH, 3), 7, np.uint8)
    before = image.copy()
    out = draw_detections(image, [[10, 10, 30, 30]], [0], [0.9])
    assert np.array_equal(image, before)
    assert out.dtype == np.uint8 and out.shape == image.shape and not np.array_equal(out, image)

    unit = np.full((HEIGHT, WIDTH, 3), 0.5, np.float32)
    assert (draw_detections(unit, [], [])[0, 0] == 128).all()
    wide = np.full((HEIGHT, WIDTH, 3), 200.0, np.float64)
    assert (draw_detections(wide, [], [])[0, 0] == 200).all()
    converted = draw_detections(unit, [[10, 10, 30, 30]], [4], line_width=1)
    assert _is_color(converted[20, 10], class_color(4)).all()
    assert (converted[20, 20] == 128).all()
    assert unit[0, 0, 0] == np.float32(0.5)


def test_color_by_instance_gives_each_box_its_own_colour():
    out = draw_detections(BLACK, [[20, 2, 40, 20], [20, 30, 40, 50]], [0, 0], color_by="instance", line_width=1)
    assert _is_color(out[30, 2], class_color(0)).all()
    assert _is_color(out[30, 30], class_color(1)).all()


def test_side_by_side_pads_heights_with_white():
    left = np.zeros((10, 6, 3), np.uint8)
    right = np.zeros((14, 5, 3), np.uint8)
    panel = side_by_side(left, right, gap=3)
    assert panel.shape == (14, 6 + 3 + 5, 3) and panel.dtype == np.uint8
    assert (panel[:, 6:9] == 255).all()  # the gap
    assert (panel[10:, :6] == 255).all()  # padding under the shorter image
    assert (panel[:10, :6] == 0).all() and (panel[:, 9:] == 0).all()


def test_save_png_round_trip(tmp_path):
    image = draw_detections(BLACK, [[10, 20, 30, 40]], [1], [0.5], ["dog", "cat"])
    path = save_png(image, tmp_path / "nested" / "detections.png")
    assert path.exists()
    with Image.open(str(path)) as png:
        assert png.format == "PNG"
        assert np.array_equal(np.asarray(png.convert("RGB")), image)


def test_prediction_panels_crop_the_padding_and_show_predictions_beside_ground_truth():
    image = np.full((2, 40, 40, 3), 7, np.uint8)
    image[0, 30:] = 200  # padding below the first image's 30 rows: not drawn
    batch = {
        "image": image,
        "image_hw": np.array([[30, 40], [40, 40]], np.int32),
        "boxes": np.array([[[4, 4, 20, 20]], [[0, 0, 1, 1]]], np.float32),
        "labels": np.array([[1], [0]], np.int32),
        "boxes_mask": np.array([[True], [True]]),
        "example_mask": np.array([True, False]),  # the second is padding
    }
    outputs = {
        "boxes": np.array([[[10, 10, 25, 30], [0, 0, 5, 5]], [[0, 0, 1, 1], [0, 0, 1, 1]]], np.float32),
        "scores": np.array([[0.9, 0.1], [0.9, 0.9]], np.float32),  # 0.1: under the threshold
        "classes": np.array([[2, 3], [0, 0]], np.int32),
        "valid": np.array([[True, True], [True, True]]),
    }
    panels = drawing.prediction_panels(batch, outputs, score_threshold=0.3)
    assert panels.shape == (1, 30, 40 * 2 + 4, 3)  # one real example, cropped to its 30 x 40 pixels
    left, right = panels[0, :, :40], panels[0, :, 44:]
    assert tuple(left[15, 10]) == drawing.class_color(2)  # the prediction's left edge
    assert drawing.class_color(3) not in {tuple(p) for p in left.reshape(-1, 3)}  # below the threshold
    assert tuple(right[12, 4]) == drawing.class_color(1)  # the ground truth's left edge
    assert tuple(right[25, 30]) == (7, 7, 7)  # the image's own pixels


def test_masks_are_filled_translucent_in_the_box_colour_better_detections_on_top():
    boxes = np.array([[20, 4, 44, 40], [20, 24, 44, 60]], np.float32)
    masks = np.zeros((2, HEIGHT, WIDTH), bool)
    masks[0, 26:40, 8:34] = True
    masks[1, 26:40, 28:56] = True  # overlaps the first's columns 28..33
    grey = np.full((HEIGHT, WIDTH, 3), 100, np.uint8)
    picture = draw_detections(grey, boxes, np.array([1, 2]), np.array([0.9, 0.5]), masks=masks)

    def blend(color):
        return np.round(0.55 * 100 + drawing.MASK_OPACITY * np.asarray(color, np.float64)).astype(np.uint8)

    assert np.all(_is_color(picture[30:36, 10:23], blend(class_color(1))))  # box 2's outline at columns 24, 25
    assert np.all(_is_color(picture[30:36, 41:54], blend(class_color(2))))
    # Where they overlap, the better detection's fill is the last.
    overlap = picture[30:36, 29:33]
    assert np.all(_is_color(overlap, np.round(0.55 * blend(class_color(2)) + 0.45 * np.asarray(class_color(1)))))
    assert np.all(picture[45:] == 100)  # below every mask, box and tag: the image
    assert np.array_equal(draw_detections(grey, boxes, np.array([1, 2]), np.array([0.9, 0.5])).shape, picture.shape)
    with pytest.raises(ValueError, match=r"masks \(1, 48, 64\) must be \[N, H, W\]"):
        draw_detections(grey, boxes, np.array([1, 2]), np.array([0.9, 0.5]), masks=masks[:1])

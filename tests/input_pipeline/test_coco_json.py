"""COCO-format folders: labels, box conversion, bad data and its counts."""

import collections
import json
import time

import numpy as np
import pytest
from PIL import Image

from input_pipeline import masks
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import box_checks, coco_images, coco_json


def _save(path, mode, size, fmt=None):
    """Writes a tiny image of PIL `mode` and (width, height) `size`; returns its bytes."""
    width, height = size
    if mode == "I;16":
        img = Image.fromarray((np.arange(width * height, dtype=np.uint16) * 997).reshape(height, width))
    else:
        rgb = np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)
        img = Image.fromarray(rgb).convert(mode)
    img.save(path, fmt)
    return path.read_bytes()


def _write_json(path, images, annotations, categories=({"id": 1, "name": "thing"},)):
    path.write_text(
        json.dumps({"images": list(images), "annotations": list(annotations), "categories": list(categories)})
    )
    return str(path)


def _ann(image_id, bbox, category_id=1, **extra):
    return {"image_id": image_id, "category_id": category_id, "bbox": bbox, **extra}


def _read(json_path, image_root, num_threads=2):
    counts = collections.Counter()
    examples = list(coco_images.iter_examples(str(json_path), str(image_root), counts, num_threads=num_threads))
    # Zero entries carry no information; compare the nonzero ones exactly.
    return examples, dict(+counts)


def test_reads_folder_with_gapped_category_ids(tmp_path):
    files = {
        5: _save(tmp_path / "b.jpg", "RGB", (40, 30)),
        2: _save(tmp_path / "a.png", "RGB", (20, 10)),
        9: _save(tmp_path / "neg.jpg", "RGB", (16, 12)),
    }
    images = [
        {"id": 5, "file_name": "b.jpg", "width": 40, "height": 30},
        {"id": 9, "file_name": "neg.jpg"},  # No size: taken from the header.
        {"id": 2, "file_name": "a.png", "width": 20, "height": 10},
    ]
    categories = [{"id": 12, "name": "dog"}, {"id": 3, "name": "cat"}, {"id": 7, "name": "bird"}]
    annotations = [
        _ann(5, [1, 2, 10, 5], 7),
        _ann(2, [3.5, 1.25, 6, 4], 3),
        _ann(5, [0, 0, 4, 4], 12, iscrowd=1),
        _ann(5, [20.5, 10, 8.25, 3], 3, iscrowd=0),
    ]
    json_path = _write_json(tmp_path / "instances.json", images, annotations, categories)

    cats = coco_json.read_categories(json_path)
    assert cats == coco_json.CocoCategories((3, 7, 12), ("cat", "bird", "dog"))

    examples, counts = _read(json_path, tmp_path)
    assert [e.image_id for e in examples] == [2, 5, 9]
    by_id = {e.image_id: e for e in examples}
    for image_id, e in by_id.items():
        assert e.image_bytes == files[image_id]
    assert [(e.height, e.width) for e in examples] == [(10, 20), (30, 40), (12, 16)]

    e = by_id[2]
    np.testing.assert_array_equal(e.boxes_yxyx, [[1.25, 3.5, 5.25, 9.5]])
    np.testing.assert_array_equal(e.labels, [0])
    np.testing.assert_array_equal(e.is_crowd, [False])
    e = by_id[5]
    np.testing.assert_array_equal(e.boxes_yxyx, [[2, 1, 7, 11], [0, 0, 4, 4], [10, 20.5, 13, 28.75]])
    np.testing.assert_array_equal(e.labels, [1, 2, 0])
    np.testing.assert_array_equal(e.is_crowd, [False, True, False])
    e = by_id[9]
    assert e.boxes_yxyx.shape == (0, 4) and e.labels.shape == (0,) and e.is_crowd.shape == (0,)
    for e in examples:
        assert e.boxes_yxyx.dtype == np.float32 and e.labels.dtype == np.int32 and e.is_crowd.dtype == bool
    # The labels map back to the JSON's ids through category_ids.
    assert [cats.category_ids[label] for label in by_id[5].labels] == [7, 12, 3]

    assert counts == {"images": 3, "annotations": 4, "usable_images": 3, "crowd_box": 1, "no_annotations": 1}


@pytest.mark.filterwarnings("error")
def test_bad_annotations_are_dropped_or_clipped_and_counted(tmp_path):
    _save(tmp_path / "a.png", "RGB", (20, 10))
    _save(tmp_path / "nosize.png", "RGB", (8, 6))
    _save(tmp_path / "alldropped.png", "RGB", (8, 6))
    images = [
        {"id": 1, "file_name": "a.png", "width": 20, "height": 10},
        {"id": 2, "file_name": "nosize.png"},
        {"id": 3, "file_name": "alldropped.png", "width": 8, "height": 6},
    ]
    annotations = [
        _ann(99, [1, 1, 2, 2]),  # annotation_unknown_image
        {"category_id": 1, "bbox": [1, 1, 2, 2]},  # annotation_unknown_image
        _ann("1", [1, 1, 2, 2]),  # annotation_unknown_image
        _ann(1, [1, 1, 2, 2], category_id=5),  # unknown_category
        {"image_id": 1, "bbox": [1, 1, 2, 2]},  # unknown_category
        _ann(1, [1, 2, 3]),  # invalid_box
        _ann(1, [float("nan"), 1, 2, 2]),  # invalid_box
        _ann(1, [1, 1, float("inf"), 2]),  # invalid_box
        {"image_id": 1, "category_id": 1},  # invalid_box
        _ann(1, ["1", 1, 2, 2]),  # invalid_box
        _ann(1, None),  # invalid_box
        _ann(1, [0, 0, 10**400, 1]),  # invalid_box (beyond float range)
        _ann(1, [1, 1, 0, 2]),  # empty_box
        _ann(1, [1, 1, 2, -1]),  # empty_box
        _ann(1, [2, 1, 1e-9, 1]),  # empty_box (in float32)
        _ann(1, [2, 3, 4, 5]),  # kept as is
        _ann(1, [15, 5, 10, 10]),  # clipped_box
        _ann(1, [-2, -3, 5, 5], iscrowd=1),  # clipped_box + crowd_box
        _ann(1, [25, 0, 5, 5]),  # outside_box
        _ann(1, [20, 0, 5, 5]),  # outside_box (touches the edge)
        _ann(1, [-10, 2, 5, 5]),  # outside_box
        _ann(1, [1e308, 0, 1e308, 1]),  # outside_box (no float32 overflow)
        _ann(2, [4, 3, 10, 10]),  # clipped_box, by the header's size
        _ann(3, [1, 1, 0, 1]),  # empty_box
        _ann(3, [9, 1, 1, 1]),  # outside_box
    ]
    json_path = _write_json(tmp_path / "instances.json", images, annotations)

    examples, counts = _read(json_path, tmp_path)
    assert [e.image_id for e in examples] == [1, 2, 3]
    np.testing.assert_array_equal(examples[0].boxes_yxyx, [[3, 2, 8, 6], [5, 15, 10, 20], [0, 0, 2, 3]])
    np.testing.assert_array_equal(examples[0].labels, [0, 0, 0])
    np.testing.assert_array_equal(examples[0].is_crowd, [False, False, True])
    assert (examples[1].height, examples[1].width) == (6, 8)
    np.testing.assert_array_equal(examples[1].boxes_yxyx, [[3, 4, 6, 8]])
    assert examples[2].boxes_yxyx.shape == (0, 4)
    assert counts == {
        "images": 3,
        "annotations": len(annotations),
        "usable_images": 3,
        "annotation_unknown_image": 3,
        "unknown_category": 2,
        "invalid_box": 7,
        "empty_box": 4,
        "clipped_box": 3,
        "outside_box": 5,
        "crowd_box": 1,
        "no_annotations": 1,
    }


def test_bad_files_are_skipped_and_counted(tmp_path):
    good = _save(tmp_path / "good.jpg", "RGB", (20, 10))
    (tmp_path / "garbage.jpg").write_bytes(b"this is not a JPEG" * 10)
    (tmp_path / "empty.png").write_bytes(b"")
    _save(tmp_path / "small.png", "RGB", (20, 10))
    (tmp_path / "adir.jpg").mkdir()
    images = [
        {"id": 1, "file_name": "missing.jpg", "width": 20, "height": 10},
        {"id": 2, "file_name": "garbage.jpg", "width": 20, "height": 10},
        {"id": 3, "file_name": "empty.png"},
        {"id": 4, "file_name": "small.png", "width": 30, "height": 10},
        {"id": 5, "file_name": "small.png", "width": 20, "height": 11},
        {"id": 6, "file_name": "adir.jpg"},
        {"id": 7, "file_name": "good.jpg", "width": 20, "height": 10},
    ]
    # A skipped image's annotations are not examined: this invalid box is not counted.
    annotations = [_ann(1, [1, 1]), _ann(4, [1, 1, 2, 2]), _ann(7, [1, 1, 2, 2])]
    json_path = _write_json(tmp_path / "instances.json", images, annotations)

    examples, counts = _read(json_path, tmp_path)
    assert [e.image_id for e in examples] == [7]
    assert examples[0].image_bytes == good
    assert counts == {
        "images": 7,
        "annotations": 3,
        "usable_images": 1,
        "missing_image_file": 2,
        "unreadable_image": 2,
        "size_mismatch": 2,
    }


def test_converted_modes_are_kept_and_counted_once(tmp_path):
    cases = [  # (file, mode written, format)
        ("rgb.jpg", "RGB", "JPEG"),
        ("gray.jpg", "L", "JPEG"),
        ("bw.png", "1", "PNG"),
        ("rgba.png", "RGBA", "PNG"),
        ("la.png", "LA", "PNG"),
        ("gray16.png", "I;16", "PNG"),
        ("palette.png", "P", "PNG"),
        ("cmyk.jpg", "CMYK", "JPEG"),
    ]
    images = []
    for i, (name, mode, fmt) in enumerate(cases):
        _save(tmp_path / name, mode, (6, 4), fmt)
        images.append({"id": i, "file_name": name, "width": 6, "height": 4})
    # The 16-bit case must really be 16-bit on disk, or the test proves nothing.
    assert Image.open(tmp_path / "gray16.png").mode in ("I;16", "I")
    json_path = _write_json(tmp_path / "instances.json", images, [_ann(i, [0, 0, 1, 1]) for i in range(len(cases))])

    examples, counts = _read(json_path, tmp_path)
    assert [e.image_id for e in examples] == list(range(len(cases)))
    assert all(len(e.labels) == 1 for e in examples)
    assert counts == {
        "images": 8,
        "annotations": 8,
        "usable_images": 8,
        "converted_grayscale": 2,
        "converted_alpha": 2,
        "converted_16bit": 1,
        "converted_palette": 1,
        "converted_cmyk": 1,
    }


@pytest.mark.parametrize(
    "mode,image_format,key",
    [
        ("I;16", "PNG", "converted_16bit"),
        ("I;16B", "TIFF", "converted_16bit"),
        ("I", "PNG", "converted_16bit"),  # What older Pillow reports for 16-bit PNGs.
        ("I", "TIFF", "converted_grayscale"),
        ("F", "TIFF", "converted_grayscale"),
        ("PA", "PNG", "converted_alpha"),
        ("RGB", "JPEG", None),
    ],
)
def test_conversion_key(mode, image_format, key):
    assert box_checks.conversion_key(mode, image_format) == key


def _valid_json():
    return {"images": [{"id": 1, "file_name": "a.png"}], "annotations": [], "categories": [{"id": 1, "name": "thing"}]}


@pytest.mark.parametrize(
    "case",
    [
        "missing_json",
        "invalid_json",
        "not_an_object",
        "no_images",
        "no_annotations",
        "no_categories",
        "images_not_list",
        "duplicate_image_id",
        "duplicate_category_id",
        "empty_categories",
        "image_root_missing",
        "image_root_is_file",
        "bad_image_size",
    ],
)
def test_dataset_errors(tmp_path, case):
    json_path = tmp_path / "instances.json"
    image_root = tmp_path
    data = _valid_json()
    named = json_path
    if case == "invalid_json":
        json_path.write_text('{"images": [')
    elif case == "not_an_object":
        json_path.write_text("[]")
    elif case == "missing_json":
        pass
    else:
        if case.startswith("no_"):
            del data[case[3:]]
        elif case == "images_not_list":
            data["images"] = {"1": "a.png"}
        elif case == "duplicate_image_id":
            data["images"].append({"id": 1, "file_name": "b.png"})
        elif case == "duplicate_category_id":
            data["categories"].append({"id": 1, "name": "other"})
        elif case == "empty_categories":
            data["categories"] = []
        elif case == "image_root_missing":
            image_root = named = tmp_path / "no_such_dir"
        elif case == "image_root_is_file":
            image_root = named = tmp_path / "file"
            image_root.write_text("")
        elif case == "bad_image_size":
            data["images"][0]["width"] = 0
        json_path.write_text(json.dumps(data))

    # Raised when called, before any iteration: a bad config fails at startup.
    with pytest.raises(DatasetError) as info:
        coco_images.iter_examples(str(json_path), str(image_root), collections.Counter())
    message = str(info.value)
    assert str(named) in message and "\n" not in message
    assert isinstance(info.value, ValueError)
    if not case.startswith("image_root") and case not in ("duplicate_image_id", "bad_image_size"):
        # read_categories checks the file and its lists, not the images.
        with pytest.raises(DatasetError, match="instances.json"):
            coco_json.read_categories(str(json_path))


def test_independent_of_num_threads(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    images, annotations = [], []
    for image_id in rng.permutation(np.arange(100, 130)).tolist():
        width, height = rng.integers(4, 24, 2).tolist()
        name = f"{image_id}.png"
        if image_id % 7:  # Every 7th file is missing.
            _save(tmp_path / name, "RGB", (width, height))
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for _ in range(image_id % 3):
            annotations.append(_ann(image_id, rng.uniform(-5, 20, 4).tolist()))
    json_path = _write_json(tmp_path / "instances.json", images, annotations)

    # Low image ids take longest and the window is smaller than the dataset, so
    # yielding in completion order instead of image order would show up.
    read_image = coco_images._read_image

    def slow_read_image(path):
        image_id = int(path.rsplit("/", 1)[1].split(".")[0])
        time.sleep(0.001 * ((130 - image_id) % 10))
        return read_image(path)

    monkeypatch.setattr(coco_images, "_read_image", slow_read_image)
    monkeypatch.setattr(coco_images, "_MAX_IN_FLIGHT", 8)
    results = [_read(json_path, tmp_path, num_threads=n) for n in (1, 4)]
    (examples1, counts1), (examples4, counts4) = results
    ids = [e.image_id for e in examples1]
    assert ids == sorted(i for i in range(100, 130) if i % 7)
    assert counts1 == counts4 and counts1["missing_image_file"] == 4
    assert len(examples1) == len(examples4)
    for a, b in zip(examples1, examples4):
        assert a.image_id == b.image_id and a.image_bytes == b.image_bytes
        assert (a.height, a.width) == (b.height, b.width)
        np.testing.assert_array_equal(a.boxes_yxyx, b.boxes_yxyx)
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.is_crowd, b.is_crowd)


def test_chunked_parsing_gives_the_same_examples(tmp_path, monkeypatch):
    """Images out of id order with names of many lengths, parsed 3 entries and re-sorted 2 names at a time."""
    rng = np.random.default_rng(2)
    images, annotations = [], []
    for image_id in rng.permutation(np.arange(1, 12)).tolist():
        name = "x" * image_id + f"{image_id}.png"
        width, height = rng.integers(4, 24, 2).tolist()
        _save(tmp_path / name, "RGB", (width, height))
        images.append({"id": image_id, "file_name": name})
        annotations += [_ann(image_id, [1, 1, 2 + image_id % 3, 2])] * (image_id % 3)
    json_path = _write_json(tmp_path / "instances.json", images, annotations)
    whole = _read(json_path, tmp_path)
    monkeypatch.setattr(coco_json, "_PARSE_CHUNK", 3)
    monkeypatch.setattr(coco_json, "READ_BLOCK", 2)
    chunked = _read(json_path, tmp_path)
    assert chunked[1] == whole[1]
    assert [e.image_id for e in chunked[0]] == list(range(1, 12))
    for a, b in zip(chunked[0], whole[0]):
        assert a.image_bytes == b.image_bytes == (tmp_path / ("x" * a.image_id + f"{a.image_id}.png")).read_bytes()
        assert (a.height, a.width) == (b.height, b.width)
        np.testing.assert_array_equal(a.boxes_yxyx, b.boxes_yxyx)
        assert len(a.labels) == a.image_id % 3


def test_ground_truth_columns_are_the_ground_truth_dicts(tmp_path):
    """Scoring's columns hold what COCO evaluation of the dicts reads: crowds, defaults and drops included."""
    json_path, _ = _write_scoring_folder(tmp_path)
    as_dicts = coco_json.load_ground_truth(json_path)
    columns = coco_json.load_ground_truth_columns(json_path)
    annotations = as_dicts["annotations"]
    assert len(annotations) == len(columns["areas"]) > 0
    np.testing.assert_array_equal(columns["image_ids"], sorted(i["id"] for i in as_dicts["images"]))
    np.testing.assert_array_equal(columns["category_ids"], sorted(c["id"] for c in as_dicts["categories"]))
    np.testing.assert_array_equal(columns["box_image_ids"], [a["image_id"] for a in annotations])
    np.testing.assert_array_equal(columns["box_category_ids"], [a["category_id"] for a in annotations])
    np.testing.assert_array_equal(columns["boxes_xywh"], [a["bbox"] for a in annotations])
    np.testing.assert_array_equal(columns["areas"], [a["area"] for a in annotations])
    np.testing.assert_array_equal(columns["is_crowd"], [bool(a["iscrowd"]) for a in annotations])
    assert columns["is_crowd"].any() and not columns["is_crowd"].all()


def _write_scoring_folder(tmp_path):
    """A JSON with a crowd, a given and a missing area, an unknown category and a degenerate box (dropped)."""
    images = [{"id": 5, "file_name": "a.jpg", "width": 40, "height": 30}, {"id": 2, "file_name": "b.jpg"}]
    annotations = [
        {"id": 1, "image_id": 5, "category_id": 3, "bbox": [1, 2, 10, 5], "area": 33.5},
        {"id": 2, "image_id": 5, "category_id": 7, "bbox": [0, 0, 4, 4], "iscrowd": 1},
        {"image_id": 2, "category_id": 3, "bbox": [3.5, 1.25, 2, 8]},
        {"id": 4, "image_id": 2, "category_id": 99, "bbox": [0, 0, 1, 1]},
        {"id": 5, "image_id": 2, "category_id": 3, "bbox": [0, 0, 0, 1]},
    ]
    categories = [{"id": 3, "name": "x"}, {"id": 7, "name": "y"}]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return str(path), tmp_path


def _mask_of(example, index):
    """bool [h, w] of the example's box `index`, decoded from its run lengths."""
    offsets = np.concatenate([[0], np.cumsum(example.mask_runs)])
    run_lengths = example.mask_run_lengths[offsets[index] : offsets[index + 1]]
    values = np.arange(len(run_lengths)) % 2 == 1
    return np.repeat(values, run_lengths).reshape(example.width, example.height).T


def test_segmentations_become_pycocotools_masks_and_bad_ones_leave_the_box_alone(tmp_path):
    from pycocotools import mask as coco_mask
    from pycocotools.coco import COCO

    _save(tmp_path / "a.png", "RGB", (40, 30))
    _save(tmp_path / "b.png", "RGB", (24, 20))
    images = [
        {"id": 1, "file_name": "a.png", "width": 40, "height": 30},
        {"id": 2, "file_name": "b.png"},  # no size in the JSON: the file's header gives it
    ]
    ring = np.zeros([30, 40], np.uint8)
    ring[5:25, 10:30] = 1
    ring[10:20, 15:25] = 0  # a hole
    compressed = coco_mask.encode(np.asfortranarray(ring))
    compressed["counts"] = compressed["counts"].decode("ascii")
    crowd = np.zeros([30, 40], np.uint8)
    crowd[0:6, 0:8] = 1
    crowd_runs = [int(v) for v in masks.run_lengths_of_mask(crowd)]  # uncompressed, as COCO's crowd regions
    annotations = [
        _ann(1, [2, 2, 30, 20], segmentation=[[2.0, 2.0, 12.5, 2.0, 7.0, 12.0], [20, 3, 31.5, 3, 31.5, 14, 20, 14]]),
        _ann(1, [10, 5, 20, 20], segmentation={"size": [30, 40], "counts": compressed["counts"]}),
        _ann(1, [0, 0, 8, 6], iscrowd=1, segmentation={"size": [30, 40], "counts": crowd_runs}),
        _ann(1, [1, 1, 5, 5]),  # no segmentation: a box alone, nothing counted
        _ann(1, [1, 1, 5, 5], segmentation=[[1, 1, 5, 5]]),  # invalid_mask: a 2-point "polygon"
        _ann(1, [1, 1, 5, 5], segmentation={"size": [31, 40], "counts": compressed["counts"]}),  # mask_size_mismatch
        _ann(
            1, [1, 1, 5, 5], segmentation={"size": [30, 40], "counts": [5, 3]}
        ),  # invalid_mask: not the image's pixels
        _ann(1, [1, 1, 5, 5], segmentation=[]),  # empty_mask
        _ann(1, [1, 1, 5, 5], segmentation={"size": [30, 40], "counts": "~~"}),  # invalid_mask: damaged string
        _ann(2, [3, 3, 10, 10], segmentation=[[3, 3, 13, 3, 13, 13, 3, 13]]),  # polygon sized by the file
    ]
    # Image 2's annotation first: grouping by image moves the segmentations with their boxes.
    json_path = _write_json(tmp_path / "instances.json", images, annotations[-1:] + annotations[:-1])
    for i, annotation in enumerate(annotations):
        annotation.setdefault("id", i + 1)
    reference = COCO()
    reference.dataset = {
        "images": [{**images[0]}, {**images[1], "width": 24, "height": 20}],
        "annotations": [a for a in annotations if isinstance(a.get("segmentation"), (dict, list))][:3]
        + [annotations[-1]],
        "categories": [{"id": 1, "name": "thing"}],
    }
    reference.createIndex()

    examples, counts = _read(json_path, tmp_path)
    first, second = examples
    assert first.mask_runs.tolist()[3:] == [0] * 6 and (first.mask_runs[:3] > 0).all()
    for index, annotation in enumerate(reference.dataset["annotations"][:3]):
        np.testing.assert_array_equal(_mask_of(first, index), reference.annToMask(annotation).astype(bool))
    np.testing.assert_array_equal(_mask_of(second, 0), reference.annToMask(reference.dataset["annotations"][3]) > 0)
    assert counts["invalid_mask"] == 3 and counts["mask_size_mismatch"] == 1 and counts["empty_mask"] == 1
    assert len(first.labels) == 9  # every box kept, with or without its mask


def test_ground_truth_columns_carry_pycocotools_masks_when_every_box_has_one(tmp_path):
    """Mask columns decode to pycocotools' annToMask: polygon parts merged, compressed and crowd RLE."""
    from pycocotools import mask as coco_mask
    from pycocotools.coco import COCO

    images = [
        {"id": 1, "file_name": "a.png", "width": 40, "height": 30},
        {"id": 2, "file_name": "b.png", "width": 24, "height": 20},
    ]
    ring = np.zeros([30, 40], np.uint8)
    ring[5:25, 10:30] = 1
    ring[10:20, 15:25] = 0
    compressed = coco_mask.encode(np.asfortranarray(ring))
    crowd = np.zeros([20, 24], np.uint8)
    crowd[0:6, 3:8] = 1
    crowd_runs = [int(v) for v in masks.run_lengths_of_mask(crowd)]
    annotations = [
        _ann(2, [3, 3, 10, 10], segmentation=[[3, 3, 13, 3, 13, 13, 3, 13]]),
        _ann(1, [2, 2, 30, 20], segmentation=[[2.0, 2.0, 12.5, 2.0, 7.0, 12.0], [20, 3, 31.5, 3, 31.5, 14, 20, 14]]),
        _ann(1, [10, 5, 20, 20], segmentation={"size": [30, 40], "counts": compressed["counts"].decode("ascii")}),
        _ann(2, [3, 0, 5, 6], iscrowd=1, segmentation={"size": [20, 24], "counts": crowd_runs}),
        _ann(1, [0, 0, 0, 1], segmentation=[[1, 1, 5, 5]]),  # not scorable (empty box): its mask is no matter
    ]
    for i, annotation in enumerate(annotations):
        annotation.update(id=i + 1, area=10.0)
    json_path = _write_json(tmp_path / "instances.json", images, annotations)

    columns = coco_json.load_ground_truth_columns(json_path)
    reference = COCO(json_path)
    scored = annotations[:4]
    assert len(columns["mask_heights"]) == len(columns["mask_offsets"]) - 1 == len(scored)
    assert columns["mask_heights"].dtype == np.int32 and columns["mask_widths"].dtype == np.int32
    assert columns["mask_counts"].dtype == np.uint8 and columns["mask_offsets"].dtype == np.int64
    data, offsets = columns["mask_counts"].tobytes(), columns["mask_offsets"]
    for i, annotation in enumerate(scored):
        size = [int(columns["mask_heights"][i]), int(columns["mask_widths"][i])]
        rle = {"size": size, "counts": data[offsets[i] : offsets[i + 1]]}
        expected = reference.annToMask(reference.anns[annotation["id"]])
        assert expected.any()
        np.testing.assert_array_equal(coco_mask.decode(rle), expected)

    # One scorable annotation without a segmentation, or one that is no mask: no mask columns at all.
    for odd in (_ann(1, [1, 1, 5, 5]), _ann(1, [1, 1, 5, 5], segmentation={"size": [31, 40], "counts": "PT1"})):
        json_path = _write_json(tmp_path / "odd.json", images, scored + [odd])
        columns = coco_json.load_ground_truth_columns(json_path)
        assert len(columns["areas"]) == 5
        assert not any(name.startswith("mask_") for name in columns)
    # Polygons of an image without its size in the JSON: no mask columns either.
    json_path = _write_json(tmp_path / "sizeless.json", [images[0], {"id": 2, "file_name": "b.png"}], scored)
    assert "mask_counts" not in coco_json.load_ground_truth_columns(json_path)

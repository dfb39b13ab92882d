"""COCO-format folders: an instances JSON plus a directory of image files.

This is the format users bring their own data in. The JSON is the usual COCO
"instances" layout:

  {"images":      [{"id": int, "file_name": str, "width": int, "height": int}],
   "annotations": [{"image_id": int, "category_id": int,
                    "bbox": [x, y, w, h], "iscrowd": 0 or 1}],
   "categories":  [{"id": int, "name": str}]}

`file_name` is relative to the image directory; `width`/`height` may be left
out, and then the size in the image file's header is used. `bbox` is in
absolute pixels of the image file.

Labels are contiguous, 0..K-1 by ascending category id: COCO's ids have gaps
(1..90 for 80 classes), and feeding them to a K-class head unmapped is the
classic cause of "mAP is 0". `CocoCategories.category_ids[label]` maps a label
back to the id that evaluation files use.

Structural problems (the file missing or not JSON, the top-level lists
missing, duplicate image or category ids, no categories, the image directory
missing, malformed image or category entries) raise `DatasetError`. Problems
with single annotations are common in real data: their rows are kept, with
their status (`ImageTable`), and `coco_images` drops or fixes them and counts
them when it makes the examples.

How the JSON is read: json_stream finds the top-level lists without
parsing them, then reads categories, images and annotations in that order
(whatever their order in the file), one element at a time, into numpy
columns (an ImageTable): per image its id, width, height and file name, per
annotation its image's row, label, box and flags, about 60 bytes per
annotation while parsing and 40 after. So labels and image rows are
resolved as annotations stream by, and no Python object per annotation
outlives its chunk (json.loads held the whole file as dicts: 1.97 GB at
200,000 images and 1.4 million boxes). The columns live in files
(column_files) when conversion runs in several processes; each process
reads only the rows of its images.
"""

from __future__ import annotations

import array
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from input_pipeline import masks
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import box_checks, json_stream
from input_pipeline.datasets.column_files import ColumnFiles

# Annotations become numpy columns this many at a time: each chunk's Python
# objects are dropped before the next chunk is parsed.
_PARSE_CHUNK = 1 << 16
# Images whose names are re-sorted at once, and whose rows coco_images reads at once.
READ_BLOCK = 4096

_REQUIRED_LISTS = ("images", "annotations", "categories")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# ImageTable.box_status: the bbox is fine, not 4 finite numbers, or w or h <= 0.
BOX_OK, BOX_INVALID, BOX_EMPTY = 0, 1, 2
BOX_KEYS = {BOX_INVALID: "invalid_box", BOX_EMPTY: "empty_box"}
_JSON_NUMBERS = frozenset({int, float})
_NO_BOX = (0.0, 0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class CocoCategories:
    """The classes of a COCO-format dataset.

    Attributes:
      category_ids: the K category ids of the JSON, sorted ascending; contiguous
        label i is category_ids[i].
      class_names: the K category names, in the same order.
    """

    category_ids: tuple[int, ...]
    class_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ImageTable:
    """A COCO instances JSON as columns: images in ascending id order (the order examples come in).

    The columns (`columns`, rows per image: N, per kept annotation: M):
      image_id int64 [N]; width, height int32 [N] pixels from the JSON, 0
      where it gives none (the file's header decides); name_offset int64
      [N + 1] into name uint8 [B], the UTF-8 file names; annotation_offset
      int64 [N + 1]: image i's annotations are rows annotation_offset[i] to
      annotation_offset[i + 1], in the JSON's order; label int32 [M], -1 when
      category_id is not a category; box_status uint8 [M] (BOX_OK,
      BOX_INVALID, BOX_EMPTY); x, y, w, h float64 [M] the bbox as written
      (0 unless BOX_OK); crowd bool [M]; segmentation_offset int64 [M + 1]
      into segmentation uint8 [S]: each annotation's `segmentation` as
      compact JSON, empty where it has none. Annotations of unknown images
      are counted and left out.

    Attributes:
      columns: the columns above.
      num_images: N.
      categories: the JSON's categories.
      counts: the JSON-level counts: images, annotations, annotation_unknown_image.
    """

    columns: ColumnFiles
    num_images: int
    categories: CocoCategories
    counts: dict[str, int]


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as an id is a JSON mistake, not id 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64(value: Any) -> bool:
    return _is_int(value) and _INT64_MIN <= value <= _INT64_MAX


def _outline(json_path: str) -> json_stream.Outline:
    """The outline of a COCO instances JSON, structurally checked.

    Raises:
      DatasetError: the file is missing, unreadable, not JSON, or lacks one of
        the top-level `images`, `annotations`, `categories` lists.
    """
    fix = "pass the path of a COCO instances JSON (like instances_val2017.json)"
    if not os.path.isfile(json_path):
        raise DatasetError(f"COCO annotations file {json_path} does not exist or is not a file; {fix}")
    try:
        outline = json_stream.outline(json_path)
    except OSError as e:
        raise DatasetError(
            f"cannot read COCO annotations file {json_path} ({e.strerror}); check its permissions"
        ) from e
    except json_stream.JsonError as e:
        raise DatasetError(f"COCO annotations file {json_path} is not valid JSON ({e}); {fix}") from e
    except TypeError as e:  # valid JSON, but no object: the message is the type json.loads gives
        raise DatasetError(f"COCO annotations file {json_path} holds a {e}, not an object; {fix}") from e
    for key in _REQUIRED_LISTS:
        if outline.kind(key) != "list":
            raise DatasetError(
                f"COCO annotations file {json_path} has no '{key}' list; a COCO instances JSON needs "
                "top-level 'images', 'annotations' and 'categories' lists (an empty list is fine for "
                "'annotations')"
            )
    return outline


def _items(outline: json_stream.Outline, key: str, json_path: str) -> Iterator[Any]:
    """The elements of the top-level list `key`; DatasetError where its bytes are not valid JSON."""
    try:
        yield from outline.items(key)
    except json_stream.JsonError as e:
        raise DatasetError(
            f"COCO annotations file {json_path} is not valid JSON ({e}, in '{key}'); pass the path of a COCO "
            "instances JSON (like instances_val2017.json)"
        ) from e


def _check_other_values(outline: json_stream.Outline, json_path: str) -> None:
    """Parses the values this module does not read ('info', 'licenses', ...): json.loads would reject them too."""
    try:
        outline.check_all(read=_REQUIRED_LISTS)
    except json_stream.JsonError as e:
        raise DatasetError(f"COCO annotations file {json_path} is not valid JSON ({e}); fix the file") from e


def _parse_categories(outline: json_stream.Outline, json_path: str) -> CocoCategories:
    """The categories of the JSON, sorted by id (see CocoCategories)."""
    names_by_id = {}
    for cat in _items(outline, "categories", json_path):
        if not isinstance(cat, dict) or not _is_int(cat.get("id")):
            raise DatasetError(
                f"{json_path}: category {cat!r:.80} has no integer 'id'; write every category as "
                '{"id": int, "name": str}'
            )
        if cat["id"] in names_by_id:
            raise DatasetError(
                f"{json_path}: category id {cat['id']} is listed twice in 'categories'; make category ids unique"
            )
        names_by_id[cat["id"]] = str(cat.get("name", cat["id"]))
    if not names_by_id:
        raise DatasetError(
            f"{json_path}: 'categories' is empty, so there is nothing to detect; list every class as "
            '{"id": int, "name": str}'
        )
    ids = tuple(sorted(names_by_id))
    return CocoCategories(category_ids=ids, class_names=tuple(names_by_id[i] for i in ids))


def _optional_size(value: Any) -> int | None:
    """A JSON width/height as a positive int, None when absent; raises ValueError."""
    if value is None:
        return None
    # Some exporters write 640.0; a fractional or non-positive size is a bug.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError
    if not (math.isfinite(value) and value > 0 and value == int(value)):
        raise ValueError
    return int(value)


def _read_images(outline: json_stream.Outline, json_path: str, columns: ColumnFiles) -> np.ndarray:
    """Writes the image columns of `columns` in ascending id order; returns the sorted int64 [N] ids.

    The entries are parsed _PARSE_CHUNK at a time and appended in the JSON's
    order; only then are the columns sorted by id (skipped when the JSON
    lists the images in id order, as COCO's files do), so no Python object
    per image outlives its chunk.
    """
    elements = _items(outline, "images", json_path)
    while True:
        ids, widths, heights, names = [], [], [], []
        for img in elements:
            if not (isinstance(img, dict) and _is_int(img.get("id")) and isinstance(img.get("file_name"), str)):
                raise DatasetError(
                    f"{json_path}: image {img!r:.80} needs an integer 'id' and a string 'file_name'; fix that "
                    "entry of 'images'"
                )
            if not _is_int64(img["id"]):
                raise DatasetError(f"{json_path}: image id {img['id']} does not fit in 64 bits; renumber the images")
            try:
                width, height = _optional_size(img.get("width")), _optional_size(img.get("height"))
            except ValueError:
                raise DatasetError(
                    f"{json_path}: image {img['id']} has width {img.get('width')!r} and height "
                    f"{img.get('height')!r}; give positive integer pixel sizes or leave both out"
                ) from None
            ids.append(img["id"])
            widths.append(width or 0)
            heights.append(height or 0)
            names.append(img["file_name"].encode("utf-8", "surrogatepass"))
            if len(ids) >= _PARSE_CHUNK:
                break
        if not ids:
            break
        columns.append("image_id", np.asarray(ids, np.int64))
        columns.append("width", np.asarray(widths, np.int32))
        columns.append("height", np.asarray(heights, np.int32))
        columns.append("name_length", np.fromiter(map(len, names), np.int64, len(names)))
        columns.append("name", np.frombuffer(b"".join(names), np.uint8))
    if "image_id" not in columns:  # no images at all
        for name, dtype in (("image_id", np.int64), ("width", np.int32), ("height", np.int32), ("name", np.uint8)):
            columns.append(name, np.zeros([0], dtype))
        columns.append("name_length", np.zeros([0], np.int64))
    image_ids = columns.read("image_id")
    lengths = columns.read("name_length")
    columns.delete("name_length")
    if len(image_ids) > 1 and (np.diff(image_ids) < 0).any():
        order = np.argsort(image_ids, kind="stable")
        image_ids = image_ids[order]
        columns.replace("image_id", image_ids)
        for name in ("width", "height"):
            columns.replace(name, columns.read(name)[order])
        _reorder_bytes(columns, "name", lengths, order)
        lengths = lengths[order]
    repeated = np.flatnonzero(image_ids[1:] == image_ids[:-1])
    if len(repeated):
        raise DatasetError(
            f"{json_path}: image id {image_ids[repeated[0]]} is listed twice in 'images'; make image ids unique"
        )
    columns.append("name_offset", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    return image_ids


def _reorder_bytes(columns: ColumnFiles, name: str, lengths: np.ndarray, order: np.ndarray) -> None:
    """Rewrites the concatenated byte strings of column `name` (`lengths` int64 [N] each) in `order` (int64 [N]),
    READ_BLOCK strings at a time."""
    data = columns.read(name).tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    columns.delete(name)
    columns.append(name, np.zeros([0], np.uint8))
    for lo in range(0, len(order), READ_BLOCK):
        block = order[lo : lo + READ_BLOCK].tolist()
        starts, stops = offsets[block].tolist(), offsets[np.asarray(block) + 1].tolist()
        joined = b"".join(data[a:b] for a, b in zip(starts, stops))
        columns.append(name, np.frombuffer(joined, np.uint8))


def _int64_column(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [n] values, bool [n] valid): ids that are JSON integers within int64 (not bool), 0 elsewhere."""
    valid = [type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in values]
    return np.array([v if ok else 0 for v, ok in zip(values, valid)], np.int64), np.array(valid, bool)


def _box_columns(bboxes: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [n] _BOX_* status, float64 [n, 4] x, y, w, h where BOX_OK, else 0) of COCO bboxes.

    What JSON can hold as a well-formed bbox is a list of 4 ints or floats
    (not bools); numpy converts and checks those together, which costs a
    tenth of _xywh_problem per box. Ints beyond float range fall back to it.
    """
    numbers = _JSON_NUMBERS
    plain = [
        type(b) is list
        and len(b) == 4
        and type(b[0]) in numbers
        and type(b[1]) in numbers
        and type(b[2]) in numbers
        and type(b[3]) in numbers
        for b in bboxes
    ]
    try:
        xywh = np.array([b if ok else _NO_BOX for b, ok in zip(bboxes, plain)], np.float64).reshape(-1, 4)
    except OverflowError:
        status = [{None: BOX_OK, "invalid_box": BOX_INVALID, "empty_box": BOX_EMPTY}[_xywh_problem(b)] for b in bboxes]
        xywh = np.array([[float(v) for v in b] if st == BOX_OK else _NO_BOX for b, st in zip(bboxes, status)])
        return np.array(status, np.uint8), xywh.reshape(-1, 4)
    finite = np.array(plain, bool) & np.isfinite(xywh).all(axis=1)
    # Checked before adding: x + w may round back to x.
    positive = (xywh[:, 2] > 0) & (xywh[:, 3] > 0)
    status = np.where(finite, np.where(positive, BOX_OK, BOX_EMPTY), BOX_INVALID).astype(np.uint8)
    xywh[status != BOX_OK] = 0
    return status, xywh


def _xywh_problem(bbox: Any) -> str | None:
    """'invalid_box' (not 4 finite numbers) or 'empty_box' (w or h <= 0) for a COCO bbox, else None."""
    if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4):
        return "invalid_box"
    if not all(box_checks.is_number(v, finite=True) for v in bbox):
        return "invalid_box"
    if float(bbox[2]) <= 0 or float(bbox[3]) <= 0:
        return "empty_box"  # Checked before adding: x + w may round back to x.
    return None


def _lookup(sorted_keys: np.ndarray, keys: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """int64 [n]: the index of each of `keys` in `sorted_keys`, -1 where absent or not `valid`."""
    index = np.searchsorted(sorted_keys, keys)
    clipped = np.minimum(index, max(len(sorted_keys) - 1, 0))
    found = valid & (index < len(sorted_keys))
    if len(sorted_keys):
        found &= sorted_keys[clipped] == keys
    return np.where(found, index, -1)


def _read_annotations(
    outline: json_stream.Outline, json_path: str, image_ids: np.ndarray, category_ids: np.ndarray, columns: ColumnFiles
) -> tuple[int, int]:
    """Writes the annotation columns of `columns` grouped by image; returns (annotations, of unknown images)."""
    total, unknown = 0, 0
    rows_chunks = []  # int32 image rows of the kept annotations: the only column held whole
    elements = _items(outline, "annotations", json_path)
    while True:
        image_id, category_id, bbox, crowd, segmentation = [], [], [], [], []
        for ann in elements:
            if not isinstance(ann, dict):
                raise DatasetError(
                    f"{json_path}: annotation {ann!r:.80} is not an object; fix that entry of 'annotations'"
                )
            image_id.append(ann.get("image_id"))
            category_id.append(ann.get("category_id"))
            bbox.append(ann.get("bbox"))
            crowd.append(ann.get("iscrowd", 0))
            segmentation.append(ann.get("segmentation"))
            if len(bbox) >= _PARSE_CHUNK:
                break
        if not bbox:
            break
        total += len(bbox)
        rows = _lookup(image_ids, *_int64_column(image_id))
        labels = _lookup(category_ids, *_int64_column(category_id))
        status, xywh = _box_columns(bbox)
        kept = rows >= 0
        unknown += int((~kept).sum())
        rows_chunks.append(rows[kept].astype(np.int32))
        columns.append("label", labels[kept].astype(np.int32))
        columns.append("box_status", status[kept])
        for i, name in enumerate(("x", "y", "w", "h")):
            columns.append(name, xywh[kept, i])
        columns.append("crowd", np.fromiter(map(bool, crowd), bool, len(crowd))[kept])
        # Each segmentation as compact JSON, checked and rasterised by the conversion workers (they know the
        # image's size, which the JSON may not give).
        encoded = [
            b"" if s is None else json.dumps(s, separators=(",", ":")).encode()
            for s, k in zip(segmentation, kept.tolist())
            if k
        ]
        columns.append("segmentation_length", np.fromiter(map(len, encoded), np.int64, len(encoded)))
        columns.append("segmentation", np.frombuffer(b"".join(encoded), np.uint8))
    rows = np.concatenate(rows_chunks) if rows_chunks else np.zeros([0], np.int32)
    del rows_chunks
    columns.append("annotation_offset", np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=len(image_ids)))]))
    if len(rows) and (np.diff(rows) < 0).any():
        # Group by image, keeping the JSON's order within an image; one
        # column at a time, so only one column is held whole besides `order`.
        order = np.argsort(rows, kind="stable")
        del rows
        for name in ("label", "box_status", "x", "y", "w", "h", "crowd"):
            columns.replace(name, columns.read(name)[order])
        lengths = columns.read("segmentation_length")
        _reorder_bytes(columns, "segmentation", lengths, order)
        columns.replace("segmentation_length", lengths[order])
    if "label" not in columns:  # no annotations at all
        for name, dtype in (("label", np.int32), ("box_status", np.uint8), ("crowd", bool), ("segmentation", np.uint8)):
            columns.append(name, np.zeros([0], dtype))
        for name in ("x", "y", "w", "h"):
            columns.append(name, np.zeros([0], np.float64))
        columns.append("segmentation_length", np.zeros([0], np.int64))
    lengths = columns.read("segmentation_length")
    columns.delete("segmentation_length")
    columns.append("segmentation_offset", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    return total, unknown


def _check_image_root(image_root: str, json_path: str) -> None:
    if not os.path.isdir(image_root):
        raise DatasetError(
            f"image directory {image_root} does not exist or is not a directory; pass the folder that "
            f"the 'file_name' entries of {json_path} are relative to"
        )


def read_table(json_path: str, image_root: str, columns: ColumnFiles | None = None) -> ImageTable:
    """Reads and checks a COCO instances JSON into an ImageTable (see module doc for the errors).

    Args:
      json_path: the COCO instances JSON.
      image_root: the image directory (only checked to exist here).
      columns: where the columns go (empty); None keeps them in memory.

    Raises:
      DatasetError: the JSON or image_root is unusable (see module doc).
    """
    json_path, image_root = os.fspath(json_path), os.fspath(image_root)
    outline = _outline(json_path)
    categories = _parse_categories(outline, json_path)
    _check_image_root(image_root, json_path)
    columns = ColumnFiles(None) if columns is None else columns
    image_ids = _read_images(outline, json_path, columns)
    category_ids = np.asarray(categories.category_ids, np.int64)
    annotations, unknown = _read_annotations(outline, json_path, image_ids, category_ids, columns)
    _check_other_values(outline, json_path)
    counts = {"images": len(image_ids), "annotations": annotations, "annotation_unknown_image": unknown}
    return ImageTable(columns=columns, num_images=len(image_ids), categories=categories, counts=counts)


def read_categories(json_path: str) -> CocoCategories:
    """The categories of a COCO instances JSON (to size the model's head).

    Reads the file's outline and its categories only (about 0.2 s per 100 MB
    of JSON); a syntax error inside the images or annotations shows when
    the folder is converted.

    Raises:
      DatasetError: the JSON is unusable (see module doc).
    """
    json_path = os.fspath(json_path)
    return _parse_categories(_outline(json_path), json_path)


def _scorable_annotations(
    outline: json_stream.Outline, json_path: str, image_ids: np.ndarray, categories: CocoCategories
) -> Iterator[dict[str, Any]]:
    """The annotations COCO evaluation can score, one at a time; checks the rest of the file after them."""
    known_images, known_categories = set(image_ids.tolist()), set(categories.category_ids)
    for ann in _items(outline, "annotations", json_path):
        if not isinstance(ann, dict):
            continue
        try:
            known = ann.get("image_id") in known_images and ann.get("category_id") in known_categories
        except TypeError:  # an unhashable id (a list or an object) is nobody's
            known = False
        if known and not _xywh_problem(ann.get("bbox")):
            yield ann
    _check_other_values(outline, json_path)


def load_ground_truth_columns(json_path: str) -> dict[str, np.ndarray]:
    """`load_ground_truth`'s boxes as columns: what COCO scoring reads, without a dict per box.

    Returns:
      image_ids int64 [I] (ascending), category_ids int64 [K] (ascending),
      and per box: box_image_ids, box_category_ids int64 [M], boxes_xywh
      float64 [M, 4] as written, areas float64 [M] (`area`, else w * h),
      is_crowd bool [M]. When every one of the M annotations has a usable
      `segmentation` and its image's `height` and `width` are in the JSON,
      also each box's mask in image pixels as pycocotools' `annToRLE` makes
      it (polygon parts merged, uncompressed RLE such as crowd regions
      compressed, compressed RLE as written; an empty polygon list an empty
      mask), as COCO compressed RLE strings: mask_heights, mask_widths int32
      [M], mask_counts uint8 [bytes] the strings back to back, mask_offsets
      int64 [M + 1] (mask i is mask_counts[mask_offsets[i]:mask_offsets[i + 1]]).
      One annotation without a segmentation, with one that cannot be a mask
      (`masks.run_lengths_from_segmentation`'s invalid_mask or
      mask_size_mismatch), or of an image without a size in the JSON leaves
      the mask columns out: masks are then not scored (no segm AP).

    Raises:
      DatasetError: the JSON is unusable (see module doc).
    """
    json_path = os.fspath(json_path)
    outline = _outline(json_path)
    categories = _parse_categories(outline, json_path)
    image_columns = ColumnFiles(None)
    image_ids = _read_images(outline, json_path, image_columns)
    sizes = dict(
        zip(image_ids.tolist(), zip(image_columns.read("height").tolist(), image_columns.read("width").tolist()))
    )
    box_images, box_categories, boxes, areas, crowd = (array.array(code) for code in "qqddb")
    # The masks while every annotation so far has one: sizes, string lengths, the strings back to back.
    mask_heights, mask_widths, mask_lengths, mask_counts = (
        array.array("i"),
        array.array("i"),
        array.array("q"),
        bytearray(),
    )
    with_masks = True
    for ann in _scorable_annotations(outline, json_path, image_ids, categories):
        box_images.append(ann["image_id"])
        box_categories.append(ann["category_id"])
        bbox = [float(v) for v in ann["bbox"]]
        boxes.extend(bbox)
        area = ann.get("area")
        areas.append(float(area) if box_checks.is_number(area, finite=True) else bbox[2] * bbox[3])
        crowd.append(bool(ann.get("iscrowd", 0)))
        if with_masks:
            height, width = sizes[ann["image_id"]]
            counts = _mask_string(ann.get("segmentation"), height, width)
            if counts is None:
                with_masks = False
                del mask_heights, mask_widths, mask_lengths, mask_counts
                continue
            mask_heights.append(height)
            mask_widths.append(width)
            mask_lengths.append(len(counts))
            mask_counts += counts
    columns = {
        "image_ids": image_ids,
        "category_ids": np.asarray(categories.category_ids, np.int64),
        "box_image_ids": np.frombuffer(box_images, np.int64).copy(),
        "box_category_ids": np.frombuffer(box_categories, np.int64).copy(),
        "boxes_xywh": np.frombuffer(boxes, np.float64).reshape(-1, 4).copy(),
        "areas": np.frombuffer(areas, np.float64).copy(),
        "is_crowd": np.frombuffer(crowd, np.int8).astype(bool),
    }
    if with_masks:
        columns["mask_heights"] = np.frombuffer(mask_heights, np.int32).copy()
        columns["mask_widths"] = np.frombuffer(mask_widths, np.int32).copy()
        columns["mask_counts"] = np.frombuffer(bytes(mask_counts), np.uint8).copy()
        lengths = np.frombuffer(mask_lengths, np.int64)
        columns["mask_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return columns


def _mask_string(segmentation: Any, height: int, width: int) -> bytes | None:
    """An annotation's mask over its height x width image as a COCO compressed RLE string, None where none can be.

    None for no segmentation, an image whose size the JSON does not give
    (`height` or `width` 0), and a segmentation that cannot be a mask of
    that image (`masks.run_lengths_from_segmentation`); an empty mask (an
    empty polygon list, a polygon covering no pixel's centre) is a mask.
    """
    import hotcoco

    if segmentation is None or not height or not width:
        return None
    run_lengths, problem = masks.run_lengths_from_segmentation(segmentation, height, width)
    if problem == "empty_mask":
        return masks.run_lengths_to_string(np.array([height * width], np.int64))
    if run_lengths is None:
        return None
    if isinstance(segmentation, dict):
        counts = segmentation["counts"]
        # Compressed as written (pycocotools takes it as is); uncompressed (crowd regions, a few per image)
        # compressed by a Python loop over the runs.
        return counts.encode("ascii") if isinstance(counts, str) else masks.run_lengths_to_string(run_lengths)
    # Polygons: hotcoco rasterised them to check them; once more for the string costs less than a Python loop.
    counts = hotcoco.mask.merge(hotcoco.mask.frPyObjects(segmentation, height, width))["counts"]
    return counts.encode("ascii") if isinstance(counts, str) else bytes(counts)


def load_ground_truth(json_path: str) -> dict[str, Any]:
    """The user's instances JSON as COCO evaluation ground truth.

    Boxes stay exactly as the user wrote them. What pycocotools cannot score
    is left out (annotations of unknown images or categories, and boxes that
    are not 4 finite numbers with positive size: conversion dropped those from
    training too), and what COCO defines a default for is filled in: `area`
    (w * h), `iscrowd` (0) and a unique `id`. The annotations are read one at
    a time: only those kept are held.

    Returns:
      {'images', 'annotations', 'categories'} lists (COCO format).

    Raises:
      DatasetError: the JSON is unusable (see module doc).
    """
    json_path = os.fspath(json_path)
    outline = _outline(json_path)
    categories = _parse_categories(outline, json_path)
    columns = ColumnFiles(None)
    image_ids = _read_images(outline, json_path, columns)
    annotations, max_id = [], 0
    for ann in _scorable_annotations(outline, json_path, image_ids, categories):
        if _is_int(ann.get("id")):
            max_id = max(max_id, ann["id"])  # new ids start above every kept one
        ann = dict(ann)
        bbox = ann["bbox"]
        ann.setdefault("area", float(bbox[2]) * float(bbox[3]))
        ann["iscrowd"] = int(bool(ann.get("iscrowd", 0)))
        annotations.append(ann)
    # COCO evaluation needs unique ids, and treats id 0 as "unmatched".
    next_id, seen_ids = max_id + 1, set()
    for ann in annotations:
        if not _is_int(ann.get("id")) or ann["id"] in seen_ids or ann["id"] == 0:
            ann["id"], next_id = next_id, next_id + 1
        seen_ids.add(ann["id"])
    widths, heights = columns.read("width").tolist(), columns.read("height").tolist()
    name_offsets, names = columns.read("name_offset").tolist(), columns.read("name").tobytes()
    images = []
    for i, image_id in enumerate(image_ids.tolist()):
        name = names[name_offsets[i] : name_offsets[i + 1]].decode("utf-8", "surrogatepass")
        size = {"width": widths[i], "height": heights[i] or None} if widths[i] else {}
        images.append({"id": image_id, "file_name": name, **size})
    return {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c, "name": n} for c, n in zip(categories.category_ids, categories.class_names)],
    }

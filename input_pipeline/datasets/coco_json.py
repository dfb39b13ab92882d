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
with single annotations or files are common in real data, so they drop or fix
the annotation or image and are counted instead, in the `counts` Counter that
`iter_examples` updates:

  images                    images listed in the JSON.
  annotations               annotations listed in the JSON.
  usable_images             images yielded.
  annotation_unknown_image  annotation dropped: its image_id is not in images.
  missing_image_file        image skipped: no file at image_root/file_name.
  unreadable_image          image skipped: PIL cannot read the file's header
                            (not an image, garbage, unreadable file).
  size_mismatch             image skipped: the header's size differs from the
                            JSON's width/height, so the boxes would be in the
                            wrong frame.
  unknown_category          annotation dropped: category_id not in categories.
  invalid_box               annotation dropped: bbox is not 4 finite numbers.
  empty_box                 annotation dropped: w <= 0 or h <= 0.
  outside_box               annotation dropped: nothing of the box is left
                            after clipping it to the image.
  clipped_box               annotation kept, its box clipped to the image.
  crowd_box                 annotation kept as a crowd region (is_crowd);
                            can also be counted as clipped_box.
  no_annotations            image yielded with no boxes (none in the JSON, or
                            all dropped): a negative example.
  converted_16bit           image kept; the decoder reduces 16-bit samples to
                            8 bits (PIL mode 'I;16*', or 'I' for a PNG).
  converted_alpha           image kept; the decoder drops its alpha channel
                            (modes 'RGBA', 'LA', 'PA', 'RGBa', 'La').
  converted_cmyk            image kept; the decoder converts CMYK to RGB.
  converted_palette         image kept; the decoder expands its palette ('P').
  converted_grayscale       image kept; the decoder repeats one channel to
                            three (modes '1', 'L', 'I', 'F').

An image is counted under at most one converted_* key, the first that applies
in the order 16bit, alpha, cmyk, palette, grayscale: the earlier ones lose
more information (a 16-bit or an 'LA' image is also grayscale, but its bit
depth or alpha is what the conversion throws away).

The annotation keys after annotation_unknown_image (unknown_category to
crowd_box) and no_annotations count the annotations of yielded images only:
a skipped image's annotations are never examined, since the JSON may lack its
size and its file holds none.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import os
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np
from PIL import Image

from input_pipeline import records
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import box_checks

# At most this many images are read ahead of the consumer. It bounds memory
# (the encoded bytes of this many images) while keeping every thread busy.
_MAX_IN_FLIGHT = 256

_REQUIRED_LISTS = ("images", "annotations", "categories")


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
class _ImageEntry:
    """One entry of the JSON's `images` list; width/height None when absent."""

    image_id: int
    file_name: str
    width: int | None
    height: int | None


@dataclasses.dataclass(frozen=True)
class _FileInfo:
    """What a worker thread learns about one image file."""

    data: bytes
    width: int
    height: int
    mode: str
    format: str | None


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as an id is a JSON mistake, not id 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _load_json(json_path: str) -> dict[str, Any]:
    """Reads and structurally checks a COCO instances JSON.

    Raises:
      DatasetError: the file is missing, unreadable, not JSON, or lacks one of
        the top-level `images`, `annotations`, `categories` lists.
    """
    fix = "pass the path of a COCO instances JSON (like instances_val2017.json)"
    if not os.path.isfile(json_path):
        raise DatasetError(f"COCO annotations file {json_path} does not exist or is not a file; {fix}")
    try:
        with open(json_path, "rb") as f:
            data = json.loads(f.read())
    except OSError as e:
        raise DatasetError(
            f"cannot read COCO annotations file {json_path} ({e.strerror}); check its permissions"
        ) from e
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"COCO annotations file {json_path} is not valid JSON ({cause}); {fix}") from e
    if not isinstance(data, dict):
        raise DatasetError(f"COCO annotations file {json_path} holds a {type(data).__name__}, not an object; {fix}")
    for key in _REQUIRED_LISTS:
        if not isinstance(data.get(key), list):
            raise DatasetError(
                f"COCO annotations file {json_path} has no '{key}' list; a COCO instances JSON needs "
                "top-level 'images', 'annotations' and 'categories' lists (an empty list is fine for "
                "'annotations')"
            )
    return data


def _parse_categories(data: dict[str, Any], json_path: str) -> CocoCategories:
    """The categories of a loaded JSON, sorted by id (see CocoCategories)."""
    names_by_id = {}
    for cat in data["categories"]:
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


def _parse_images(data: dict[str, Any], json_path: str) -> list[_ImageEntry]:
    """The JSON's images, sorted by id (the order they are yielded in)."""
    entries = {}
    for img in data["images"]:
        if not (isinstance(img, dict) and _is_int(img.get("id")) and isinstance(img.get("file_name"), str)):
            raise DatasetError(
                f"{json_path}: image {img!r:.80} needs an integer 'id' and a string 'file_name'; fix that "
                "entry of 'images'"
            )
        if img["id"] in entries:
            raise DatasetError(f"{json_path}: image id {img['id']} is listed twice in 'images'; make image ids unique")
        try:
            width, height = _optional_size(img.get("width")), _optional_size(img.get("height"))
        except ValueError:
            raise DatasetError(
                f"{json_path}: image {img['id']} has width {img.get('width')!r} and height "
                f"{img.get('height')!r}; give positive integer pixel sizes or leave both out"
            ) from None
        entries[img["id"]] = _ImageEntry(img["id"], img["file_name"], width, height)
    return [entries[i] for i in sorted(entries)]


def _read_image(path: str) -> _FileInfo | str:
    """Reads one image file and its header (runs in a worker thread).

    Returns:
      The file's bytes and header, or the count key of why it is unusable:
      'missing_image_file' or 'unreadable_image'.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "missing_image_file"
    except OSError:
        return "unreadable_image"
    try:
        # Image.open only parses the header; full decoding of millions of images
        # would dominate, and truncated pixel data is caught by the decoder later.
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            return _FileInfo(data=data, width=width, height=height, mode=img.mode, format=img.format)
    except Exception:  # noqa: BLE001  PIL plugins raise many types on garbage.
        return "unreadable_image"


def _box_yxyx(bbox: Any, width: int, height: int) -> tuple[str | None, np.ndarray | None]:
    """Checks and converts one COCO bbox; see the module doc for the keys.

    Args:
      bbox: the annotation's `bbox`, [x, y, w, h] in pixels if well-formed.
      width, height: pixels of the image.

    Returns:
      (key, box): box is float32 [4] y0, x0, y1, x1 in pixels, clipped to the
      image, or None when dropped; key is the count key of what happened
      ('invalid_box', 'empty_box', 'outside_box', 'clipped_box'), None for a
      box kept unchanged.
    """
    problem = _xywh_problem(bbox)
    if problem:
        return problem, None
    x, y, w, h = (float(v) for v in bbox)
    return box_checks.clip_box_yxyx((y, x, y + h, x + w), height, width)


def _xywh_problem(bbox: Any) -> str | None:
    """'invalid_box' (not 4 finite numbers) or 'empty_box' (w or h <= 0) for a COCO bbox, else None."""
    if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4):
        return "invalid_box"
    if not all(box_checks.is_number(v, finite=True) for v in bbox):
        return "invalid_box"
    if float(bbox[2]) <= 0 or float(bbox[3]) <= 0:
        return "empty_box"  # Checked before adding: x + w may round back to x.
    return None


def _make_example(
    entry: _ImageEntry,
    info: _FileInfo,
    annotations: list[dict[str, Any]],
    label_of: dict[int, int],
    counts: collections.Counter,
) -> records.SourceExample:
    """Builds the example of one readable image, counting its annotations."""
    boxes, labels, crowd = [], [], []
    for ann in annotations:
        category_id = ann.get("category_id")
        if not (_is_int(category_id) and category_id in label_of):
            counts["unknown_category"] += 1
            continue
        key, box = _box_yxyx(ann.get("bbox"), info.width, info.height)
        if key is not None:
            counts[key] += 1
        if box is None:
            continue
        is_crowd = bool(ann.get("iscrowd", 0))
        if is_crowd:
            counts["crowd_box"] += 1
        boxes.append(box)
        labels.append(label_of[category_id])
        crowd.append(is_crowd)
    if not boxes:
        counts["no_annotations"] += 1
    return records.SourceExample(
        image_bytes=info.data,
        image_id=entry.image_id,
        height=info.height,
        width=info.width,
        boxes_yxyx=np.asarray(boxes, np.float32).reshape(-1, 4),
        labels=np.asarray(labels, np.int32),
        is_crowd=np.asarray(crowd, bool),
    )


def read_categories(json_path: str) -> CocoCategories:
    """The categories of a COCO instances JSON (to size the model's head).

    Loads the whole JSON, so it takes seconds for COCO-sized files.

    Raises:
      DatasetError: the JSON is unusable (see module doc).
    """
    json_path = os.fspath(json_path)
    return _parse_categories(_load_json(json_path), json_path)


def iter_examples(
    json_path: str, image_root: str, counts: collections.Counter, *, num_threads: int = 8
) -> Iterator[records.SourceExample]:
    """Reads a COCO-format folder as SourceExamples.

    The JSON is loaded and checked before this returns, so structural errors
    raise here rather than at the first `next()`. Files are then read lazily,
    by `num_threads` threads, as the iterator is consumed (on network file
    systems per-file latency dominates).

    Args:
      json_path: the COCO instances JSON.
      image_root: the directory that the images' `file_name`s are relative to.
      counts: updated in place with the keys of the module doc.
      num_threads: threads reading files and headers; the output does not
        depend on it.

    Returns:
      An iterator of one SourceExample per usable image, in ascending image-id
      order; boxes in the JSON's annotation order, labels contiguous by
      ascending category id (see read_categories).

    Raises:
      DatasetError: the JSON or image_root is unusable (see module doc).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    json_path, image_root = os.fspath(json_path), os.fspath(image_root)
    data = _load_json(json_path)
    categories = _parse_categories(data, json_path)
    if not os.path.isdir(image_root):
        raise DatasetError(
            f"image directory {image_root} does not exist or is not a directory; pass the folder that "
            f"the 'file_name' entries of {json_path} are relative to"
        )
    images = _parse_images(data, json_path)

    annotations_of = {entry.image_id: [] for entry in images}
    for ann in data["annotations"]:
        if not isinstance(ann, dict):
            raise DatasetError(f"{json_path}: annotation {ann!r:.80} is not an object; fix that entry of 'annotations'")
        image_id = ann.get("image_id")
        if not (_is_int(image_id) and image_id in annotations_of):
            counts["annotation_unknown_image"] += 1
            continue
        annotations_of[image_id].append(ann)
    counts["images"] += len(images)
    counts["annotations"] += len(data["annotations"])
    counts["usable_images"] += 0  # Present even when nothing is usable.

    label_of = {category_id: label for label, category_id in enumerate(categories.category_ids)}
    return _generate(images, annotations_of, label_of, image_root, counts, num_threads)


def _generate(
    images: list[_ImageEntry],
    annotations_of: dict[int, list[dict[str, Any]]],
    label_of: dict[int, int],
    image_root: str,
    counts: collections.Counter,
    num_threads: int,
) -> Iterator[records.SourceExample]:
    """The lazy part of iter_examples: reads files ahead in a bounded window."""
    with futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="coco_json") as pool:
        pending = collections.deque()  # (entry, future of _read_image), image order.
        remaining = iter(images)
        try:
            while True:
                # Submitting in image order and consuming from the left keeps the
                # output order independent of which thread finishes first.
                for entry in remaining:
                    pending.append((entry, pool.submit(_read_image, os.path.join(image_root, entry.file_name))))
                    if len(pending) >= _MAX_IN_FLIGHT:
                        break
                if not pending:
                    return
                entry, future = pending.popleft()
                info = future.result()
                annotations = annotations_of.pop(entry.image_id)
                if isinstance(info, str):
                    counts[info] += 1
                    continue
                if (entry.width is not None and entry.width != info.width) or (
                    entry.height is not None and entry.height != info.height
                ):
                    counts["size_mismatch"] += 1
                    continue
                conversion = box_checks.conversion_key(info.mode, info.format)
                if conversion is not None:
                    counts[conversion] += 1
                example = _make_example(entry, info, annotations, label_of, counts)
                counts["usable_images"] += 1
                yield example
        finally:
            # A consumer that stops early should not wait for the whole window.
            for _, future in pending:
                future.cancel()


def load_ground_truth(json_path: str) -> dict[str, Any]:
    """The user's instances JSON as COCO evaluation ground truth.

    Boxes stay exactly as the user wrote them. What pycocotools cannot score
    is left out (annotations of unknown images or categories, and boxes that
    are not 4 finite numbers with positive size: conversion dropped those from
    training too), and what COCO defines a default for is filled in: `area`
    (w * h), `iscrowd` (0) and a unique `id`.

    Returns:
      {'images', 'annotations', 'categories'} lists (COCO format).

    Raises:
      DatasetError: the JSON is unusable (see module doc).
    """
    json_path = os.fspath(json_path)
    data = _load_json(json_path)
    categories = _parse_categories(data, json_path)
    images = _parse_images(data, json_path)
    image_ids = {entry.image_id for entry in images}
    known_categories = set(categories.category_ids)
    used_ids = {a.get("id") for a in data["annotations"] if isinstance(a, dict) and _is_int(a.get("id"))}
    next_id = max(used_ids, default=0) + 1
    annotations, seen_ids = [], set()
    for ann in data["annotations"]:
        if not (
            isinstance(ann, dict) and ann.get("image_id") in image_ids and ann.get("category_id") in known_categories
        ):
            continue
        bbox = ann.get("bbox")
        if _xywh_problem(bbox):
            continue
        ann = dict(ann)
        ann.setdefault("area", float(bbox[2]) * float(bbox[3]))
        ann["iscrowd"] = int(bool(ann.get("iscrowd", 0)))
        # COCO evaluation needs unique ids, and treats id 0 as "unmatched".
        if not _is_int(ann.get("id")) or ann["id"] in seen_ids or ann["id"] == 0:
            ann["id"], next_id = next_id, next_id + 1
        seen_ids.add(ann["id"])
        annotations.append(ann)
    return {
        "images": [
            {"id": e.image_id, "file_name": e.file_name, **({"width": e.width, "height": e.height} if e.width else {})}
            for e in images
        ],
        "annotations": annotations,
        "categories": [{"id": c, "name": n} for c, n in zip(categories.category_ids, categories.class_names)],
    }

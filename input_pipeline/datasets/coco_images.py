"""COCO-format folders, second half: the table's images read from disk as examples, with their counts.

`coco_json` reads the instances JSON into an `ImageTable` (numpy columns);
this module reads each image file's bytes and header, by threads, in image
order, and makes one `records.SourceExample` per usable image. Problems with
single annotations or files are common in real data, so they drop or fix the
annotation or image and are counted instead, in the `counts` Counter that
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
  invalid_mask              annotation kept without its mask: a polygon part
                            under 3 points or not numbers, a damaged RLE.
  mask_size_mismatch        annotation kept without its mask: an RLE of
                            another size than the image.
  empty_mask                annotation kept without its mask: no pixel set.
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
import os
from collections.abc import Iterator
from concurrent import futures

import numpy as np
from PIL import Image

from input_pipeline import masks, records
from input_pipeline.datasets import box_checks, coco_json
from input_pipeline.datasets.column_files import ColumnFiles

# At most this many images are read ahead of the consumer. It bounds memory
# (the encoded bytes of this many images) while keeping every thread busy.
_MAX_IN_FLIGHT = 256


@dataclasses.dataclass(frozen=True)
class _ImageEntry:
    """One image of the table with its annotations' columns (lists, JSON order)."""

    image_id: int
    file_name: str
    width: int | None
    height: int | None
    labels: list[int]
    box_status: list[int]
    xywh: list[tuple[float, float, float, float]]
    crowd: list[bool]
    segmentations: list[bytes]  # each annotation's `segmentation` as JSON, b"" for none


@dataclasses.dataclass(frozen=True)
class _FileInfo:
    """What a worker thread learns about one image file."""

    data: bytes
    width: int
    height: int
    mode: str
    format: str | None


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


def _make_example(entry: _ImageEntry, info: _FileInfo, counts: collections.Counter) -> records.SourceExample:
    """Builds the example of one readable image, counting its annotations."""
    boxes, labels, crowd, run_lengths = [], [], [], []
    annotations = zip(entry.labels, entry.box_status, entry.xywh, entry.crowd, entry.segmentations)
    for label, status, (x, y, w, h), is_crowd, segmentation in annotations:
        if label < 0:
            counts["unknown_category"] += 1
            continue
        if status != coco_json.BOX_OK:
            counts[coco_json.BOX_KEYS[status]] += 1
            continue
        key, box = box_checks.clip_box_yxyx((y, x, y + h, x + w), info.height, info.width)
        if key is not None:
            counts[key] += 1
        if box is None:
            continue
        if is_crowd:
            counts["crowd_box"] += 1
        boxes.append(box)
        labels.append(label)
        crowd.append(is_crowd)
        mask, problem = masks.run_lengths_from_segmentation(
            json.loads(segmentation) if segmentation else None, info.height, info.width
        )
        if problem:
            counts[problem] += 1
        run_lengths.append(np.zeros([0], np.int64) if mask is None else mask)
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
        mask_runs=np.fromiter(map(len, run_lengths), np.int64, len(run_lengths)),
        mask_run_lengths=np.concatenate([np.zeros([0], np.int64), *run_lengths]),
    )


def _entries(columns: ColumnFiles, start: int, stop: int) -> Iterator[_ImageEntry]:
    """The table's images start..stop-1 with their annotations, reading coco_json.READ_BLOCK images' rows at a time."""
    for lo in range(start, stop, coco_json.READ_BLOCK):
        hi = min(stop, lo + coco_json.READ_BLOCK)
        ids = columns.read("image_id", lo, hi).tolist()
        widths = columns.read("width", lo, hi).tolist()
        heights = columns.read("height", lo, hi).tolist()
        name_offsets = columns.read("name_offset", lo, hi + 1)
        names = columns.read("name", int(name_offsets[0]), int(name_offsets[-1])).tobytes()
        name_offsets = (name_offsets - name_offsets[0]).tolist()
        offsets = columns.read("annotation_offset", lo, hi + 1)
        first, last = int(offsets[0]), int(offsets[-1])
        offsets = (offsets - first).tolist()
        labels = columns.read("label", first, last).tolist()
        status = columns.read("box_status", first, last).tolist()
        xywh = list(zip(*(columns.read(name, first, last).tolist() for name in ("x", "y", "w", "h"))))
        crowd = columns.read("crowd", first, last).tolist()
        segmentation_offsets = columns.read("segmentation_offset", first, last + 1)
        segmentation_data = columns.read(
            "segmentation", int(segmentation_offsets[0]), int(segmentation_offsets[-1])
        ).tobytes()
        segmentation_offsets = (segmentation_offsets - segmentation_offsets[0]).tolist()
        segmentations = [
            segmentation_data[segmentation_offsets[j] : segmentation_offsets[j + 1]] for j in range(last - first)
        ]
        for i in range(hi - lo):
            a, b = offsets[i], offsets[i + 1]
            yield _ImageEntry(
                image_id=ids[i],
                file_name=names[name_offsets[i] : name_offsets[i + 1]].decode("utf-8", "surrogatepass"),
                width=widths[i] or None,
                height=heights[i] or None,
                labels=labels[a:b],
                box_status=status[a:b],
                xywh=xywh[a:b],
                crowd=crowd[a:b],
                segmentations=segmentations[a:b],
            )


def iter_examples(
    json_path: str, image_root: str, counts: collections.Counter, *, num_threads: int = 8
) -> Iterator[records.SourceExample]:
    """Reads a COCO-format folder as SourceExamples.

    The JSON is read and checked before this returns, so structural errors
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
    table = coco_json.read_table(json_path, image_root)
    counts.update(table.counts)
    counts["usable_images"] += 0  # Present even when nothing is usable.
    return iter_table_examples(table.columns, os.fspath(image_root), counts, 0, table.num_images, num_threads)


def images_examined(counts: collections.Counter) -> int:
    """Images an iteration has looked at so far, yielded or skipped (for progress)."""
    return sum(counts[k] for k in ("usable_images", "missing_image_file", "unreadable_image", "size_mismatch"))


def iter_table_examples(
    columns: ColumnFiles, image_root: str, counts: collections.Counter, start: int, stop: int, num_threads: int = 8
) -> Iterator[records.SourceExample]:
    """The examples of the table's images start..stop-1 (see iter_examples); counts their per-image keys only."""
    with futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="coco_json") as pool:
        pending = collections.deque()  # (entry, future of _read_image), image order.
        remaining = _entries(columns, start, stop)
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
                example = _make_example(entry, info, counts)
                counts["usable_images"] += 1
                yield example
        finally:
            # A consumer that stops early should not wait for the whole window.
            for _, future in pending:
                future.cancel()

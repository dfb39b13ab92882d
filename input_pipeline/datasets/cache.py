"""Prepared splits: every source converted once to random-access record files.

A prepared split is a directory holding
  records-NNNNN.array_record  the records (input_pipeline/records.py), in the
                              source's deterministic order, ArrayRecord files
                              written with group_size 1 so any record can be
                              read alone;
  index.npz                   per-record image ids, sizes and all annotations,
                              so ground truth and "which records have boxes"
                              need no pass over the images;
  manifest.json               record count, shard files, class names,
                              category ids, the source fingerprint and the
                              bad-record counts of the conversion.

Why convert instead of reading each source in place: the global order of
examples must be a function of (seed, step) alone, never of the number of
hosts, so every host must be able to read any record by its index. TFDS's
default TFRecord files can only be read sequentially, and per-image files on
network filesystems cost one round trip each; large ArrayRecord shards give
every source the same cheap random access. The conversion copies encoded
bytes (no decode, no re-encode) and is written to a temporary directory that
is renamed into place, so an interrupted conversion is never mistaken for a
finished one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Sequence

import numpy as np
from array_record.python import array_record_data_source, array_record_module

from input_pipeline import progress, records
from input_pipeline.dataset_errors import DatasetError
from sharding.tables import markdown_table

MANIFEST = "manifest.json"
INDEX = "index.npz"
# One record per group: a random read decodes only the record it wants.
_WRITER_OPTIONS = "group_size:1"
# Shards of about this size keep file counts low for millions of images
# while letting readers open only what they touch.
SHARD_BYTES = 1 << 30
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
    """A converted split: random-access records plus their index.

    Attributes:
      directory: where the split lives.
      num_records: N, the number of records (usable images).
      shard_paths: the ArrayRecord files, in record order.
      image_ids: int64 [N] the dataset's image ids.
      heights, widths: int32 [N] pixels of each encoded image.
      box_offsets: int64 [N + 1]; record i's boxes are rows
        box_offsets[i]:box_offsets[i + 1] of the arrays below.
      boxes_yxyx: float32 [M, 4] absolute pixels of the encoded images.
      labels: int32 [M] contiguous labels.
      is_crowd: bool [M].
      class_names: names of labels 0..K-1.
      category_ids: the dataset's category id of each label.
      counts: what the conversion saw, handled and skipped (see each source's
        documentation for the keys).
      fingerprint: identity of the source the split was converted from.
    """

    directory: str
    num_records: int
    shard_paths: tuple[str, ...]
    image_ids: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    box_offsets: np.ndarray
    boxes_yxyx: np.ndarray
    labels: np.ndarray
    is_crowd: np.ndarray
    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]
    counts: dict[str, int]
    fingerprint: str

    def num_training_boxes(self) -> np.ndarray:
        """int64 [N]: boxes per record that are training targets (not crowd)."""
        per_box = (~self.is_crowd).astype(np.int64)
        cumulative = np.concatenate([[0], np.cumsum(per_box)])
        return cumulative[self.box_offsets[1:]] - cumulative[self.box_offsets[:-1]]

    def open_reader(self) -> RecordReader:
        return RecordReader(self.shard_paths)


class RecordReader:
    """Random access to a prepared split's serialized records."""

    def __init__(self, shard_paths: Sequence[str]):
        self._source = array_record_data_source.ArrayRecordDataSource([os.fspath(p) for p in shard_paths])
        # tf.data calls read() from several threads; the data source opens its
        # file readers lazily and is not documented as thread-safe. Reads are
        # batched and cheap next to decoding, so serializing them costs little.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._source)

    def read(self, record_ids: np.ndarray) -> np.ndarray:
        """object [n] of bytes: the serialized records `record_ids` (int [n])."""
        ids = [int(i) for i in np.asarray(record_ids).reshape(-1)]
        out = np.empty(len(ids), dtype=object)
        with self._lock:
            out[:] = self._source.__getitems__(ids) if ids else []
        return out


def write_split(
    directory: str,
    examples: Iterable[records.SourceExample],
    counts: collections.Counter,
    *,
    fingerprint: str,
    class_names: Sequence[str],
    category_ids: Sequence[int],
    shard_bytes: int = SHARD_BYTES,
) -> PreparedSplit:
    """Converts `examples` into a prepared split at `directory` (atomically).

    `counts` is updated by the source while `examples` is consumed and is stored
    in the manifest as it stands at the end.
    """
    directory = os.fspath(directory)
    parent = os.path.dirname(directory.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = f"{directory}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        shard_names, image_ids, heights, widths = [], [], [], []
        offsets, boxes, labels, crowd = [0], [], [], []
        writer, written = None, 0
        description = f"converting {os.path.basename(directory)}"
        with progress.Progress(description, unit="images") as report:
            for example in examples:
                serialized = records.serialize(example)
                if writer is None or written >= shard_bytes:
                    if writer is not None:
                        writer.close()
                    shard_names.append(f"records-{len(shard_names):05d}.array_record")
                    writer = array_record_module.ArrayRecordWriter(os.path.join(tmp, shard_names[-1]), _WRITER_OPTIONS)
                    written = 0
                writer.write(serialized)
                written += len(serialized)
                image_ids.append(example.image_id)
                heights.append(example.height)
                widths.append(example.width)
                n = len(example.labels)
                offsets.append(offsets[-1] + n)
                boxes.append(np.asarray(example.boxes_yxyx, np.float32).reshape(n, 4))
                labels.append(np.asarray(example.labels, np.int32).reshape(n))
                crowd.append(np.asarray(example.is_crowd, bool).reshape(n))
                report.update(len(image_ids))
        if writer is not None:
            writer.close()
        np.savez(
            os.path.join(tmp, INDEX),
            image_ids=np.asarray(image_ids, np.int64),
            heights=np.asarray(heights, np.int32),
            widths=np.asarray(widths, np.int32),
            box_offsets=np.asarray(offsets, np.int64),
            boxes_yxyx=(np.concatenate(boxes) if boxes else np.zeros([0, 4], np.float32)),
            labels=(np.concatenate(labels) if labels else np.zeros([0], np.int32)),
            is_crowd=(np.concatenate(crowd) if crowd else np.zeros([0], bool)),
        )
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "num_records": len(image_ids),
            "shards": shard_names,
            "class_names": list(class_names),
            "category_ids": [int(c) for c in category_ids],
            "counts": {k: int(v) for k, v in sorted(counts.items())},
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.exists(directory):
            shutil.rmtree(directory)  # A stale split from another source version.
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logging.info("prepared %d records in %s; counts %s", len(image_ids), directory, dict(sorted(counts.items())))
    return load_split(directory, fingerprint=fingerprint)


def load_split(directory: str, *, fingerprint: str | None = None) -> PreparedSplit | None:
    """The prepared split at `directory`, or None if absent or from another source."""
    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        return None
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        return None
    with np.load(os.path.join(directory, INDEX)) as index:
        arrays = {k: index[k] for k in index.files}
    if len(arrays["image_ids"]) != manifest["num_records"]:
        raise DatasetError(
            f"prepared split {directory} is inconsistent ({manifest['num_records']} "
            f"records in {MANIFEST}, {len(arrays['image_ids'])} in {INDEX}); "
            "delete the directory to convert the source again"
        )
    return PreparedSplit(
        directory=directory,
        num_records=int(manifest["num_records"]),
        shard_paths=tuple(os.path.join(directory, s) for s in manifest["shards"]),
        class_names=tuple(manifest["class_names"]),
        category_ids=tuple(int(c) for c in manifest["category_ids"]),
        counts=dict(manifest["counts"]),
        fingerprint=manifest["fingerprint"],
        **arrays,
    )


def check_usable(split: PreparedSplit, *, what: str, max_bad_fraction: float) -> None:
    """Stops when most of a source's images could not be used.

    Raises:
      DatasetError: no usable image at all, or more than `max_bad_fraction` of
        the source's images skipped.
    """
    total = int(split.counts.get("images", split.num_records))
    skipped = total - split.num_records
    if split.num_records == 0 or (total and skipped / total > max_bad_fraction):
        bad = {k: v for k, v in split.counts.items() if v and k not in ("images", "usable_images", "annotations")}
        raise DatasetError(
            f"{what}: only {split.num_records} of {total} images are usable "
            f"({bad}); fix the data (see the counts) or raise "
            f"input.max_bad_fraction (now {max_bad_fraction})"
        )


def ground_truth(split: PreparedSplit) -> dict:
    """COCO-format ground truth of a prepared split (original pixels).

    Crowd / ignore regions are kept with iscrowd=1 so COCO evaluation ignores
    detections on them.
    """
    images, annotations = [], []
    for i in range(split.num_records):
        image_id = int(split.image_ids[i])
        images.append({"id": image_id, "height": int(split.heights[i]), "width": int(split.widths[i])})
        for row in range(int(split.box_offsets[i]), int(split.box_offsets[i + 1])):
            y0, x0, y1, x1 = (float(v) for v in split.boxes_yxyx[row])
            w, h = x1 - x0, y1 - y0
            annotations.append(
                {
                    "id": len(annotations) + 1,  # COCO eval treats id 0 as unmatched.
                    "image_id": image_id,
                    "category_id": int(split.category_ids[int(split.labels[row])]),
                    "bbox": [round(x0, 3), round(y0, 3), round(w, 3), round(h, 3)],
                    "area": round(w * h, 3),
                    "iscrowd": int(split.is_crowd[row]),
                }
            )
    categories = [{"id": int(c), "name": n} for c, n in zip(split.category_ids, split.class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def format_counts(splits: dict[str, PreparedSplit]) -> str:
    """Markdown table of the conversion counts of named splits, then where each lives."""
    names = list(splits)
    keys = sorted(set().union(*(s.counts for s in splits.values())))
    table = markdown_table(["count", *names], [[k, *(splits[n].counts.get(k, 0) for n in names)] for k in keys])
    return "\n".join([table, "", *(f"{n}: {splits[n].num_records} records in {splits[n].directory}" for n in names)])

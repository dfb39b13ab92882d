"""Prepared splits: every source converted once to random-access record files.

A prepared split is a directory holding
  records-S-K.array_record    the records (input_pipeline/records.py), in the
                              source's deterministic order, ArrayRecord files
                              written with group_size 1 so any record can be
                              read alone (split_writer.py: S is the position
                              in the source of the first record of the part
                              that wrote the shard, K the shard's number in
                              that part);
  index.npz                   per-record image ids, sizes and all annotations
                              (with the boxes' masks as RLE run lengths when
                              the records carry masks), so ground truth and
                              "which records have boxes" need no pass over
                              the images;
  manifest.json               record count, the shards in record order and
                              the size and edge checksum of each shard and of
                              the index, class names, category ids, the
                              source fingerprint and the bad-record counts of
                              the conversion.

Opening a split checks every file's size and the checksum of its first and
last 64 KiB against the manifest (a few ms for any size): a file cut short
by a full disk or an interrupted copy, or another file put in its place, is
a DatasetError naming the file and the fix. A corrupted byte inside a shard
is caught by Riegeli's chunk hashes when its record is read, and becomes a
DatasetError naming the split as well.

Why convert instead of reading each source in place: the global order of
examples must be a function of (seed, step) alone, never of the number of
hosts, so every host must be able to read any record by its index. TFDS's
default TFRecord files can only be read sequentially, and per-image files on
network filesystems cost one round trip each; large ArrayRecord shards give
every source the same cheap random access. The conversion copies encoded
bytes (no decode, no re-encode) and is written to a temporary directory that
is renamed into place, so an interrupted conversion is never mistaken for a
finished one. COCO-format folders convert with several worker processes and
hosts (conversion.py); TFDS sources in this process (write_split).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import threading
import zipfile
from collections.abc import Iterable, Sequence

import numpy as np
from array_record.python import array_record_module

from input_pipeline import masks, progress, records
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import split_writer
from input_pipeline.datasets.split_writer import FORMAT_VERSION, INDEX, MANIFEST, SHARD_BYTES
from sharding.tables import markdown_table

# Random reads: no read-ahead (records are read in shuffled order), a small
# file buffer (a record is one compressed image).
_READER_OPTIONS = "readahead_buffer_size:0"
_READER_BUFFER_BYTES = 32 << 10


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
      has_masks: whether the index holds the records' masks (`read_masks`).
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
    has_masks: bool = False

    def read_masks(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The boxes' masks from the index, None when the records carry none.

        Read on demand, not at open: a large split's run lengths take hundreds
        of MB that training never needs.

        Returns:
          (mask_runs int64 [M] runs of each box's mask, 0 for a box without
          one; mask_run_lengths int64 [sum(mask_runs)] the COCO RLE run
          lengths over each box's encoded image, column-major, zeros first,
          one mask after another).
        """
        if not self.has_masks:
            return None
        path = os.path.join(self.directory, INDEX)
        try:
            with np.load(path) as index:
                return tuple(np.asarray(index[name], np.int64) for name in split_writer.MASK_COLUMNS)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise _broken(self.directory, f"{INDEX} cannot be read ({str(e).splitlines()[0][:120]})") from e

    def num_training_boxes(self) -> np.ndarray:
        """int64 [N]: boxes per record that are training targets (not crowd)."""
        per_box = (~self.is_crowd).astype(np.int64)
        cumulative = np.concatenate([[0], np.cumsum(per_box)])
        return cumulative[self.box_offsets[1:]] - cumulative[self.box_offsets[:-1]]

    def open_reader(self) -> RecordReader:
        return RecordReader(self.shard_paths, directory=self.directory, num_records=self.num_records)


class RecordReader:
    """Random access to a prepared split's serialized records.

    One ArrayRecord reader per shard, opened here; a batch of record ids is
    read shard by shard in the calling thread (each shard's reader reads its
    positions with its own C++ threads). No Python thread is started per
    read: tf.data calls read() from its own threads, where a thread pool per
    call (ArrayRecordDataSource's) contends on the interpreter-wide executor
    lock, and a garbage collection that frees another tf.data iterator while
    that lock is held waits on that iterator's threads, which wait on the
    lock: a deadlock seen in practice.

    A record that cannot be read (a shard corrupted after its checks at
    open), or shards holding another number of records than `num_records`
    (the manifest's), raise DatasetError naming `directory` and the fix.
    """

    def __init__(self, shard_paths: Sequence[str], *, directory: str | None = None, num_records: int | None = None):
        if directory is None and shard_paths:
            directory = os.path.dirname(os.fspath(shard_paths[0]))
        self._directory = directory
        try:
            self._readers = [
                array_record_module.ArrayRecordReader(
                    os.fspath(path), options=_READER_OPTIONS, file_reader_buffer_size=_READER_BUFFER_BYTES
                )
                for path in shard_paths
            ]
        except (RuntimeError, ValueError) as e:
            raise self._error(e) from e
        counts = [reader.num_records() for reader in self._readers]
        # A corrupted shard index can read as fewer records without an error: checked against the manifest.
        if num_records is not None and sum(counts) != num_records:
            raise self._error(
                ValueError(f"its shards hold {sum(counts)} records where the manifest lists {num_records}")
            )
        # Record i is in shard s when starts[s] <= i < starts[s + 1].
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        # tf.data calls read() from several threads; a reader is not
        # documented as thread-safe. Reads are batched and cheap next to
        # decoding, so serializing them costs little.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _error(self, error: Exception) -> DatasetError:
        cause = (str(error).splitlines() or [type(error).__name__])[0][:200]
        return DatasetError(
            f"prepared split {self._directory} cannot be read ({cause}); delete {self._directory} to "
            "convert the source again"
        )

    def read(self, record_ids: np.ndarray) -> np.ndarray:
        """object [n] of bytes: the serialized records `record_ids` (int [n])."""
        ids = np.asarray(record_ids, np.int64).reshape(-1)
        out = np.empty(len(ids), dtype=object)
        if not len(ids):
            return out
        if ids.min() < 0 or ids.max() >= len(self):
            raise IndexError(f"record ids {ids.min()}..{ids.max()} outside the split's {len(self)} records")
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        try:
            with self._lock:
                for shard in np.unique(shards).tolist():
                    where = np.flatnonzero(shards == shard)
                    positions = (ids[where] - self._starts[shard]).tolist()
                    out[where] = self._readers[shard].read(positions)
        except RuntimeError as e:  # Riegeli: "Invalid ... chunk boundary", hash mismatches, truncation
            raise self._error(e) from e
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
    """Converts `examples` into a prepared split at `directory` (atomically), in this process.

    `counts` is updated by the source while `examples` is consumed and is stored
    in the manifest as it stands at the end.

    Raises:
      DatasetError: the directory cannot be written (a full disk, a read-only
        cache); nothing is left behind.
    """
    directory = os.fspath(directory)
    tmp = split_writer.new_temporary_directory(directory)
    try:
        with progress.Progress(f"converting {os.path.basename(directory)}", unit="images") as report:
            for written in split_writer.write_part(tmp, 0, iter(examples), shard_bytes=shard_bytes):
                report.update(written)
        split_writer.finish_split(
            tmp, counts, fingerprint=fingerprint, class_names=class_names, category_ids=category_ids
        )
        split_writer.move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    split = load_split(directory, fingerprint=fingerprint)
    logging.info("prepared %d records in %s; counts %s", split.num_records, directory, split.counts)
    return split


def _broken(directory: str, what: str) -> DatasetError:
    return DatasetError(f"prepared split {directory}: {what}; delete {directory} to convert the source again")


def _check_file(directory: str, entry: dict) -> str:
    """The path of one file of the manifest, after checking its size and edge checksum."""
    path = os.path.join(directory, entry["name"])
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise _broken(directory, f"{entry['name']} cannot be read ({e.strerror})") from e
    if size != entry["bytes"]:
        state = "truncated" if size < entry["bytes"] else "longer than written"
        raise _broken(directory, f"{entry['name']} is {state}: {size} bytes, manifest says {entry['bytes']}")
    if split_writer.edge_checksum(path, size) != entry["checksum"]:
        raise _broken(directory, f"{entry['name']} is corrupted (its first or last 64 KiB differ from when written)")
    return path


def load_split(directory: str, *, fingerprint: str | None = None) -> PreparedSplit | None:
    """The prepared split at `directory`, or None if absent or from another source or format version.

    Raises:
      DatasetError: a file of the split is missing, truncated or corrupted
        (see module doc), or the manifest is unreadable.
    """
    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise _broken(directory, f"{MANIFEST} cannot be read ({str(e).splitlines()[0][:120]})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        return None
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        return None
    shard_paths = tuple(_check_file(directory, entry) for entry in manifest["shards"])
    index_path = _check_file(directory, manifest["index"])
    try:
        with np.load(index_path) as index:
            has_masks = all(name in index.files for name in split_writer.MASK_COLUMNS)
            arrays = {k: index[k] for k in index.files if k not in split_writer.MASK_COLUMNS}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise _broken(directory, f"{INDEX} cannot be read ({str(e).splitlines()[0][:120]})") from e
    if len(arrays["image_ids"]) != manifest["num_records"]:
        raise _broken(
            directory,
            f"{manifest['num_records']} records in {MANIFEST}, {len(arrays['image_ids'])} in {INDEX}",
        )
    arrays.pop("num_boxes", None)
    return PreparedSplit(
        directory=directory,
        num_records=int(manifest["num_records"]),
        shard_paths=shard_paths,
        class_names=tuple(manifest["class_names"]),
        category_ids=tuple(int(c) for c in manifest["category_ids"]),
        counts=dict(manifest["counts"]),
        fingerprint=manifest["fingerprint"],
        has_masks=has_masks,
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


def ground_truth_columns(split: PreparedSplit) -> dict[str, np.ndarray]:
    """A prepared split's boxes as COCO ground-truth columns (original pixels, rounded to 1/1000).

    Keys as `coco_json.load_ground_truth_columns`. Crowd / ignore regions are
    kept with is_crowd so COCO evaluation ignores detections on them. The
    mask columns (each box's mask over its image, as COCO compressed RLE) are
    there when the records carry a mask for every box; a box-only source, or
    any box whose mask conversion dropped, leaves them out (no segm scoring).
    """
    boxes_yxyx = split.boxes_yxyx.astype(np.float64)
    y0, x0, y1, x1 = (boxes_yxyx[:, i] for i in range(4))
    width, height = x1 - x0, y1 - y0
    return {
        "image_ids": np.asarray(split.image_ids, np.int64),
        "category_ids": np.sort(np.asarray(split.category_ids, np.int64)),
        "box_image_ids": np.repeat(np.asarray(split.image_ids, np.int64), np.diff(split.box_offsets)),
        "box_category_ids": np.asarray(split.category_ids, np.int64)[split.labels],
        "boxes_xywh": np.round(np.stack([x0, y0, width, height], axis=1), 3),
        "areas": np.round(width * height, 3),
        "is_crowd": np.asarray(split.is_crowd, bool),
        **_mask_columns(split),
    }


def _mask_columns(split: PreparedSplit) -> dict[str, np.ndarray]:
    """mask_heights, mask_widths int32 [M], mask_counts uint8 [bytes], mask_offsets int64 [M + 1]; {} without masks.

    Each mask's compressed RLE string comes from `masks.run_lengths_to_string`,
    a Python loop over its runs (about a microsecond per run, so a few hundred
    microseconds for a COCO-sized instance): fine for a validation set, the
    only split scored.
    """
    stored = split.read_masks()
    if stored is None:
        return {}
    runs, run_lengths = stored
    if len(runs) != len(split.labels) or not (runs > 0).all():
        return {}
    run_offsets = np.concatenate([[0], np.cumsum(runs)]).tolist()
    strings = [masks.run_lengths_to_string(run_lengths[a:b]) for a, b in zip(run_offsets[:-1], run_offsets[1:])]
    lengths = np.fromiter(map(len, strings), np.int64, len(strings))
    per_box = np.diff(split.box_offsets)
    return {
        "mask_heights": np.repeat(np.asarray(split.heights, np.int32), per_box),
        "mask_widths": np.repeat(np.asarray(split.widths, np.int32), per_box),
        "mask_counts": np.frombuffer(b"".join(strings), np.uint8).copy(),
        "mask_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }


def ground_truth(split: PreparedSplit) -> dict:
    """COCO-format ground truth of a prepared split: `ground_truth_columns` as COCO dicts."""
    columns = ground_truth_columns(split)
    images = [
        {"id": int(i), "height": int(h), "width": int(w)}
        for i, h, w in zip(split.image_ids, split.heights, split.widths)
    ]
    annotations = [
        {
            "id": n + 1,  # COCO eval treats id 0 as unmatched.
            "image_id": int(image_id),
            "category_id": int(category_id),
            "bbox": [float(v) for v in box],
            "area": float(area),
            "iscrowd": int(crowd),
        }
        for n, (image_id, category_id, box, area, crowd) in enumerate(
            zip(
                columns["box_image_ids"],
                columns["box_category_ids"],
                columns["boxes_xywh"],
                columns["areas"],
                columns["is_crowd"],
            )
        )
    ]
    categories = [{"id": int(c), "name": n} for c, n in zip(split.category_ids, split.class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def format_counts(splits: dict[str, PreparedSplit]) -> str:
    """Markdown table of the conversion counts of named splits, then where each lives."""
    names = list(splits)
    keys = sorted(set().union(*(s.counts for s in splits.values())))
    table = markdown_table(["count", *names], [[k, *(splits[n].counts.get(k, 0) for n in names)] for k in keys])
    return "\n".join([table, "", *(f"{n}: {splits[n].num_records} records in {splits[n].directory}" for n in names)])

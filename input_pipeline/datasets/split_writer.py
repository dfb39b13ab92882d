"""Writing a prepared split: parts of contiguous records, then their merged index and manifest.

A conversion writes its records in parts, each a contiguous range of the
source's examples: one part for a single process, one per worker process
and host in a parallel conversion. A part writes its ArrayRecord shards
(`records-SSSSSSSSSSSS-KKKKK.array_record`, S its first example's position
in the source, K the shard's number within the part) and its index columns
(spilled to files as it goes, so no process holds a whole split's index);
`finish_split` then streams the parts' columns, in source order, into one
index.npz and writes the manifest. The records and the index are thereby
the same whatever the number of parts.

Everything here imports neither TensorFlow nor JAX: conversion worker
processes use it.

A full disk or an unwritable cache raises `write_error`'s one-line
DatasetError with the directory, the OS cause and the fix; the caller
removes its temporary directory.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
import zipfile
from collections.abc import Iterator, Sequence

import numpy as np
from array_record.python import array_record_module

from input_pipeline import records
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets.column_files import ColumnFiles

MANIFEST = "manifest.json"
INDEX = "index.npz"
# 2: the manifest holds each file's size and edge checksum (see edge_checksum). 3: COCO-format folders'
# records carry their instances' masks (records.py). 4: the index holds the records' masks (mask_runs,
# mask_run_lengths) for mask-AP ground truth.
FORMAT_VERSION = 4
# One record per group: a random read decodes only the record it wants.
_WRITER_OPTIONS = "group_size:1"
# Shards of about this size keep file counts low for millions of images
# while letting readers open only what they touch.
SHARD_BYTES = 1 << 30
# Index rows a part keeps in memory before appending them to its column files.
_INDEX_FLUSH_ROWS = 4096
# Values of one index column that the merge reads at a time (4 MB of boxes).
_MERGE_BLOCK = 1 << 20
# Bytes read from each end of a file for its checksum: enough to catch a
# file cut short or replaced, cheap enough to check every time a split opens.
EDGE_BYTES = 64 << 10
# The index's columns: name -> dtype, and how many values one box or one record adds.
_INDEX_COLUMNS = {
    "image_ids": np.int64,
    "heights": np.int32,
    "widths": np.int32,
    "num_boxes": np.int64,
    "boxes_yxyx": np.float32,
    "labels": np.int32,
    "is_crowd": bool,
    # Each box's mask as COCO RLE run lengths over its encoded image (records.SourceExample): runs per box (0:
    # no mask), then all the run lengths. Written to index.npz only when some record carries masks.
    "mask_runs": np.int64,
    "mask_run_lengths": np.int64,
}
# The index's mask members: cache.load_split leaves them on disk until ground truth asks for them (a COCO
# train split's run lengths are hundreds of MB).
MASK_COLUMNS = ("mask_runs", "mask_run_lengths")
# Index columns with one value (or four) per box, or per run length: concatenated, not one value per record.
_RAGGED_COLUMNS = ("boxes_yxyx", "labels", "is_crowd", "mask_runs", "mask_run_lengths")


def write_error(directory: str, error: BaseException) -> DatasetError:
    """The one-line DatasetError for a write into `directory` that failed with `error` (OSError or RuntimeError).

    ArrayRecordWriter reports a full disk as RuntimeError('write() failed: No
    space left on device; writing PATH; ...'); numpy and open() raise OSError.
    """
    if isinstance(error, OSError):
        cause = error.strerror or str(error)
    else:
        match = re.search(r"failed: ([^;]+)", str(error))
        cause = match.group(1) if match else (str(error).splitlines() or [type(error).__name__])[0]
    cause = cause.strip()
    full = cause in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
    fix = (
        "free space or point --config.dataset.cache_dir at a larger disk"
        if full
        else ("point --config.dataset.cache_dir at a writable directory")
    )
    return DatasetError(f"cannot write prepared split to {directory} ({cause}); {fix}")


def edge_checksum(path: str, size: int) -> str:
    """16 hex digits: BLAKE2b of a file's size and its first and last EDGE_BYTES bytes."""
    digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=8)
    with open(path, "rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()


def file_entry(directory: str, name: str) -> dict:
    """The manifest's record of one file: {'name', 'bytes', 'checksum'}."""
    path = os.path.join(directory, name)
    size = os.path.getsize(path)
    return {"name": name, "bytes": size, "checksum": edge_checksum(path, size)}


def part_name(start: int) -> str:
    """The stem of the part that starts at source position `start` (sorts in source order)."""
    return f"{start:012d}"


class PartWriter:
    """Writes the records of one part (examples `start`, `start + 1`, ... of the source) into `directory`.

    Use as a `with` block; `write` each example in order. On leaving the
    block normally, the part's description is written (part-S.json: its
    shards, record count and `counts` as they stand then); the caller's
    temporary directory holds everything else.

    Raises (from write and on exit):
      DatasetError: the directory cannot be written (write_error).
    """

    def __init__(
        self, directory: str, start: int, *, counts: collections.Counter | None = None, shard_bytes: int = SHARD_BYTES
    ):
        self._directory, self._start, self._shard_bytes = directory, start, shard_bytes
        self._counts = counts  # the source's counts of this part's examples, final when the block ends
        self._columns = ColumnFiles(os.path.join(directory, f".index-{part_name(start)}"))
        self._pending: dict[str, list] = collections.defaultdict(list)
        self._writer, self._written, self._shards = None, 0, []
        self._has_masks = False  # whether any record carried masks (its boxes without one count 0 runs)
        self.num_records = 0

    def __enter__(self) -> PartWriter:
        return self

    def write(self, example: records.SourceExample) -> None:
        serialized = records.serialize(example)
        try:
            if self._writer is None or self._written >= self._shard_bytes:
                self._close_shard()
                self._shards.append(f"records-{part_name(self._start)}-{len(self._shards):05d}.array_record")
                path = os.path.join(self._directory, self._shards[-1])
                self._writer = array_record_module.ArrayRecordWriter(path, _WRITER_OPTIONS)
                self._written = 0
            self._writer.write(serialized)
        except (OSError, RuntimeError) as e:
            raise write_error(self._directory, e) from e
        self._written += len(serialized)
        self.num_records += 1
        n = len(example.labels)
        pending = self._pending
        pending["image_ids"].append(example.image_id)
        pending["heights"].append(example.height)
        pending["widths"].append(example.width)
        pending["num_boxes"].append(n)
        pending["boxes_yxyx"].append(np.asarray(example.boxes_yxyx, np.float32).reshape(n * 4))
        pending["labels"].append(np.asarray(example.labels, np.int32).reshape(n))
        pending["is_crowd"].append(np.asarray(example.is_crowd, bool).reshape(n))
        if example.mask_runs is None:
            pending["mask_runs"].append(np.zeros([n], np.int64))
        else:
            self._has_masks = True
            pending["mask_runs"].append(np.asarray(example.mask_runs, np.int64).reshape(n))
            pending["mask_run_lengths"].append(np.asarray(example.mask_run_lengths, np.int64).reshape(-1))
        if len(pending["image_ids"]) >= _INDEX_FLUSH_ROWS:
            self._flush_index()

    def _flush_index(self) -> None:
        try:
            for name, dtype in _INDEX_COLUMNS.items():
                values = self._pending.pop(name, [])
                if name in _RAGGED_COLUMNS:
                    array = np.concatenate(values).astype(dtype) if values else np.zeros([0], dtype)
                else:
                    array = np.asarray(values, dtype)
                self._columns.append(name, array)
        except OSError as e:
            raise write_error(self._directory, e) from e

    def _close_shard(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()  # where ArrayRecordWriter reports most write failures
            except (OSError, RuntimeError) as e:
                raise write_error(self._directory, e) from e

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self._close_shard()
            except DatasetError:
                pass  # the first error is the one to report
            return
        self._close_shard()
        self._flush_index()
        self._columns.save_dtypes()
        describe = {
            "start": self._start,
            "num_records": self.num_records,
            "has_masks": self._has_masks,
            "shards": self._shards,
            "counts": {k: int(v) for k, v in sorted((self._counts or {}).items())},
        }
        try:
            with open(os.path.join(self._directory, f"part-{part_name(self._start)}.json"), "w") as f:
                json.dump(describe, f)
        except OSError as e:
            raise write_error(self._directory, e) from e


def write_part(
    directory: str,
    start: int,
    examples: Iterator[records.SourceExample],
    *,
    counts: collections.Counter | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Iterator[int]:
    """Writes `examples` as the part starting at `start` (see PartWriter); yields the records written so far."""
    with PartWriter(directory, start, counts=counts, shard_bytes=shard_bytes) as part:
        for example in examples:
            part.write(example)
            yield part.num_records


def _parts(directory: str) -> list[dict]:
    """The part descriptions in `directory`, in source order."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("part-") and n.endswith(".json"))
    parts = []
    for name in names:
        with open(os.path.join(directory, name)) as f:
            parts.append(json.load(f))
    return parts


def _write_npy_member(archive: zipfile.ZipFile, name: str, dtype, shape: tuple, chunks: Iterator[np.ndarray]) -> None:
    """Streams one array (the concatenation of `chunks`) into `archive` as NAME.npy, as np.savez lays it out."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for chunk in chunks:
            f.write(np.ascontiguousarray(chunk, dtype).reshape(-1).view(np.uint8))


def _write_index(directory: str, parts: Sequence[dict]) -> int:
    """Merges the parts' index columns into directory/INDEX (np.load reads it); returns the record count."""
    columns = [ColumnFiles.open(os.path.join(directory, f".index-{part_name(p['start'])}")) for p in parts]
    num_records = sum(c.length("image_ids") for c in columns)
    num_boxes = sum(c.length("labels") for c in columns)

    def column(name: str) -> Iterator[np.ndarray]:
        # A block at a time: a part may hold the whole split (one worker).
        for part in columns:
            length = part.length(name)
            for start in range(0, max(length, 1), _MERGE_BLOCK):
                yield part.read(name, start, min(length, start + _MERGE_BLOCK))

    def offsets() -> Iterator[np.ndarray]:
        total = 0
        yield np.zeros([1], np.int64)
        for counts in column("num_boxes"):
            yield total + np.cumsum(counts)
            total += int(counts.sum())

    shapes = {"image_ids": (num_records,), "heights": (num_records,), "widths": (num_records,)}
    shapes.update({"boxes_yxyx": (num_boxes, 4), "labels": (num_boxes,), "is_crowd": (num_boxes,)})
    if any(p.get("has_masks") for p in parts):
        num_run_lengths = sum(c.length("mask_run_lengths") for c in columns)
        shapes.update({"mask_runs": (num_boxes,), "mask_run_lengths": (num_run_lengths,)})
    with zipfile.ZipFile(os.path.join(directory, INDEX), "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, shape in shapes.items():
            _write_npy_member(archive, name, _INDEX_COLUMNS[name], shape, column(name))
        _write_npy_member(archive, "box_offsets", np.int64, (num_records + 1,), offsets())
    return num_records


def finish_split(
    directory: str,
    counts: dict[str, int],
    *,
    fingerprint: str,
    class_names: Sequence[str],
    category_ids: Sequence[int],
) -> None:
    """Merges the parts written into `directory` into index.npz and the manifest; removes the parts' own files.

    The manifest's counts are `counts` (what the source counted outside the
    parts) plus every part's counts.

    Raises:
      DatasetError: the directory cannot be written (write_error).
    """
    try:
        parts = _parts(directory)
        total = collections.Counter(counts)
        for part in parts:
            total.update(part["counts"])
        num_records = _write_index(directory, parts)
        shards = [file_entry(directory, name) for part in parts for name in part["shards"]]
        for shard, records_in in zip(shards, _shard_records(parts)):
            shard["records"] = records_in
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "num_records": num_records,
            "shards": shards,
            "index": file_entry(directory, INDEX),
            "class_names": list(class_names),
            "category_ids": [int(c) for c in category_ids],
            "counts": {k: int(v) for k, v in sorted(total.items())},
        }
        for part in parts:
            os.remove(os.path.join(directory, f"part-{part_name(part['start'])}.json"))
            shutil.rmtree(os.path.join(directory, f".index-{part_name(part['start'])}"))
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    except OSError as e:
        raise write_error(directory, e) from e


def _shard_records(parts: Sequence[dict]) -> Iterator[int | None]:
    """Records per shard, where a part knows them: a part with one shard holds all its records there."""
    for part in parts:
        for _ in part["shards"]:
            yield part["num_records"] if len(part["shards"]) == 1 else None


def new_temporary_directory(directory: str) -> str:
    """A new, empty `directory.tmp-XXXXXXXX` beside `directory` (its parent is created).

    Written into and renamed into place (move_into_place), so an interrupted
    conversion is never mistaken for a finished one.

    Raises:
      DatasetError: the parent cannot be created or written (write_error).
    """
    parent = os.path.dirname(directory.rstrip("/")) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = f"{directory}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
    except OSError as e:
        raise write_error(parent, e) from e
    return tmp


def move_into_place(tmp: str, directory: str) -> None:
    """Renames the finished `tmp` to `directory`, replacing a stale split of another source version there."""
    try:
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except OSError as e:
        raise write_error(directory, e) from e

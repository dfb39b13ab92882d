"""Bulk prediction's output on disk: one Parquet row per image, parts committed through manifests, merged.

`bulk_prediction` runs the prediction; this module is the format it writes
and what reads it back. In OUTPUT:

  run.json                 what the run predicts with and on (see `bulk_prediction.run_record`)
  shards/process-P-of-N/   part-BBBBBBBBB.parquet: process P's rows of the batches from BBBBBBBBB on
  manifests/process-P-of-N.json
                           the parts P has committed, each with its byte length and batch
                           range, and the next batch to run
  predictions.json         the merged index, written when every process is done: every part,
                           the counts, the categories
  detections.json, images.json   COCO results and images, on request

One row per image (`SCHEMA`): image_id, file, height, width (original
pixels), boxes_xywh (original pixels, COCO's x, y, width, height), scores,
category_ids and, for a mask model, masks_rle (COCO compressed RLE counts at
height x width, from the evaluation's one paste-and-encode function), and
error: why the image could not be read (null when it was).

A part is written to a temporary name, synced and renamed; then the manifest
naming it (and its byte length) is replaced atomically. A run killed at any
point (SIGKILL included) leaves committed parts and a manifest that names
exactly them; `ShardWriter` deletes whatever else it finds in the shard (a
half-written part, a part renamed but never committed) and cuts a committed
part of another length, with what follows, so those batches run again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from detector.errors import ConfigError, OutputError
from detector.serving import image_sources
from detector.serving.coco_evaluation import Predictions

RUN_FILE = "run.json"
SHARDS_DIR = "shards"
MANIFESTS_DIR = "manifests"
MERGED_FILE = "predictions.json"
DETECTIONS_FILE = "detections.json"
IMAGES_FILE = "images.json"

_BOX = pa.list_(pa.float32(), 4)
SCHEMA = pa.schema(
    [
        ("image_id", pa.int64()),
        ("file", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("boxes_xywh", pa.list_(_BOX)),
        ("scores", pa.list_(pa.float32())),
        ("category_ids", pa.list_(pa.int64())),
        ("error", pa.string()),
    ]
)
MASKS_FIELD = pa.field("masks_rle", pa.list_(pa.large_string()))


def schema(with_masks: bool) -> pa.Schema:
    """The shards' columns; a mask model's add `masks_rle` before `error`."""
    return SCHEMA.insert(SCHEMA.get_field_index("error"), MASKS_FIELD) if with_masks else SCHEMA


@dataclasses.dataclass(frozen=True)
class BatchImages:
    """This process's rows of one global batch, read and transformed.

    Attributes:
      positions: int64 [r] source positions of the rows (-1 past the end of the inputs).
      errors: per row, why the image could not be read (None when it was, or for padding).
      sizes: int32 [r, 2] original (height, width); 0 for padding and unreadable images.
      local_batch: the rows in the batch layout (numpy).
      pictures: position -> decoded image, for the rows that get a picture.
    """

    positions: np.ndarray
    errors: list[str | None]
    sizes: np.ndarray
    local_batch: dict[str, np.ndarray]
    pictures: dict[int, np.ndarray]


def image_table(
    source: image_sources.ImageSource,
    images: BatchImages,
    predictions: Predictions,
    with_masks: bool,
) -> pa.Table:
    """One row per real input among a batch's rows (`SCHEMA`), from `coco_evaluation.batch_predictions`' columns.

    The detections come in row order, each image's together, and the rows hold
    distinct image ids, so each image's detections are one slice.
    """
    real = images.positions >= 0
    positions = images.positions[real]
    image_ids = np.asarray([source.image_id(int(p)) for p in positions], np.int64)
    detections = predictions.detections
    counts_by_id = dict(zip(*np.unique(detections.image_ids, return_counts=True), strict=True))
    counts = np.asarray([counts_by_id.get(int(i), 0) for i in image_ids], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    if len(detections) != offsets[-1] or not np.array_equal(
        detections.image_ids, np.repeat(image_ids, counts)
    ):  # pragma: no cover - a broken invariant of batch_predictions
        raise AssertionError("detections are not grouped by image in row order")
    boxes = pa.FixedSizeListArray.from_arrays(pa.array(detections.boxes_xywh.astype(np.float32).reshape(-1)), 4)
    columns = {
        "image_id": pa.array(image_ids),
        "file": pa.array([source.name(int(p)) for p in positions], pa.string()),
        "height": pa.array(images.sizes[real, 0].astype(np.int32)),
        "width": pa.array(images.sizes[real, 1].astype(np.int32)),
        "boxes_xywh": pa.ListArray.from_arrays(pa.array(offsets), boxes),
        "scores": pa.ListArray.from_arrays(pa.array(offsets), pa.array(detections.scores.astype(np.float32))),
        "category_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(detections.category_ids, pa.int64())),
        "error": pa.array([e for e, keep in zip(images.errors, real, strict=True) if keep], pa.string()),
    }
    if with_masks:
        rle = detections.masks
        counts_array = pa.LargeStringArray.from_buffers(
            len(rle.offsets) - 1, pa.py_buffer(rle.offsets.astype(np.int64)), pa.py_buffer(rle.counts)
        )
        columns["masks_rle"] = pa.ListArray.from_arrays(pa.array(offsets), counts_array)
    table_schema = schema(with_masks)
    return pa.table([columns[name] for name in table_schema.names], schema=table_schema)


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a run wrote, on process 0 (`predictions.json`'s counts)."""

    images: int
    unreadable: int
    detections: int
    parts: list[str]
    seconds: float


# ----------------------------------------------------------------------------
# One process's shard: Parquet parts committed through a manifest.
# ----------------------------------------------------------------------------


def write_atomically(path: str, text: str) -> None:
    """Replaces `path` with `text`: a reader sees the old or the new file, never a part of one."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _sync_directory(os.path.dirname(path))


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_name(process: int, processes: int) -> str:
    return f"process-{process:05d}-of-{processes:05d}"


class ShardWriter:
    """This process's Parquet parts and their manifest; `next_batch` is where its committed rows end.

    Args:
      output: the run's OUTPUT directory.
      process, processes: this process's index and the launch's process count.
      with_masks: whether rows carry `masks_rle`.
    """

    def __init__(self, output: str, process: int, processes: int, with_masks: bool):
        name = shard_name(process, processes)
        self.directory = os.path.join(output, SHARDS_DIR, name)
        self.manifest_path = os.path.join(output, MANIFESTS_DIR, f"{name}.json")
        self._schema = schema(with_masks)
        os.makedirs(self.directory, exist_ok=True)
        os.makedirs(os.path.dirname(self.manifest_path), exist_ok=True)
        self.parts: list[dict[str, Any]] = []
        self.next_batch = 0
        # Where the rows on disk end: next_batch runs ahead of it by the rows held for the next commit.
        self.committed_batch = 0
        if os.path.exists(self.manifest_path):
            try:
                with open(self.manifest_path) as f:
                    manifest = json.load(f)
                self.parts, self.next_batch = list(manifest["parts"]), int(manifest["next_batch"])
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(
                    f"the manifest {self.manifest_path} cannot be read ({e}); delete {output} to predict again"
                ) from e
        self.committed_batch = self.next_batch
        self._keep_committed()
        self._pending: list[pa.Table] = []
        self._pending_first_batch = self.next_batch

    def _keep_committed(self) -> None:
        """Deletes what the manifest does not name; a committed part of another length is cut, with what follows."""
        for index, part in enumerate(self.parts):
            path = os.path.join(self.directory, part["file"])
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size != part["bytes"]:
                logging.warning(
                    "%s is %s, where the manifest committed %d bytes: predicting its batches %d.. again",
                    path,
                    "missing" if size < 0 else f"{size} bytes",
                    part["bytes"],
                    part["first_batch"],
                )
                self.parts, self.next_batch = self.parts[:index], int(part["first_batch"])
                self.committed_batch = self.next_batch
                self._write_manifest()
                break
        committed = {part["file"] for part in self.parts}
        stray = sorted(set(os.listdir(self.directory)) - committed)
        for name in stray:
            os.remove(os.path.join(self.directory, name))
        if stray:
            logging.info("deleted %d uncommitted file(s) of an interrupted run in %s", len(stray), self.directory)

    def add(self, table: pa.Table, batch_index: int) -> None:
        """Holds a batch's rows until the next `commit`; batches come in order, the committed ones skipped."""
        if batch_index < self.next_batch:
            return
        if not self._pending:
            self._pending_first_batch = batch_index
        self._pending.append(table)
        self.next_batch = batch_index + 1

    @property
    def pending_rows(self) -> int:
        return sum(t.num_rows for t in self._pending)

    def commit(self) -> None:
        """Writes the pending rows as one part and commits it in the manifest (nothing to do without rows)."""
        if not self._pending:
            if self.parts or os.path.exists(self.manifest_path) or self.next_batch:
                self._write_manifest()
            return
        table = pa.concat_tables(self._pending)
        name = f"part-{self._pending_first_batch:09d}.parquet"
        path = os.path.join(self.directory, name)
        try:
            with open(f"{path}.tmp", "wb") as f:
                pq.write_table(table, f, compression="zstd")
                f.flush()
                os.fsync(f.fileno())
            os.replace(f"{path}.tmp", path)
            _sync_directory(self.directory)
        except OSError as e:
            if os.path.exists(f"{path}.tmp"):
                os.remove(f"{path}.tmp")
            raise self._cannot_write(path, e) from e
        errors = table.column("error")
        self.parts.append(
            {
                "file": name,
                "bytes": os.path.getsize(path),
                "first_batch": self._pending_first_batch,
                "end_batch": self.next_batch,
                "images": table.num_rows,
                "unreadable": errors.length() - errors.null_count,
                "detections": int(pc.sum(pc.list_value_length(table.column("scores"))).as_py() or 0),
            }
        )
        self._pending = []
        self._write_manifest()
        self.committed_batch = self.next_batch

    def _write_manifest(self) -> None:
        try:
            write_atomically(
                self.manifest_path, json.dumps({"next_batch": self.next_batch, "parts": self.parts}, indent=1)
            )
        except OSError as e:
            raise self._cannot_write(self.manifest_path, e) from e

    def _cannot_write(self, path: str, error: OSError) -> OutputError:
        """The one line a failed commit ends the run with; the manifest on disk still names what is kept."""
        return OutputError(
            f"cannot write {path} ({error.strerror or error}); this process's rows of the first "
            f"{self.committed_batch} batches stay committed: free space (or fix the folder) and rerun the same "
            "command to resume"
        )


# ----------------------------------------------------------------------------
# Reading a finished run.
# ----------------------------------------------------------------------------


def merge(output: str, processes: int, *, categories: list[dict], seconds: float = 0.0) -> Summary:
    """Writes OUTPUT/predictions.json, the index of every process's committed parts; returns its counts."""
    parts, images, unreadable, detections = [], 0, 0, 0
    ordered = []
    for process in range(processes):
        name = shard_name(process, processes)
        with open(os.path.join(output, MANIFESTS_DIR, f"{name}.json")) as f:
            manifest = json.load(f)
        for part in manifest["parts"]:
            ordered.append((part["first_batch"], process, os.path.join(SHARDS_DIR, name, part["file"]), part))
    for _, _, path, part in sorted(ordered):
        parts.append({"file": path, "images": part["images"], "bytes": part["bytes"]})
        images += part["images"]
        unreadable += part["unreadable"]
        detections += part["detections"]
    with open(os.path.join(output, RUN_FILE)) as f:
        record = json.load(f)
    merged = {
        "run": record,
        "images": images,
        "unreadable": unreadable,
        "detections": detections,
        "categories": categories,
        "columns": schema(bool(record["model"]["masks"])).names,
        "parts": parts,
    }
    write_atomically(os.path.join(output, MERGED_FILE), json.dumps(merged, indent=1))
    logging.info(
        "predicted %d images (%d unreadable, listed in the shards' `error` column) in %.1fs: %d detections; wrote %s",
        images,
        unreadable,
        seconds,
        detections,
        os.path.join(output, MERGED_FILE),
    )
    return Summary(images, unreadable, detections, [p["file"] for p in parts], seconds)


def read_merged(output: str, columns: list[str] | None = None) -> pa.Table:
    """Every row of a finished run (`predictions.json`'s parts, in batch order), as one table in memory.

    For a run larger than memory, read the parts a batch at a time (`pyarrow.dataset.dataset(paths)` over
    `predictions.json`'s part files, or `pyarrow.parquet.ParquetFile.iter_batches`).
    """
    with open(os.path.join(output, MERGED_FILE)) as f:
        merged = json.load(f)
    tables = [pq.read_table(os.path.join(output, part["file"]), columns=columns) for part in merged["parts"]]
    return pa.concat_tables(tables) if tables else schema(bool(merged["run"]["model"]["masks"])).empty_table()


def write_coco_results(output: str) -> None:
    """OUTPUT/detections.json (COCO results) and images.json (COCO images) from the merged parts, 1,024 rows at a
    time: memory does not grow with the run."""
    with open(os.path.join(output, MERGED_FILE)) as f:
        merged = json.load(f)
    with (
        open(os.path.join(output, DETECTIONS_FILE), "w") as results,
        open(os.path.join(output, IMAGES_FILE), "w") as images,
    ):
        results.write("[")
        images.write("[")
        first_result = first_image = True
        for part in merged["parts"]:
            rows = (
                row
                for batch in pq.ParquetFile(os.path.join(output, part["file"])).iter_batches(batch_size=1024)
                for row in batch.to_pylist()
            )
            for row in rows:
                if row["error"] is not None:
                    continue
                entry = {
                    "id": row["image_id"],
                    "file_name": row["file"],
                    "height": row["height"],
                    "width": row["width"],
                }
                images.write(("" if first_image else ",\n") + json.dumps(entry))
                first_image = False
                size = [row["height"], row["width"]]
                for k, (box, score, category) in enumerate(
                    zip(row["boxes_xywh"], row["scores"], row["category_ids"], strict=True)
                ):
                    result = {
                        "image_id": row["image_id"],
                        "category_id": category,
                        "bbox": [round(float(v), 3) for v in box],
                        "score": round(float(score), 5),
                    }
                    if row.get("masks_rle") is not None:
                        result["segmentation"] = {"size": size, "counts": row["masks_rle"][k]}
                    results.write(("" if first_result else ",") + json.dumps(result))
                    first_result = False
        results.write("]")
        images.write("]")

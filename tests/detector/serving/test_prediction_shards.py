"""prediction_shards without a model: the rows, a shard's parts and manifest, resuming, the merge, COCO results."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detector.errors import ConfigError, OutputError
from detector.serving import prediction_shards
from detector.serving.coco_ap import CocoDetections, RleMasks
from detector.serving.coco_evaluation import Predictions
from detector.serving.prediction_shards import BatchImages, ShardWriter


class ListSource:
    """Images by position, ids offset by 100 (as a split's dataset ids would be)."""

    fingerprint = "f" * 64
    description = "a test list"

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def name(self, position):
        return f"/images/{position}.jpg"

    def image_id(self, position):
        return 100 + position

    def read(self, position):
        return np.zeros((4, 6, 3), np.uint8)


def batch(positions, errors=None):
    positions = np.asarray(positions, np.int64)
    sizes = np.where(positions[:, None] >= 0, [[40, 60]], 0).astype(np.int32)
    errors = errors or [None] * len(positions)
    for row, error in enumerate(errors):
        if error:
            sizes[row] = 0
    return BatchImages(positions=positions, errors=errors, sizes=sizes, local_batch={}, pictures={})


def predictions(per_image, with_masks=False):
    """`per_image`: [(image_id, number of detections)], in row order."""
    ids = np.concatenate([np.full(n, i, np.int64) for i, n in per_image] + [np.zeros(0, np.int64)])
    n = len(ids)
    masks = None
    if with_masks:
        masks = RleMasks.from_strings(np.full(n, 40), np.full(n, 60), [f"rle{k}".encode() for k in range(n)])
    detections = CocoDetections(
        image_ids=ids,
        category_ids=np.arange(n, dtype=np.int64) % 3 + 1,
        boxes_xywh=np.arange(4 * n, dtype=np.float64).reshape(n, 4) + 0.25,
        scores=np.linspace(0.9, 0.5, n),
        masks=masks,
    )
    return Predictions(detections, np.asarray([i for i, _ in per_image], np.int64))


def test_image_table_has_a_row_per_real_input_with_its_detections():
    source = ListSource(5)
    images = batch([3, 4, -1], errors=[None, "not an image", None])
    table = prediction_shards.image_table(source, images, predictions([(103, 2)], with_masks=True), with_masks=True)
    assert table.schema == prediction_shards.schema(True)
    rows = table.to_pylist()
    assert [r["image_id"] for r in rows] == [103, 104] and [r["file"] for r in rows] == [
        "/images/3.jpg",
        "/images/4.jpg",
    ]
    assert rows[0]["error"] is None and rows[1]["error"] == "not an image"
    assert (rows[0]["height"], rows[0]["width"], rows[1]["height"]) == (40, 60, 0)
    assert rows[0]["boxes_xywh"] == [[0.25, 1.25, 2.25, 3.25], [4.25, 5.25, 6.25, 7.25]]
    assert rows[0]["category_ids"] == [1, 2] and rows[0]["masks_rle"] == ["rle0", "rle1"]
    assert rows[0]["scores"] == pytest.approx([0.9, 0.5]) and rows[1]["scores"] == []
    assert (
        "masks_rle"
        not in prediction_shards.image_table(source, batch([0]), predictions([(100, 1)]), False).schema.names
    )


def write_run_record(output, masks):
    prediction_shards.write_atomically(
        str(output / prediction_shards.RUN_FILE), json.dumps({"model": {"masks": masks}})
    )


def commit_batches(writer, source, batches, per_batch=2):
    for b in batches:
        positions = list(range(b * per_batch, (b + 1) * per_batch))
        ids = [(source.image_id(p), 1) for p in positions]
        writer.add(prediction_shards.image_table(source, batch(positions), predictions(ids), False), b)


def test_parts_are_committed_through_the_manifest_and_a_resume_continues_after_them(tmp_path):
    source = ListSource(20)
    writer = ShardWriter(str(tmp_path), 0, 1, with_masks=False)
    commit_batches(writer, source, [0, 1])
    writer.commit()
    commit_batches(writer, source, [2])
    writer.commit()
    commit_batches(writer, source, [3])  # added, never committed: lost with the process
    manifest = json.loads(open(writer.manifest_path).read())
    assert manifest["next_batch"] == 3
    assert [(p["first_batch"], p["end_batch"], p["images"], p["detections"]) for p in manifest["parts"]] == [
        (0, 2, 4, 4),
        (2, 3, 2, 2),
    ]
    for part in manifest["parts"]:
        assert os.path.getsize(os.path.join(writer.directory, part["file"])) == part["bytes"]

    # What a kill leaves behind: a half-written part and one renamed but never committed.
    open(os.path.join(writer.directory, "part-000000003.parquet.tmp"), "wb").write(b"PAR1 half")
    open(os.path.join(writer.directory, "part-000000004.parquet"), "wb").write(b"PAR1 whole, not committed")
    resumed = ShardWriter(str(tmp_path), 0, 1, with_masks=False)
    assert resumed.next_batch == 3
    assert sorted(os.listdir(resumed.directory)) == [p["file"] for p in manifest["parts"]]
    commit_batches(resumed, source, [2, 3, 4])  # batch 2 is committed already: not added again
    resumed.commit()
    prediction_shards.write_atomically(
        str(tmp_path / prediction_shards.RUN_FILE), json.dumps({"model": {"masks": False}})
    )
    summary = prediction_shards.merge(str(tmp_path), 1, categories=[])
    assert summary.images == 10 and summary.detections == 10
    ids = prediction_shards.read_merged(str(tmp_path)).column("image_id").to_pylist()
    assert ids == list(range(100, 110))  # every image once, in order


def test_a_committed_part_of_another_length_is_predicted_again(tmp_path, caplog):
    source = ListSource(20)
    writer = ShardWriter(str(tmp_path), 1, 2, with_masks=False)
    for b in range(3):
        commit_batches(writer, source, [b])
        writer.commit()
    second = os.path.join(writer.directory, writer.parts[1]["file"])
    os.truncate(second, writer.parts[1]["bytes"] - 10)
    resumed = ShardWriter(str(tmp_path), 1, 2, with_masks=False)
    assert resumed.next_batch == 1 and len(resumed.parts) == 1  # the damaged part and everything after it
    assert os.listdir(resumed.directory) == [writer.parts[0]["file"]]
    assert "predicting its batches 1.. again" in caplog.text


def test_damaged_manifest_is_one_line_error(tmp_path):
    writer = ShardWriter(str(tmp_path), 0, 1, with_masks=False)
    writer.next_batch = 1
    writer._write_manifest()
    open(writer.manifest_path, "w").write("{not json")
    with pytest.raises(ConfigError, match="cannot be read .* delete"):
        ShardWriter(str(tmp_path), 0, 1, with_masks=False)


def test_coco_results_are_streamed_from_the_parts(tmp_path):
    source = ListSource(4)
    writer = ShardWriter(str(tmp_path), 0, 1, with_masks=True)
    images = batch([0, 1, 2], errors=[None, "broken", None])
    writer.add(prediction_shards.image_table(source, images, predictions([(100, 2), (102, 1)], True), True), 0)
    writer.commit()
    prediction_shards.write_atomically(
        str(tmp_path / prediction_shards.RUN_FILE), json.dumps({"model": {"masks": True}})
    )
    prediction_shards.merge(str(tmp_path), 1, categories=[{"id": 1, "name": "a"}])
    prediction_shards.write_coco_results(str(tmp_path))
    results = json.loads((tmp_path / "detections.json").read_text())
    assert [(r["image_id"], r["category_id"]) for r in results] == [(100, 1), (100, 2), (102, 3)]
    assert results[0]["bbox"] == [0.25, 1.25, 2.25, 3.25] and results[0]["score"] == pytest.approx(0.9)
    assert results[2]["segmentation"] == {"size": [40, 60], "counts": "rle2"}
    entries = json.loads((tmp_path / "images.json").read_text())
    assert entries == [
        {"id": 100, "file_name": "/images/0.jpg", "height": 40, "width": 60},
        {"id": 102, "file_name": "/images/2.jpg", "height": 40, "width": 60},
    ]
    merged = json.loads((tmp_path / prediction_shards.MERGED_FILE).read_text())
    assert (merged["images"], merged["unreadable"], merged["detections"]) == (3, 1, 3)
    assert pq.read_table(tmp_path / merged["parts"][0]["file"]).num_rows == 3


def test_a_full_disk_is_one_line_and_keeps_the_committed_parts(tmp_path):
    """A real 256 KB tmpfs: the first part fits, the second does not."""
    from tests.integration.test_full_disk import mounted_tmpfs

    source = ListSource(100_000)
    with mounted_tmpfs(tmp_path / "small", "256k") as disk:
        writer = ShardWriter(str(disk), 0, 1, with_masks=False)
        commit_batches(writer, source, [0])
        writer.commit()
        committed = json.loads(open(writer.manifest_path).read())
        # Incompressible rows: file names of random digits, many images.
        rng = np.random.default_rng(0)
        positions = list(range(2, 20_002))
        images = batch(positions)
        table = prediction_shards.image_table(source, images, predictions([(100 + p, 0) for p in positions]), False)
        table = table.set_column(1, "file", pa.array([f"/{rng.integers(1 << 62)}/{p}.jpg" for p in positions]))
        writer.add(table, 1)
        with pytest.raises(
            OutputError,
            match=r"cannot write .*part-000000001.parquet \(No space left on device\); .* "
            r"first 1 batches stay committed: free space .* rerun the same command",
        ):
            writer.commit()
        assert json.loads(open(writer.manifest_path).read()) == committed
        assert os.listdir(writer.directory) == [committed["parts"][0]["file"]]  # no half-written part left
        assert ShardWriter(str(disk), 0, 1, with_masks=False).next_batch == 1

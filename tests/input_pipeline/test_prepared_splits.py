"""Prepared splits: the same records whatever the worker and host count; integrity checks; full and read-only disks."""

import collections
import contextlib
import io
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from PIL import Image

from input_pipeline import records
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import cache, conversion, split_writer
from tests.helpers.coco_folders import write_folder

INDEX_KEYS = ("image_ids", "heights", "widths", "box_offsets", "boxes_yxyx", "labels", "is_crowd")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 23-image COCO folder (64 px JPEGs and PNGs, crowd boxes, a negative) with one missing file."""
    root = tmp_path_factory.mktemp("folder")
    json_path, image_dir, _ = write_folder(root, "train", 23)
    os.remove(os.path.join(image_dir, sorted(os.listdir(image_dir))[5]))
    return json_path, image_dir


def _convert(folder, directory, workers, **kwargs):
    json_path, image_dir = folder
    return conversion.convert_coco_json(
        str(directory), json_path, image_dir, fingerprint="test", workers=workers, **kwargs
    )


def _all_records(split):
    return list(split.open_reader().read(np.arange(split.num_records)))


def test_one_two_or_three_workers_write_the_same_records_index_and_counts(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(conversion, "_MIN_IMAGES_PER_WORKER", 1)
    splits = {w: _convert(folder, tmp_path / f"w{w}", w) for w in (1, 2, 3)}
    # Each worker wrote its own shards: the split really was converted in parts.
    assert [len(s.shard_paths) for s in splits.values()] == [1, 2, 3]
    reference = splits[1]
    assert reference.num_records == 22 and reference.counts["missing_image_file"] == 1
    assert reference.counts["crowd_box"] > 0 and reference.counts["no_annotations"] == 1
    assert list(reference.image_ids) == sorted(reference.image_ids)
    for split in splits.values():
        assert split.counts == reference.counts
        for key in INDEX_KEYS:
            got, want = getattr(split, key), getattr(reference, key)
            assert got.dtype == want.dtype and np.array_equal(got, want), key
        assert _all_records(split) == _all_records(reference)
    # The index describes the records it sits beside.
    example = records.parse_numpy(_all_records(reference)[7])
    rows = slice(reference.box_offsets[7], reference.box_offsets[8])
    assert example.image_id == reference.image_ids[7]
    np.testing.assert_array_equal(example.boxes_yxyx, reference.boxes_yxyx[rows])
    assert not any(name.startswith((".", "part-")) for name in os.listdir(reference.directory))


def test_hosts_convert_their_shares_into_one_split(folder, tmp_path, monkeypatch):
    """Three hosts (threads standing in for processes, collectives over a barrier) equal one process."""
    monkeypatch.setattr(conversion, "_MIN_IMAGES_PER_WORKER", 1)
    alone = _convert(folder, tmp_path / "alone", 1)
    count, barrier, slots = 3, threading.Barrier(3, timeout=60), [None] * 3

    def hosts(index):
        def exchange(value):
            slots[index] = value
            barrier.wait()
            seen = list(slots)
            barrier.wait()
            return seen

        return conversion.Hosts(index, count, lambda v: exchange(v)[0], exchange)

    results = [None] * count

    def host(index):
        results[index] = _convert(folder, tmp_path / "hosts", 2, hosts=hosts(index))

    threads = [threading.Thread(target=host, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    split, *others = results
    assert others == [None, None] and split is not None
    assert len(split.shard_paths) == 6  # 3 hosts x 2 workers
    assert split.counts == alone.counts
    for key in INDEX_KEYS:
        np.testing.assert_array_equal(getattr(split, key), getattr(alone, key), err_msg=key)
    assert _all_records(split) == _all_records(alone)
    assert sorted(os.listdir(tmp_path)) == ["alone", "hosts"]  # no temporary directory left


@pytest.fixture
def prepared(folder, tmp_path):
    split = _convert(folder, tmp_path / "split", 1)
    with open(os.path.join(split.directory, split_writer.MANIFEST)) as f:
        manifest = json.load(f)
    return split, manifest


def test_reads_across_shards_in_any_order_start_no_python_thread(folder, tmp_path, monkeypatch):
    """tf.data calls read() from its own threads: a Python thread started there can deadlock with a garbage
    collection of another pipeline (see cache.RecordReader), so reading starts none."""
    split = _convert(folder, tmp_path / "split", 1, shard_bytes=1)  # one record per shard
    reader = split.open_reader()
    records = _all_records(split)
    assert len(split.shard_paths) == split.num_records > 2

    def no_thread(*args, **kwargs):
        raise AssertionError("read() started a Python thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    order = np.random.default_rng(0).permutation(split.num_records)
    assert list(reader.read(order)) == [records[i] for i in order]
    assert list(reader.read(np.array([], np.int64))) == []
    with pytest.raises(IndexError, match="outside the split"):
        reader.read(np.array([split.num_records]))


def test_opening_checks_sizes_and_edges_against_the_manifest(prepared):
    split, manifest = prepared
    shard = split.shard_paths[0]
    entry = manifest["shards"][0]
    assert entry["bytes"] == os.path.getsize(shard) and manifest["index"]["bytes"] > 0
    assert cache.load_split(split.directory).num_records == split.num_records

    os.truncate(shard, entry["bytes"] - 1000)
    with pytest.raises(DatasetError) as error:
        cache.load_split(split.directory)
    message = str(error.value)
    assert f"{os.path.basename(shard)} is truncated: {entry['bytes'] - 1000} bytes, manifest says {entry['bytes']}" in (
        message
    )
    assert f"delete {split.directory} to convert the source again" in message and "\n" not in message


def test_a_replaced_index_is_refused(prepared):
    split, _ = prepared
    index = os.path.join(split.directory, split_writer.INDEX)
    with open(index, "r+b") as f:  # same size, another first byte
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    with pytest.raises(DatasetError, match=r"index\.npz is corrupted .*delete .* to convert the source again"):
        cache.load_split(split.directory)


def test_a_corrupted_byte_inside_a_shard_fails_the_read_with_a_dataset_error(prepared):
    split, _ = prepared
    shard = split.shard_paths[0]
    size = os.path.getsize(shard)
    assert split_writer.EDGE_BYTES < size // 2 < size - split_writer.EDGE_BYTES, "outside the checksummed edges"
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    reopened = cache.load_split(split.directory)  # the edges are intact: opening is cheap and passes
    with pytest.raises(DatasetError) as error:
        reopened.open_reader().read(np.arange(reopened.num_records))
    message = str(error.value)
    assert message.startswith(f"prepared split {split.directory} cannot be read (")
    assert message.endswith(f"delete {split.directory} to convert the source again") and "\n" not in message


def _noise_folder(root, num_images):
    """PNGs of noise (incompressible: about 190 KB each) and their COCO JSON."""
    root.mkdir()
    rng = np.random.default_rng(0)
    images = []
    for i in range(num_images):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), np.uint8)).save(buffer, "PNG")
        (root / f"{i}.png").write_bytes(buffer.getvalue())
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 256, "height": 256})
    annotations = [{"image_id": i + 1, "category_id": 1, "bbox": [1, 2, 30, 40]} for i in range(num_images)]
    (root / "instances.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "x"}]})
    )
    return str(root / "instances.json"), str(root)


@contextlib.contextmanager
def _tmpfs(path, size="2m", read_only=False):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_disk_is_one_line_naming_the_directory_and_nothing_is_left(tmp_path, workers, monkeypatch):
    monkeypatch.setattr(conversion, "_MIN_IMAGES_PER_WORKER", 1)
    source = _noise_folder(tmp_path / "source", 16)  # about 3 MB of records for 2 MB of disk
    with _tmpfs(tmp_path / "small") as disk:
        directory = disk / "prepared" / "train"
        with pytest.raises(DatasetError) as error:
            _convert(source, directory, workers)
        message = str(error.value)
        assert message.startswith(f"cannot write prepared split to {disk / 'prepared'}")
        assert "(No space left on device); free space or point --config.dataset.cache_dir at a larger disk" in message
        assert "\n" not in message
        assert os.listdir(disk / "prepared") == []  # the temporary directory is gone


def test_a_read_only_cache_is_one_line_naming_the_directory(tmp_path):
    source = _noise_folder(tmp_path / "source", 1)
    with _tmpfs(tmp_path / "ro", read_only=True) as disk:
        with pytest.raises(
            DatasetError, match=r"to .*\(Read-only file system\); point --config.dataset.cache_dir at a"
        ):
            _convert(source, disk / "prepared" / "train", 1)


def test_a_file_in_place_of_the_cache_directory_is_one_line(tmp_path):
    source = _noise_folder(tmp_path / "source", 1)
    (tmp_path / "cache").write_text("not a directory")
    with pytest.raises(
        DatasetError, match=r"cannot write prepared split to .*cache.* \((Not a directory|File exists)\)"
    ):
        _convert(source, tmp_path / "cache" / "prepared" / "train", 1)
    # TFDS sources write through the same writer.
    with pytest.raises(DatasetError, match=r"\((Not a directory|File exists)\); point --config.dataset.cache_dir"):
        cache.write_split(
            str(tmp_path / "cache" / "x"),
            iter([]),
            collections.Counter(),
            fingerprint="f",
            class_names=(),
            category_ids=(),
        )


def test_a_corrupted_shard_stops_training_with_the_one_line_dataset_error(tmp_path):
    import input_pipeline
    from tests.helpers.coco_folders import coco_json_overrides
    from tests.helpers.pipeline_config import make_config

    overrides = {**coco_json_overrides(tmp_path, 40, 8), "dataset.cache_dir": str(tmp_path / "cache")}
    config = make_config(tmp_path / "data", **overrides)
    split = input_pipeline.prepare_split(config, "train")
    shard = split.shard_paths[0]
    with open(shard, "r+b") as f:  # every 3000th byte between the checksummed edges: every record's chunk
        for offset in range(split_writer.EDGE_BYTES, os.path.getsize(shard) - split_writer.EDGE_BYTES, 3000):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    # At the first read, or at opening when the damage reaches a shard's index (it then reads as fewer records).
    with pytest.raises(DatasetError) as error:
        batches = input_pipeline.create_train_iterator(config)
        for _ in range(10):
            next(batches)
    message = str(error.value)
    assert message.startswith(f"prepared split {split.directory} cannot be read (") and "\n" not in message


def _conversion_workers() -> dict[int, int]:
    """{first image: process id} of this process's running conversion workers."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                arguments = f.read().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == os.getpid() and "input_pipeline.datasets.conversion_worker" in arguments:
            found[json.loads(arguments[-2])["start"]] = int(entry)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_worker_killed_by_the_system_is_one_line_and_the_same_call_then_converts(folder, tmp_path, monkeypatch):
    """kill -9 of a real conversion worker (what the out-of-memory killer sends): at once a DatasetError naming
    the worker's images, the signal, the likely cause and fewer workers; the other worker stopped, nothing left
    behind; the same call again converts the split."""
    monkeypatch.setattr(conversion, "_MIN_IMAGES_PER_WORKER", 1)
    json_path, image_dir = folder
    images = tmp_path / "images"
    images.mkdir()
    names = sorted(os.listdir(image_dir))
    # The first and last images are named pipes nobody writes: each worker (images 0..10 and 11..22)
    # blocks reading one of them, alive until killed.
    blocked = (names[0], names[-1])
    for name in names:
        if name in blocked:
            os.mkfifo(images / name)
        else:
            os.symlink(os.path.join(image_dir, name), images / name)
    directory = tmp_path / "prepared" / "train"
    outcome = {}

    def convert():
        try:
            outcome["split"] = _convert((json_path, str(images)), directory, 2)
        except Exception as error:  # noqa: BLE001  examined below
            outcome["error"] = error

    converting = threading.Thread(target=convert)
    converting.start()
    try:
        deadline = time.monotonic() + 60
        while len(workers := _conversion_workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(workers) == [0, 11], workers
        os.kill(workers[11], signal.SIGKILL)
        converting.join(60)
    finally:
        if converting.is_alive():  # never leave the suite waiting on a blocked worker
            for pid in _conversion_workers().values():
                os.kill(pid, signal.SIGKILL)
            converting.join(60)
    error = outcome.get("error")
    assert isinstance(error, DatasetError), outcome
    message = str(error)
    assert "\n" not in message
    assert message.startswith("the conversion worker of images 11..22 was killed by SIGKILL (signal 9)"), message
    assert "out of memory" in message and "--config.dataset.prepare_workers=1 (2 ran at once)" in message
    assert os.listdir(tmp_path / "prepared") == []  # no temporary directory left
    assert _conversion_workers() == {}  # the blocked other worker was stopped, not waited for

    for name in blocked:
        os.remove(images / name)
        os.symlink(os.path.join(image_dir, name), images / name)
    split = _convert((json_path, str(images)), directory, 2)
    assert split.num_records == 22 and split.counts["missing_image_file"] == 1

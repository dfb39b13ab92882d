"""Converting a COCO-format folder with several worker processes, and with every host of a multi-host launch.

Copying images into records is per-image work (read the file, parse its
header, check boxes, serialize, write), so it splits by images: the images,
in the order the split holds them, are cut into contiguous ranges, one per
worker process; each worker writes its own shards and index part
(split_writer.py), and the parts are merged in image order. The records and
the index are therefore the same whatever the number of workers and hosts.

Workers: `dataset.prepare_workers` processes per host (0: min(CPU cores, 8)),
fewer when there are fewer than _MIN_IMAGES_PER_WORKER images per worker;
a split of up to _IN_PROCESS_MAX_IMAGES images with one range converts in
this process. Each is a fresh interpreter
(`python -m input_pipeline.datasets.conversion_worker`): never a fork, since
the parent may run JAX and TensorFlow threads, and not multiprocessing's
spawn, which imports the launching program's main module (the whole
trainer) in every child. A worker imports numpy, PIL, ijson and ArrayRecord
only (about 100 MB, a fraction of a second), reads its images' rows of the
table that this process parsed (column files in the temporary directory)
and reports its progress on stdout.

Hosts: with jax.process_count() > 1 every host converts a contiguous
share of the images with its own workers, into one temporary directory on
the shared filesystem; process 0 merges the parts and renames the split into
place. Process 0 first checks that every host sees the directory it made; on
hosts without a shared filesystem process 0 converts alone and the others
convert their own copy afterwards (splits.py). Each host parses the JSON
itself (seconds), so no host waits for another's table.

Memory: the process that parses holds one chunk of entries as Python
objects at a time, appending each to column files; then the image ids
(8 bytes per image) to sort them, and, only when the annotations are not
grouped by image in the JSON, one annotation column and the sort order at a
time (about 16 bytes per annotation). The heap that parsing freed goes back
to the OS before conversion starts. The workers hold a few thousand images'
rows and their index rows until these go to their files; merging the index
reads a block of each column at a time. No process holds a Python object per
image or per annotation for the whole split.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from input_pipeline import progress
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import cache, coco_images, coco_json, split_writer
from input_pipeline.datasets.column_files import ColumnFiles

# A worker process costs about half a second to start; below this many
# images per worker, fewer workers finish sooner.
_MIN_IMAGES_PER_WORKER = 500
_MAX_DEFAULT_WORKERS = 8
# Threads per worker reading image files (per-file latency on network filesystems).
_READ_THREADS = 8
# Up to this many images one range converts in this process (no worker start);
# above, even a single range goes to a worker, so the process that trains
# afterwards never carries the conversion's heap.
_IN_PROCESS_MAX_IMAGES = 5000
_WORKER_MODULE = "input_pipeline.datasets.conversion_worker"
_TABLE = ".table"


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The processes of a multi-host launch, converting together; every call is a collective of all of them.

    Attributes:
      index: this process's index (jax.process_index()).
      count: the number of processes.
      broadcast: process 0's int, on every process.
      gather: every process's int (0 or 1), in process order, on every process.
    """

    index: int
    count: int
    broadcast: Callable[[int], int]
    gather: Callable[[int], Sequence[int]]


def default_workers(requested: int) -> int:
    """Worker processes per host for `dataset.prepare_workers` (0: min(this process's CPU cores, 8))."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, _MAX_DEFAULT_WORKERS))


def _ranges(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous, nearly equal ranges covering [start, stop), empty ones left out."""
    bounds = [start + (stop - start) * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def convert_coco_json(
    directory: str,
    json_path: str,
    image_root: str,
    *,
    fingerprint: str,
    workers: int,
    hosts: Hosts | None = None,
    shard_bytes: int = split_writer.SHARD_BYTES,
) -> cache.PreparedSplit | None:
    """Converts a COCO-format folder into the prepared split at `directory`.

    Args:
      directory: where the split goes (replaced when there).
      json_path, image_root: the folder (see coco_json).
      fingerprint: the source's identity, stored in the manifest.
      workers: worker processes on this host (see default_workers).
      hosts: with several processes, all of them call this together (see
        module doc); None converts on this process alone.
      shard_bytes: shard size (split_writer.SHARD_BYTES).

    Returns:
      The split, on the process that finished it (process 0 with `hosts`);
      None on the other processes, which load it once this returns.

    Raises:
      DatasetError: the folder is unusable (coco_json), the directory cannot
        be written, or another host failed converting its share.
    """
    directory = os.fspath(directory)
    if hosts is not None and hosts.count > 1:
        return _convert_on_hosts(directory, json_path, image_root, fingerprint, workers, hosts, shard_bytes)
    tmp = split_writer.new_temporary_directory(directory)
    try:
        table = _read_table(json_path, image_root, tmp, directory)
        convert_range(tmp, os.path.join(tmp, _TABLE), image_root, 0, table.num_images, workers, shard_bytes)
        _finish(tmp, directory, table, fingerprint)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cache.load_split(directory, fingerprint=fingerprint)


def _read_table(json_path: str, image_root: str, tmp: str, directory: str) -> coco_json.ImageTable:
    try:
        table = coco_json.read_table(json_path, image_root, ColumnFiles(os.path.join(tmp, _TABLE)))
        table.columns.save_dtypes()
    except OSError as e:  # the columns' files, in the cache
        raise split_writer.write_error(directory, e) from e
    _release_freed_heap()
    return table


def _release_freed_heap() -> None:
    """Returns the heap that parsing freed to the OS (glibc's malloc_trim; elsewhere nothing).

    Parsing allocates and frees millions of small objects a chunk at a time;
    glibc keeps the freed pages, so without this the process that goes on to
    train held 27 MB more at 200,000 images than at 20,000 (after: 1 MB).
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _finish(tmp: str, directory: str, table: coco_json.ImageTable, fingerprint: str) -> None:
    shutil.rmtree(table.columns.directory, ignore_errors=True)  # each host's, when several convert
    counts = collections.Counter(table.counts)
    counts["usable_images"] += 0  # Present even when nothing is usable.
    categories = table.categories
    split_writer.finish_split(
        tmp,
        counts,
        fingerprint=fingerprint,
        class_names=categories.class_names,
        category_ids=categories.category_ids,
    )
    split_writer.move_into_place(tmp, directory)


def convert_range(
    tmp: str, table_dir: str, image_root: str, start: int, stop: int, workers: int, shard_bytes: int
) -> None:
    """Writes the parts of images [start, stop) of the table in `table_dir` into `tmp`, with `workers` processes.

    Raises:
      DatasetError: a worker's DatasetError (a full disk, for one).
      RuntimeError: a worker failed otherwise (its last lines of stderr).
    """
    count = max(1, min(workers, (stop - start) // _MIN_IMAGES_PER_WORKER))
    ranges = _ranges(start, stop, count)
    description = f"converting {os.path.basename(tmp).split('.tmp-')[0]}"
    with progress.Progress(description, total=stop - start, unit="images") as report:
        if len(ranges) <= 1 and stop - start <= _IN_PROCESS_MAX_IMAGES:
            counts = collections.Counter()
            columns = ColumnFiles.open(table_dir)
            examples = coco_images.iter_table_examples(columns, image_root, counts, start, stop, _READ_THREADS)
            for _ in split_writer.write_part(tmp, start, examples, counts=counts, shard_bytes=shard_bytes):
                report.update(coco_images.images_examined(counts))
            return
        _run_workers(tmp, table_dir, image_root, ranges, shard_bytes, report)


def _run_workers(
    tmp: str,
    table_dir: str,
    image_root: str,
    ranges: Sequence[tuple[int, int]],
    shard_bytes: int,
    report: progress.Progress,
) -> None:
    """Runs one worker process per range and waits for all; stops the others when one fails."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    # glibc gives each reading thread its own malloc arena; freed image buffers
    # scattered over 8 arenas kept a worker's RSS growing with the images it
    # converted (+27 MB from 20k to 100k images; 2 arenas: +6 MB from 20k to 60k).
    env.setdefault("MALLOC_ARENA_MAX", "2")
    processes, logs = [], []
    selector = selectors.DefaultSelector()
    done = {}
    try:
        for start, stop in ranges:
            spec = {
                "table": table_dir,
                "image_root": image_root,
                "start": start,
                "stop": stop,
                "out": tmp,
                "shard_bytes": shard_bytes,
                "threads": _READ_THREADS,
            }
            # Not in `tmp`: a worker must be able to say that the cache's disk is full.
            log = tempfile.TemporaryFile("w+")  # noqa: SIM115  closed below
            process = subprocess.Popen(
                [sys.executable, "-m", _WORKER_MODULE, json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
            )
            selector.register(process.stdout, selectors.EVENT_READ, len(processes))
            processes.append(process)
            logs.append(log)
        while selector.get_map():
            for key, _ in selector.select():
                line = key.fileobj.readline()
                if line:
                    done[key.data] = int(line)
                    report.update(sum(done.values()))
                    continue
                selector.unregister(key.fileobj)
                # A worker that failed stops the conversion now (the others are
                # killed below), not after the others finished their shares.
                index = key.data
                if processes[index].wait() != 0:
                    raise _worker_error(processes[index].returncode, logs[index], *ranges[index], len(ranges))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()
        for log in logs:
            log.close()
        selector.close()


def _worker_error(returncode: int, log, start: int, stop: int, workers: int) -> Exception:
    """What a failed worker means for the user: its DatasetError, a signal that ended it, or a crash.

    A worker ended by a signal left no message of its own: SIGKILL is what
    the kernel's out-of-memory killer sends, so fewer workers (each holds
    its share of images in flight) is the fix named.
    """
    images = f"images {start}..{stop - 1}"
    log.seek(0)
    lines = [line.rstrip() for line in log.read().splitlines() if line.strip()]
    if returncode == 3 and lines and lines[-1].startswith("error: "):  # the worker's DatasetError
        return DatasetError(lines[-1][len("error: ") :])
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        if number == signal.SIGKILL:
            fix = (
                f"with fewer workers, e.g. --config.dataset.prepare_workers={workers // 2} ({workers} ran at once)"
                if workers > 1
                else "with more memory free"
            )
            return DatasetError(
                f"the conversion worker of {images} was killed by {name} (signal {number}), most likely by the "
                f"system for running out of memory; run the same command again {fix}"
            )
        return DatasetError(
            f"the conversion worker of {images} was stopped by {name} (signal {number}) from outside; "
            "run the same command again to convert the split from the start"
        )
    tail = "\n".join(lines[-20:])
    return RuntimeError(f"conversion worker of {images} failed (exit {returncode}):\n{tail}")


def _convert_on_hosts(
    directory: str, json_path: str, image_root: str, fingerprint: str, workers: int, hosts: Hosts, shard_bytes: int
) -> cache.PreparedSplit | None:
    """Every host converts its share into one shared temporary directory (see module doc)."""
    # Every host runs the same collectives in the same order, whatever fails
    # where: a host that stopped early would leave the others waiting.
    tmp = f"{directory}.tmp-{hosts.broadcast(secrets.randbits(62) if hosts.index == 0 else 0):016x}"
    marker = os.path.join(tmp, "hosts")
    error = None
    if hosts.index == 0:
        try:
            os.makedirs(tmp)
            with open(marker, "w") as f:
                f.write(f"{hosts.count} processes convert {directory}\n")
        except OSError as e:
            error = split_writer.write_error(os.path.dirname(directory) or ".", e)
    # The others look for the marker only once process 0 has said it wrote it.
    if not hosts.broadcast(int(hosts.index == 0 and error is None)):
        raise error or DatasetError(f"process 0 could not create {tmp}; see its log")
    sees = hosts.gather(int(os.path.exists(marker)))
    if not all(sees):
        # No shared filesystem: process 0 converts alone; the others make their own copy later.
        if hosts.index == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return convert_coco_json(
                directory, json_path, image_root, fingerprint=fingerprint, workers=workers, shard_bytes=shard_bytes
            )
        return None
    table = None
    try:
        table_dir = os.path.join(tmp, f"{_TABLE}-{hosts.index}")
        table = coco_json.read_table(json_path, image_root, ColumnFiles(table_dir))
        table.columns.save_dtypes()
        _release_freed_heap()
        share = _ranges(0, table.num_images, hosts.count)
        start, stop = dict(enumerate(share)).get(hosts.index, (table.num_images, table.num_images))
        convert_range(tmp, table_dir, image_root, start, stop, workers, shard_bytes)
        shutil.rmtree(table_dir)
    except Exception as e:  # noqa: BLE001  reported to every host below, raised here
        error = e
    converted = hosts.gather(int(error is None))
    if error is not None:
        if hosts.index == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    if not all(converted):
        if hosts.index == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        failed = [i for i, ok in enumerate(converted) if not ok]
        raise DatasetError(f"process {failed[0]} failed converting its share of {json_path}; see its log")
    if hosts.index == 0:
        try:
            os.remove(marker)
            _finish(tmp, directory, table, fingerprint)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cache.load_split(directory, fingerprint=fingerprint)
    return None

"""Prediction at the scale of the training data: sharded over every process, written as it goes, resumable.

`python -m detector.predict` runs this over a folder tree, a file list or a
prepared split. Every process of a launch reads and decodes its own rows of
each global batch (as training's input pipeline does), the predict step runs
sharded over the mesh, and each process writes the detections of its rows to
its own shard (`prediction_shards`: the format, the commits, the merge).
Process 0 claims OUTPUT first: `run.json` says what the run predicts with
and on, and a resumed run must match it; `inputs/` holds the input index
(`image_sources.build_file_index`); `pictures/` the first images drawn.

All processes run the same global batches (SPMD) from the earliest batch
any of them has not committed; a process whose manifest is ahead runs those
batches again without writing them. Unreadable images are counted and
listed (the rows' `error`), never fatal.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import hotcoco
import jax
import numpy as np
from jax.experimental import multihost_utils

from detector.errors import ConfigError
from detector.serving import coco_evaluation, drawing, image_sources
from detector.serving.coco_evaluation import Predictions
from detector.serving.prediction_shards import (
    RUN_FILE,
    BatchImages,
    ShardWriter,
    Summary,
    image_table,
    merge,
    write_atomically,
    write_coco_results,
)
from detector.serving.predictor import Predictor, network_input
from input_pipeline import batch as batch_layout
from input_pipeline import file_lock, transforms
from input_pipeline.progress import Progress
from sharding import distributed

INPUTS_DIR = "inputs"
PICTURES_DIR = "pictures"
LOCK_FILE = ".predict.lock"
# Without --pictures: every image drawn up to this many inputs, the first PICTURES_BEYOND of larger runs.
PICTURES_ALL_UP_TO = 300
PICTURES_BEYOND = 20
RUN_FORMAT = 1


# ----------------------------------------------------------------------------
# The output directory: whose it is, and what is in it.
# ----------------------------------------------------------------------------


def run_record(predictor: Predictor, source: image_sources.ImageSource, workdir: str, checkpoint: str) -> dict:
    """What a resumed run must agree with: the model, its thresholds, the inputs, the launch's shape."""
    postprocess = predictor.config.postprocess
    return {
        "format": RUN_FORMAT,
        "inputs": {"description": source.description, "images": len(source), "fingerprint": source.fingerprint},
        "model": {
            "workdir": os.path.abspath(workdir),
            "checkpoint": str(checkpoint),
            "step": int(predictor.step),
            "masks": predictor.predicts_masks,
        },
        "postprocess": {
            "score_threshold": float(postprocess.score_threshold),
            "max_detections": int(postprocess.max_detections),
        },
        "processes": jax.process_count(),
        "batch_size": int(predictor.batch_size),
    }


def _differences(found: dict, wanted: dict, prefix: str = "") -> list[str]:
    differences = []
    for key in sorted(set(found) | set(wanted)):
        a, b = found.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differences += _differences(a, b, f"{prefix}{key}.")
        elif a != b and key != "description":
            if key == "fingerprint":  # a digest: its head tells two apart
                a, b = f"{a}"[:12], f"{b}"[:12]
            differences.append(f"{prefix}{key} {a!r} there, {b!r} now")
    return differences


def _refuse_foreign(output: str) -> None:
    """Raises ConfigError when OUTPUT exists, is not empty and holds no prediction run (before anything is written)."""
    if not os.path.isdir(output) or os.path.exists(os.path.join(output, RUN_FILE)):
        if os.path.exists(output) and not os.path.isdir(output):
            raise ConfigError(f"--output={output} is a file; choose a folder (new or empty) for the predictions")
        return
    others = sorted(n for n in os.listdir(output) if n not in (LOCK_FILE, f"{INPUTS_DIR}.new"))
    if others:
        raise ConfigError(
            f"--output={output} is not empty and holds no prediction run ({', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); choose an empty or new --output"
        )


def _claim_output(output: str, record: dict) -> None:
    """Writes run.json for a new run, or checks that the run already in OUTPUT is this one (process 0).

    Raises:
      ConfigError: OUTPUT holds another run's results (what differs, and the fix).
    """
    run_path = os.path.join(output, RUN_FILE)
    if not os.path.exists(run_path):
        write_atomically(run_path, json.dumps(record, indent=1))
        return
    try:
        with open(run_path) as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run_path} cannot be read ({e}); delete {output} or choose another --output") from e
    differences = _differences(found, record)
    if differences:
        raise ConfigError(
            f"--output={output} holds another prediction run's results ({'; '.join(differences[:3])}); "
            "choose another --output, or delete it to predict again"
        )


def _index_inputs(inputs: list[str], output: str) -> image_sources.FileIndex:
    """Indexes `inputs` beside OUTPUT/inputs (process 0); `_replace_index` puts it in place once the run is claimed.

    A run's index is replaced only after its fingerprint was compared: other inputs never overwrite it.
    """
    fresh = os.path.join(output, f"{INPUTS_DIR}.new")
    shutil.rmtree(fresh, ignore_errors=True)
    return image_sources.build_file_index(inputs, fresh)


def _replace_index(output: str) -> None:
    final = os.path.join(output, INPUTS_DIR)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(os.path.join(output, f"{INPUTS_DIR}.new"), final)


def _agree(failure: Exception | None, what: str) -> None:
    """Every process learns whether process 0 failed at `what`, so none waits in a collective for it."""
    failed = failure is not None
    if jax.process_count() > 1:
        failed = bool(multihost_utils.broadcast_one_to_all(np.int32(failed)))
    if failure is not None:
        raise failure
    if failed:
        raise ConfigError(f"process 0 stopped while {what}; its error says why")


def open_output(
    output: str,
    make_record: Callable[[image_sources.ImageSource], dict],
    *,
    inputs: list[str] | None = None,
    split_source: Callable[[], image_sources.ImageSource] | None = None,
) -> tuple[image_sources.ImageSource, dict, file_lock.FileLock | None]:
    """Claims OUTPUT for this run (process 0 locks and checks it) and opens the inputs on every process.

    Exactly one of `inputs` (files, folders, lists) and `split_source` (a prepared split's images).

    Returns:
      (the inputs, the run record, process 0's held lock: release it when done).
    """
    lock = None
    # A split is prepared by every process together (input_pipeline.prepare_split), before process 0 claims OUTPUT.
    source: image_sources.ImageSource | None = split_source() if split_source else None
    failure = None
    if jax.process_index() == 0:
        created = not os.path.exists(output)
        try:
            _refuse_foreign(output)
            os.makedirs(output, exist_ok=True)
            lock = file_lock.FileLock(os.path.join(output, LOCK_FILE), wait=False).acquire()
            source = source or _index_inputs(inputs, output)
            _claim_output(output, make_record(source))
            if not split_source:
                _replace_index(output)
                source = image_sources.FileIndex(os.path.join(output, INPUTS_DIR))
        except file_lock.LockHeld as e:
            failure = ConfigError(
                f"--output={output} is in use by {e.holder or 'another prediction run'}; wait for it to finish "
                "or choose another --output"
            )
        except (ConfigError, OSError) as e:
            failure = e
        if failure is not None and lock is not None:
            shutil.rmtree(os.path.join(output, f"{INPUTS_DIR}.new"), ignore_errors=True)
            lock.release()
            if created:  # nothing of this run's is left to resume
                shutil.rmtree(output, ignore_errors=True)
    _agree(failure, f"checking --output={output}")
    if source is None:
        source = image_sources.FileIndex(os.path.join(output, INPUTS_DIR))
    return source, make_record(source), lock


# ----------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------


def picture_count(requested: int | None, images: int) -> int:
    """How many images get a picture: `requested`, or all of a small run and the first few of a large one."""
    if requested is not None:
        if requested < 0:
            raise ConfigError(f"--pictures={requested} must be 0 or more")
        return min(requested, images)
    return images if images <= PICTURES_ALL_UP_TO else PICTURES_BEYOND


def picture_names(source: image_sources.ImageSource, count: int) -> dict[int, str]:
    """Position -> `NAME.png` for the first `count` images; `NAME_ID.png` where their names repeat."""
    stems = [os.path.splitext(os.path.basename(source.name(p)))[0].replace(":", "_") for p in range(count)]
    repeats = collections.Counter(stems)
    return {
        p: f"{stem}.png" if repeats[stem] == 1 else f"{stem}_{source.image_id(p)}.png" for p, stem in enumerate(stems)
    }


def _read_batch(
    source: image_sources.ImageSource,
    positions: np.ndarray,
    opts: transforms.TransformOptions,
    blank: dict[str, np.ndarray],
    draw: int,
    pool: concurrent.futures.Executor,
) -> BatchImages:
    def read(position: int) -> tuple[np.ndarray | None, str | None]:
        if position < 0:
            return None, None
        try:
            return source.read(position), None
        except image_sources.UnreadableImage as e:
            logging.warning("skipping %s: not a readable image (%s)", source.name(position), e)
            return None, str(e)

    decoded = list(pool.map(read, positions.tolist()))
    rows, errors, sizes, pictures = [], [], np.zeros([len(positions), 2], np.int32), {}
    for row, (position, (image, error)) in enumerate(zip(positions.tolist(), decoded, strict=True)):
        errors.append(error)
        if image is None:
            rows.append(blank)
            continue
        sizes[row] = image.shape[:2]
        rows.append(network_input(image, source.image_id(position), opts))
        if position < draw:
            pictures[position] = image
    return BatchImages(
        positions=positions.astype(np.int64),
        errors=errors,
        sizes=sizes,
        local_batch={k: np.stack([row[k] for row in rows]) for k in blank},
        pictures=pictures,
    )


def _prefetched(batches: Iterator[Callable[[], BatchImages]], batches_ahead: int) -> Iterator[BatchImages]:
    """Runs each batch's reading `batches_ahead` batches ahead in a thread, so decoding overlaps the device."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict-read") as reader:
        pending: collections.deque = collections.deque()
        for make in batches:
            pending.append(reader.submit(make))
            if len(pending) > batches_ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def predict_to_output(
    predictor: Predictor,
    source: image_sources.ImageSource,
    output: str,
    *,
    pictures: int | None = None,
    coco_results: bool = False,
    commit_every_s: float = 60.0,
    commit_every_images: int = 50_000,
) -> Summary | None:
    """Predicts every image of `source` into OUTPUT (claimed with `open_output`); process 0 merges and returns.

    Every process must call this. Rows are committed every `commit_every_s`
    seconds or `commit_every_images` images of this process, whichever comes
    first, and at the end: a killed run loses at most that much work.
    """
    start_time = time.perf_counter()
    process, processes = jax.process_index(), jax.process_count()
    with_masks = bool(predictor.predicts_masks)
    writer = ShardWriter(output, process, processes, with_masks)
    global_size = predictor.batch_size
    local_size = global_size // processes
    first_row = predictor.first_row()
    num_batches = -(-len(source) // global_size)
    start = writer.next_batch
    if processes > 1:  # every process runs every batch from the earliest uncommitted one
        start = int(np.min(multihost_utils.process_allgather(np.int64(writer.next_batch))))
    draw = picture_count(pictures, len(source))
    names = picture_names(source, draw)
    picture_dir = os.path.join(output, PICTURES_DIR)
    if draw:
        os.makedirs(picture_dir, exist_ok=True)
    opts = transforms.TransformOptions.from_config(predictor.config)
    config = predictor.config
    blank = batch_layout.empty_example(config.input.image_size, config.input.max_boxes)
    info = predictor.dataset_info
    if start > 0 and process == 0:
        logging.info("resuming %s: %d of %d batches were committed by every process", output, start, num_batches)

    def positions_of(batch_index: int) -> np.ndarray:
        positions = batch_index * global_size + first_row + np.arange(local_size, dtype=np.int64)
        return np.where(positions < len(source), positions, -1)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="predict-decode") as pool:
            work = (
                (lambda b=b: _read_batch(source, positions_of(b), opts, blank, draw, pool))
                for b in range(start, num_batches)
            )
            last_commit = time.perf_counter()
            with Progress(
                "predict",
                len(source),
                unit="images",
                log_every_s=10.0,
                enabled=process == 0,
                initial=min(start * global_size, len(source)),
            ) as progress:
                for batch_index, images in zip(
                    range(start, num_batches), _prefetched(work, batches_ahead=2), strict=True
                ):
                    if processes > 1:
                        # A predict program may hold no collective at all: this one notices a dead peer at once.
                        multihost_utils.process_allgather(np.int32(batch_index))
                    outputs = predictor(predictor.global_batch(images.local_batch))
                    predictions = coco_evaluation.batch_predictions(outputs, info.label_to_category_id)
                    if batch_index >= writer.next_batch:
                        writer.add(image_table(source, images, predictions, with_masks), batch_index)
                        for position, image in images.pictures.items():
                            _draw(picture_dir, names[position], image, source.image_id(position), predictions, info)
                    if (
                        writer.pending_rows >= commit_every_images
                        or time.perf_counter() - last_commit >= commit_every_s
                    ):
                        writer.commit()
                        last_commit = time.perf_counter()
                    progress.update(min((batch_index + 1) * global_size, len(source)))
        writer.commit()
        if processes > 1:
            multihost_utils.sync_global_devices(f"predicted into {output}")
    except Exception as e:
        if distributed.lost_peer(e):
            raise distributed.PeerLost(
                f"another process of this launch stopped (killed, crashed or its host lost) while predicting into "
                f"{output} ({str(e).splitlines()[0][:160]}); this process's rows of the first {writer.committed_batch} "
                "batches are committed: rerun the same command to resume"
            ) from e
        raise
    if process != 0:
        return None
    summary = merge(output, processes, categories=_categories(info), seconds=time.perf_counter() - start_time)
    if coco_results:
        write_coco_results(output)
    return summary


def predict(
    predictor: Predictor,
    output: str,
    *,
    inputs: list[str] | None = None,
    split_source: Callable[[], image_sources.ImageSource] | None = None,
    workdir: str,
    checkpoint: str,
    **options: Any,
) -> Summary | None:
    """`open_output` and `predict_to_output` (with `options`), holding OUTPUT's lock throughout: the whole command."""
    source, _, lock = open_output(
        output,
        lambda source: run_record(predictor, source, workdir, checkpoint),
        inputs=inputs,
        split_source=split_source,
    )
    try:
        return predict_to_output(predictor, source, output, **options)
    finally:
        if lock is not None:
            lock.release()


def _categories(info) -> list[dict[str, Any]]:
    return [
        {"id": int(category), "name": str(name)}
        for category, name in zip(info.label_to_category_id, info.class_names, strict=True)
    ]


def _draw(directory: str, name: str, image: np.ndarray, image_id: int, predictions: Predictions, info) -> None:
    detections = predictions.detections
    mine = np.flatnonzero(detections.image_ids == image_id)
    x, y, w, h = np.asarray(detections.boxes_xywh[mine], np.float32).reshape(-1, 4).T
    label_of_category = {int(c): label for label, c in enumerate(info.label_to_category_id)}
    instance_masks = None
    if detections.masks is not None and len(mine):
        chosen = detections.masks.select(mine)
        decoded = np.asarray(hotcoco.mask.decode(chosen.to_coco()), bool)
        instance_masks = np.moveaxis(decoded.reshape(image.shape[0], image.shape[1], len(mine)), -1, 0)
    picture = drawing.draw_detections(
        image,
        np.stack([y, x, y + h, x + w], axis=-1),
        np.asarray([label_of_category[int(c)] for c in detections.category_ids[mine]], np.int32),
        np.asarray(detections.scores[mine], np.float32),
        info.class_names,
        masks=instance_masks,
    )
    drawing.save_png(picture, os.path.join(directory, name))

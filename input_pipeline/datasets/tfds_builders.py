"""TFDS builders of the registry's TFDS datasets: opened from the data dir, synthetic_shapes generated there."""

from __future__ import annotations

import errno
import glob
import os
import shutil

import jax
import tensorflow_datasets as tfds
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from input_pipeline import file_lock
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import synthetic_shapes as ss
from input_pipeline.datasets.locations import resolve_data_dir
from input_pipeline.datasets.registry import TFDS_DATASETS, check_name


def _synthetic_builder(config, data_dir: str, sync: bool):
    ds = config.dataset
    sizes = (int(ds.num_train_examples), int(ds.num_eval_examples), int(ds.image_size))
    name = ss.config_name(*sizes)

    def make():
        # TFDS refuses a new config object named like a predefined one.
        cfg = name if name in ss.SyntheticShapes.builder_configs else (ss.SyntheticShapesConfig.make(*sizes))
        return ss.SyntheticShapes(data_dir=data_dir, config=cfg)

    epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
    # No network: the dataset is generated here, never fetched from GCS.
    download_config = tfds.download.DownloadConfig(try_download_gcs=False)
    lock_path = os.path.join(data_dir, "synthetic_shapes", f"{name}.lock")

    def generate_once():
        builder = make()
        if builder.is_prepared():
            return builder
        # Independent processes (a sweep's jobs started together on a fresh
        # data dir) would each generate, and all but one fail renaming their
        # copy into place: one generates, the others wait and reuse its files.
        with file_lock.FileLock(lock_path, wait=True, description=f"generating synthetic_shapes/{name}"):
            builder = make()  # Opened again: the holder we waited for may have generated it.
            if not builder.is_prepared():
                _generate(builder, download_config, data_dir, name)
        return builder

    if sync and jax.process_count() > 1:
        if jax.process_index() == 0:
            generate_once()
        multihost_utils.sync_global_devices(f"prepare synthetic_shapes/{name}")
    # In a multi-process launch, opened after the barrier so it reads process
    # 0's files. Where data_dir is not shared between hosts, generation is
    # deterministic, so a local copy is identical to process 0's.
    return generate_once()


_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def _full_disk_cause(error: BaseException) -> str | None:
    """The reason "No space left on device" (or the quota's) when `error` or its causes report it, else None.

    TFDS wraps TensorFlow's ResourceExhaustedError from a failed write in a
    RuntimeError, so the reason can sit anywhere in the chain, as an errno or
    only as text.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_DISK:
            return os.strerror(error.errno)
        for code in _FULL_DISK:
            if os.strerror(code) in str(error):
                return os.strerror(code)
        error = error.__cause__ or error.__context__
    return None


def _generate(builder: tfds.core.DatasetBuilder, download_config, data_dir: str, name: str) -> None:
    """Generates synthetic_shapes in `data_dir`; a full disk becomes a DatasetError, with TFDS's partial copy removed.

    TFDS writes into a directory named `incomplete.*` beside the version's and
    renames it into place at the end; a failure leaves it behind, and every
    later attempt writes another beside it.
    """
    logging.info("generating the embedded dataset synthetic_shapes/%s in %s (once: later runs read it)", name, data_dir)
    # TFDS's progress bars leave their line unfinished when generation fails,
    # and the one-line error would start in the middle of it.
    tfds.display_progress_bar(False)
    try:
        builder.download_and_prepare(download_config=download_config)
    except Exception as error:
        cause = _full_disk_cause(error)
        if cause is None:
            raise
        config_dir = os.path.dirname(os.fspath(builder.data_dir))
        for partial in glob.glob(os.path.join(glob.escape(config_dir), "*incomplete*")):
            shutil.rmtree(partial, ignore_errors=True)
        raise DatasetError(
            f"cannot generate the embedded dataset synthetic_shapes/{name} in {data_dir} ({cause}); free space "
            "there or point --config.dataset.data_dir (or $DETECTOR_DATA_DIR) at a larger disk"
        ) from error


def get_builder(config, *, sync: bool = True) -> tfds.core.DatasetBuilder:
    """The TFDS builder of a TFDS dataset (synthetic_shapes: generated on first use).

    coco/2017 and voc are opened from the data dir and never downloaded (see
    prepare_split for `sync`).
    """
    name = check_name(config)
    if name not in TFDS_DATASETS:
        raise DatasetError(f"dataset {name!r} is not a TFDS dataset")
    data_dir = resolve_data_dir(config)
    if name == "synthetic_shapes":
        return _synthetic_builder(config, data_dir, sync)
    return tfds.builder(name, data_dir=data_dir)

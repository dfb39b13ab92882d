"""TFDS builders of the registry's TFDS datasets: opened from the data dir, synthetic_shapes generated there."""

from __future__ import annotations

import os

import jax
import tensorflow_datasets as tfds
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
                builder.download_and_prepare(download_config=download_config)
        return builder

    if sync and jax.process_count() > 1:
        if jax.process_index() == 0:
            generate_once()
        multihost_utils.sync_global_devices(f"prepare synthetic_shapes/{name}")
    # In a multi-process launch, opened after the barrier so it reads process
    # 0's files. Where data_dir is not shared between hosts, generation is
    # deterministic, so a local copy is identical to process 0's.
    return generate_once()


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

"""Where datasets live: the data dir, the prepared-splits cache, a COCO-format folder's files."""

from __future__ import annotations

import os

from etils import epath

from input_pipeline.dataset_errors import DatasetError

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "detector", "datasets")


def resolve_data_dir(config) -> str:
    """Returns the data dir for `config`, creating the default one if needed.

    `config.dataset.data_dir`, or when None `$DETECTOR_DATA_DIR`, or
    DEFAULT_DATA_DIR. An explicitly set data dir may not exist yet, but its
    parent directory must (a typo in a path should fail here, loudly, rather
    than prepare a dataset somewhere unexpected).
    """
    data_dir = config.dataset.data_dir
    if not data_dir:
        data_dir = os.environ.get("DETECTOR_DATA_DIR") or os.path.expanduser(DEFAULT_DATA_DIR)
        epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
        return os.fspath(data_dir)
    data_dir = os.fspath(data_dir)
    if "://" not in data_dir:  # Local path; remote ones (gs://) are not checked.
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
        parent = os.path.dirname(data_dir)
        if not os.path.isdir(parent):
            raise DatasetError(
                f"data_dir {data_dir} cannot be used: its parent directory {parent} "
                f"does not exist; create it (mkdir -p {parent}) or set "
                "--config.dataset.data_dir to an existing location"
            )
    return data_dir


def cache_root(config, data_dir: str) -> str:
    """Directory of the prepared splits: `config.dataset.cache_dir`, or when None DATA_DIR/prepared."""
    root = config.dataset.cache_dir
    return os.path.abspath(os.path.expanduser(os.fspath(root))) if root else os.path.join(data_dir, "prepared")


def coco_json_paths(config, which: str) -> tuple[str, str]:
    """(instances JSON, image root) of the `which` ('train' or 'eval') split of a coco_json dataset, absolute."""
    json_key, images_key = f"{which}_json", f"{which}_images"
    json_path = config.dataset[json_key]
    image_root = config.dataset[images_key]
    if not json_path or not image_root:
        raise DatasetError(
            f"dataset coco_json needs dataset.{json_key} and dataset.{images_key}; "
            f"pass --config.dataset.{json_key}=PATH/instances.json "
            f"--config.dataset.{images_key}=PATH/images"
        )
    return (os.path.abspath(os.path.expanduser(json_path)), os.path.abspath(os.path.expanduser(image_root)))

"""What identifies a source's content, so a prepared split is converted again when its source changes."""

from __future__ import annotations

import hashlib
import os

from input_pipeline.dataset_errors import DatasetError


def file_fingerprint(path: str, config_key: str) -> str:
    """`path:size:mtime_ns` of a file; DatasetError naming `--config.dataset.<config_key>` when it cannot be read."""
    try:
        stat = os.stat(path)
    except FileNotFoundError as e:
        raise DatasetError(f"COCO annotations file {path} does not exist; check --config.dataset.{config_key}") from e
    except OSError as e:
        raise DatasetError(f"cannot read {path} ({e.strerror}); check --config.dataset.{config_key}") from e
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def coco_json_fingerprint(json_path: str, image_root: str, config_key: str) -> str:
    """A COCO-format folder: its instances file (path, size, mtime) and its image root."""
    return f"coco_json:{file_fingerprint(json_path, config_key)}:{image_root}"


def tfds_fingerprint(full_name: str, split: str) -> str:
    """A TFDS split: the builder's versioned full name (e.g. 'coco/2017/1.1.0') and the split."""
    return f"tfds:{full_name}:{split}"


def short_digest(fingerprint: str) -> str:
    """12 hex digits of the fingerprint's SHA-1, to name a directory after it."""
    return hashlib.sha1(fingerprint.encode()).hexdigest()[:12]

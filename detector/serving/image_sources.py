"""What bulk prediction reads: image files found on disk, indexed on disk, or the records of a prepared split.

A run over millions of images cannot keep their paths in Python lists: a
path as a Python string costs about 100 bytes, and every host would hold
every path. `build_file_index` walks the inputs once (folders recursively in
sorted order, files as given, file lists line by line) and streams each path
into two files beside the run's output:

  paths.bin     the paths' UTF-8 bytes back to back
  offsets.bin   int64 [N + 1] path i is paths.bin[offsets[i]:offsets[i + 1]]

which `FileIndex` maps into memory (the pages a process touches, not N
strings). The image id of a file is its position in this index, so the index
has a fingerprint (SHA-256 of both files) that a resumed run checks: the same
ids must name the same files. A prepared split (`SplitImages`) is indexed
already; its ids are the dataset's own, so its detections score against its
ground truth.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from detector.errors import ConfigError
from input_pipeline import records

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
PATHS_FILE = "paths.bin"
OFFSETS_FILE = "offsets.bin"
INDEX_FILE = "index.json"
# A list file names one image per line; its relative paths are relative to the list's folder.
LIST_SUFFIXES = (".txt", ".lst")


class UnreadableImage(Exception):
    """An input that is not a readable image; the message says why (one line)."""


class ImageSource(Protocol):
    """Images by position 0..len-1, as bulk prediction reads them.

    Attributes:
      fingerprint: identity of the list (names and order): equal for the same inputs.
      description: what the source is, for logs and the run's record.
    """

    fingerprint: str
    description: str

    def __len__(self) -> int: ...

    def name(self, position: int) -> str:
        """The image's file path, or its split and record."""

    def image_id(self, position: int) -> int:
        """The id its detections carry: the position for files, the dataset's id for a split."""

    def read(self, position: int) -> np.ndarray:
        """`[H, W, 3]` uint8 RGB (EXIF rotation applied); raises UnreadableImage."""


def decode_image(data_or_file) -> np.ndarray:
    """Bytes or a binary file object -> `[H, W, 3]` uint8 RGB with the EXIF rotation applied; raises UnreadableImage."""
    try:
        with Image.open(data_or_file) as image:
            return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise UnreadableImage(" ".join(str(e).split())[:200] or type(e).__name__) from e


def read_image_file(path: str) -> np.ndarray:
    """An image file as `decode_image` gives it; raises UnreadableImage (a missing file too)."""
    try:
        with open(path, "rb") as f:
            return decode_image(f)
    except OSError as e:
        raise UnreadableImage(f"{e.strerror or e}") from e


def _walk(inputs: Sequence[str]) -> Iterator[str]:
    """Image paths named by `inputs`: folders searched recursively (sorted), image files, list files."""
    for name in inputs:
        if os.path.isdir(name):
            yield from _files_under(name)
        elif name.lower().endswith(LIST_SUFFIXES) and os.path.isfile(name):
            yield from _listed(name)
        elif os.path.exists(name):
            yield name
        else:
            raise FileNotFoundError(
                f"{name} does not exist; pass image files, folders of images or lists of image paths (.txt)"
            )


def _files_under(directory: str) -> Iterator[str]:
    # One folder's entries at a time: memory grows with the widest folder, not the tree.
    with os.scandir(directory) as entries:
        names = sorted((entry.name, entry.is_dir()) for entry in entries)
    for name, is_dir in names:
        path = os.path.join(directory, name)
        if is_dir:
            yield from _files_under(path)
        elif os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
            yield path


def _listed(list_file: str) -> Iterator[str]:
    root = os.path.dirname(os.path.abspath(list_file))
    with open(list_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                yield line if os.path.isabs(line) else os.path.join(root, line)


def build_file_index(inputs: Sequence[str], directory: str, *, chunk: int = 65_536) -> FileIndex:
    """Walks `inputs` and writes their index to `directory` (created); returns it, opened.

    Memory stays flat in the number of files: paths go to disk as they are
    found, `chunk` offsets at a time.

    Raises:
      FileNotFoundError: an input does not exist, or none of them holds an image.
    """
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha256()
    count, position = 0, 0
    offsets = [0]
    with (
        open(os.path.join(directory, PATHS_FILE), "wb") as paths,
        open(os.path.join(directory, OFFSETS_FILE), "wb") as offsets_file,
    ):
        for path in _walk(inputs):
            encoded = os.path.abspath(path).encode("utf-8", "surrogateescape")
            if b"\n" in encoded:
                logging.warning("skipping a path with a line break in its name: %r", path)
                continue
            paths.write(encoded)
            digest.update(encoded + b"\n")
            position += len(encoded)
            offsets.append(position)
            count += 1
            if len(offsets) >= chunk:
                offsets_file.write(np.asarray(offsets[:-1], np.int64).tobytes())
                offsets = offsets[-1:]
        offsets_file.write(np.asarray(offsets, np.int64).tobytes())
    if not count:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {', '.join(inputs)}")
    record = {"images": count, "fingerprint": digest.hexdigest(), "inputs": [os.path.abspath(i) for i in inputs]}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(record, f, indent=1)
    return FileIndex(directory)


class FileIndex:
    """Image files by position, read from a `build_file_index` directory through memory maps."""

    def __init__(self, directory: str):
        try:
            with open(os.path.join(directory, INDEX_FILE)) as f:
                record = json.load(f)
            self._offsets = np.memmap(os.path.join(directory, OFFSETS_FILE), np.int64, mode="r")
            self._paths = np.memmap(os.path.join(directory, PATHS_FILE), np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"the input index in {directory} cannot be read ({e}); delete that folder to index the inputs again"
            ) from e
        if len(self._offsets) != record["images"] + 1 or self._offsets[-1] != len(self._paths):
            raise ConfigError(
                f"the input index in {directory} is damaged; delete that folder to index the inputs again"
            )
        self.fingerprint = str(record["fingerprint"])
        self.description = f"{record['images']} image files from {', '.join(record['inputs'])}"

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def name(self, position: int) -> str:
        start, end = int(self._offsets[position]), int(self._offsets[position + 1])
        return bytes(self._paths[start:end]).decode("utf-8", "surrogateescape")

    def image_id(self, position: int) -> int:
        return int(position)

    def read(self, position: int) -> np.ndarray:
        return read_image_file(self.name(position))


class SplitImages:
    """The images of a prepared split (`input_pipeline.datasets.cache.PreparedSplit`), by record."""

    def __init__(self, split, which: str):
        self._split = split
        self._reader = split.open_reader()
        self.fingerprint = hashlib.sha256(f"{split.fingerprint}:{split.num_records}".encode()).hexdigest()
        self.description = f"the {which} split's {split.num_records} images ({split.directory})"
        self._which = which

    def __len__(self) -> int:
        return int(self._split.num_records)

    def name(self, position: int) -> str:
        return f"{self._which}:{int(self._split.image_ids[position])}"

    def image_id(self, position: int) -> int:
        return int(self._split.image_ids[position])

    def read(self, position: int) -> np.ndarray:
        serialized = self._reader.read(np.asarray([position]))[0]
        return decode_image(io.BytesIO(records.parse_numpy(serialized).image_bytes))

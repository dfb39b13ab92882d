"""Named 1-D numpy columns built chunk by chunk and read back by row range, in memory or in raw files.

Conversion handles columns with one entry per image or per annotation
(millions of rows). Kept in files, a column costs memory only for the rows
being read: the parent that parses a COCO JSON appends each chunk of rows
and drops it, and worker processes read just their images' rows. Reads copy
(np.fromfile), never map: mapped pages that were read stay in a process's
resident set until the whole mapping goes.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

_DTYPES_FILE = "columns.json"


class ColumnFiles:
    """Columns in `directory` (one raw little-endian file each), or in memory when `directory` is None.

    Attributes:
      directory: where the files are; None for in-memory columns.
    """

    def __init__(self, directory: str | None):
        self.directory = directory
        self._dtypes: dict[str, str] = {}
        self._chunks: dict[str, list[np.ndarray]] = collections.defaultdict(list)
        self._whole: dict[str, np.ndarray] = {}
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    @classmethod
    def open(cls, directory: str) -> ColumnFiles:
        """The columns that another process wrote and `save_dtypes()` described in `directory`."""
        columns = cls(directory)
        with open(os.path.join(directory, _DTYPES_FILE)) as f:
            columns._dtypes = json.load(f)
        return columns

    def save_dtypes(self) -> None:
        """Writes what open() needs to read these columns in another process."""
        with open(os.path.join(self.directory, _DTYPES_FILE), "w") as f:
            json.dump(self._dtypes, f)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.bin")

    def append(self, name: str, values: np.ndarray) -> None:
        """Adds `values` (1-D) at the end of column `name` (created by the first append)."""
        values = np.ascontiguousarray(values)
        dtype = values.dtype.newbyteorder("<").str
        if self._dtypes.setdefault(name, dtype) != dtype:
            raise ValueError(f"column {name} holds {self._dtypes[name]}, not {dtype}")
        if self.directory is None:
            self._chunks[name].append(values.astype(dtype, copy=True))
            self._whole.pop(name, None)
        else:
            with open(self._path(name), "ab") as f:
                f.write(values.astype(dtype, copy=False).tobytes())

    def replace(self, name: str, values: np.ndarray) -> None:
        """Makes `values` the whole column `name`."""
        self.delete(name)
        self.append(name, values)

    def delete(self, name: str) -> None:
        self._dtypes.pop(name, None)
        self._chunks.pop(name, None)
        self._whole.pop(name, None)
        if self.directory is not None and os.path.exists(self._path(name)):
            os.remove(self._path(name))

    def __contains__(self, name: str) -> bool:
        return name in self._dtypes

    def __len__(self) -> int:
        return len(self._dtypes)

    def length(self, name: str) -> int:
        if self.directory is None:
            return sum(len(chunk) for chunk in self._chunks[name])
        return os.path.getsize(self._path(name)) // np.dtype(self._dtypes[name]).itemsize

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of column `name` (to the end when stop is None), a new array."""
        dtype = np.dtype(self._dtypes[name])
        if self.directory is None:
            if name not in self._whole:
                chunks = self._chunks[name]
                self._whole[name] = np.concatenate(chunks) if chunks else np.zeros([0], dtype)
                self._chunks[name] = [self._whole[name]]
            return self._whole[name][start:stop].copy()
        stop = self.length(name) if stop is None else stop
        if stop <= start:
            return np.zeros([0], dtype)
        with open(self._path(name), "rb") as f:
            return np.fromfile(f, dtype, count=stop - start, offset=start * dtype.itemsize)

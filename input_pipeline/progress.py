"""Progress of long loops: a live line on terminals, periodic log lines elsewhere.

On an interactive terminal (stderr is a TTY) one status line is redrawn in
place, at most a few times a second, and log lines printed meanwhile appear
above it. Elsewhere (a log file, CI, a cluster's job output) a redrawn line
would be noise, so a plain log line is written every `log_every_s` seconds
instead (or never, where the caller logs on its own schedule).

Used by dataset conversion, training and evaluation.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

from absl import logging as absl_logging

T = TypeVar("T")
_REDRAW_EVERY_S = 0.2


def format_duration(seconds: float) -> str:
    """`1h05m` or `4m09s`."""
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class _ClearLine(logging.Filter):
    """Clears the live line before a log record is printed, so the record starts at column 0."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self._stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        self._stream.write("\r\033[K")
        return True


class Progress:
    """Reports `done` of `total` (or of an unknown total) with a rate and an ETA.

    Args:
      description: what is being done, e.g. "eval" or "converting train".
      total: the count at which the loop ends, or None when unknown.
      unit: what is counted, e.g. "batches" or "images".
      log_every_s: seconds between plain log lines when the stream is not a
        terminal; None for no log lines (the caller logs on its own).
      enabled: False on processes that should stay quiet.
      initial: units already done when this starts (a resumed run), left out of the rate.
      stream: where the live line goes (default sys.stderr).
    """

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        unit: str = "it",
        log_every_s: float | None = 30.0,
        enabled: bool = True,
        initial: int = 0,
        stream: TextIO | None = None,
    ):
        self.description, self.total, self.unit = description, total, unit
        self._initial = int(initial)  # done before this run (a resumed run): not part of the rate
        self._stream = stream or sys.stderr
        self._live = enabled and self._stream.isatty()
        self._log_every_s = log_every_s if enabled else None
        self._start = self._last_draw = self._last_log = time.perf_counter()
        self._done = self._initial
        self._filter = None
        if self._live:
            self._filter = _ClearLine(self._stream)
            absl_logging.get_absl_handler().addFilter(self._filter)

    def describe(self, **fields: Any) -> str:
        """`description done/total unit | rate | field value ... | ETA`."""
        elapsed = time.perf_counter() - self._start
        rate = (self._done - self._initial) / elapsed if elapsed > 0 else 0.0
        parts = [
            f"{self.description} {self._done}" + (f"/{self.total}" if self.total else "") + f" {self.unit}",
            f"{rate:.1f} {self.unit}/s",
        ]
        parts += [
            f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}" for name, value in fields.items()
        ]
        if self.total and rate > 0:
            parts.append(f"ETA {format_duration((self.total - self._done) / rate)}")
        return " | ".join(parts)

    def update(self, done: int, **fields: Any) -> None:
        """Records that `done` units are complete; `fields` (e.g. loss=0.53) are shown with them."""
        self._done = int(done)
        now = time.perf_counter()
        finished = self.total is not None and self._done >= self.total
        if self._live and (now - self._last_draw >= _REDRAW_EVERY_S or finished):
            self._last_draw = now
            self._stream.write("\r\033[K" + self.describe(**fields))
            self._stream.flush()
        elif (
            not self._live and self._log_every_s is not None and (now - self._last_log >= self._log_every_s or finished)
        ):
            self._last_log = now
            absl_logging.info("%s", self.describe(**fields))

    def close(self) -> None:
        """Ends the live line (the last state stays visible) and stops clearing before log lines."""
        if self._filter is not None:
            absl_logging.get_absl_handler().removeFilter(self._filter)
            self._filter = None
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def track(items: Iterable[T], description: str, total: int | None = None, **options: Any) -> Iterator[T]:
    """Yields `items`, reporting each one done (see Progress for `options`)."""
    with Progress(description, total, **options) as progress:
        for count, item in enumerate(items, start=1):
            yield item
            progress.update(count)

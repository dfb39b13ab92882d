"""One trainer per workdir: process 0 of a launch locks WORKDIR/.trainer.lock for the whole run.

Two trainers in one workdir would write their checkpoints and metrics over
each other's, and each would resume from steps the other wrote. All processes
of one launch share the workdir legitimately, so only process 0 takes the
lock, and tells the others whether it got it. The lock file sits at the top
of the workdir, beside the directories Orbax manages (checkpoints/, best/),
never inside them, so it is never taken for a step. A trainer that died, even
by SIGKILL, leaves the file but not the lock (input_pipeline.file_lock): the
next run starts at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from detector.errors import TrainingError
from input_pipeline import file_lock

LOCK_NAME = ".trainer.lock"


def lock_path(workdir: str) -> str:
    return os.path.join(workdir, LOCK_NAME)


@contextlib.contextmanager
def hold_workdir(workdir: str) -> Iterator[None]:
    """Holds `workdir` for the `with` block; every process of the launch must enter it (process 0 locks).

    Creates the workdir when missing.

    Raises:
      TrainingError: another trainer holds the workdir (on every process of the launch).
    """
    lock = file_lock.FileLock(lock_path(workdir), wait=False) if jax.process_index() == 0 else None
    found: file_lock.LockHeld | None = None
    if lock is not None:
        try:
            lock.acquire()
        except file_lock.LockHeld as e:
            found = e
    in_use = found is not None
    if jax.process_count() > 1:
        # The others stop as well, rather than wait in a collective for a process 0 that has left.
        in_use = bool(multihost_utils.broadcast_one_to_all(np.int32(in_use)))
    if in_use:
        if found is None:
            by = "another trainer (process 0's error names it)"
        else:
            by = f"the trainer {found.holder}" if found.holder else f"another trainer (see {found.path})"
        stale = ""
        if found is not None and found.path.endswith(file_lock.FALLBACK_SUFFIX):
            # A filesystem without flock: a file that a trainer on another host left cannot be judged from here.
            stale = f" (if that trainer is gone, delete {found.path})"
        raise TrainingError(f"workdir {workdir} is in use by {by}{stale}; stop it or choose another --workdir")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()

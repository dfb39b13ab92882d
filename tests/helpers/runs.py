"""Reading what a training run leaves in its workdir, and sharing one run between pytest workers."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import flax


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_steps(workdir):
    directory = workdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def flat(tree):
    return flax.traverse_util.flatten_dict(tree, sep="/")


def once_per_run(tmp_path_factory, name, produce):
    """A directory filled by `produce(directory)` once per pytest run.

    pytest-xdist (`-n 2`) may split this module's tests across workers, each
    with its own module fixtures; the workers then share one result through
    the run's common temp root instead of each paying for it.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        directory = tmp_path_factory.mktemp(name)
        produce(directory)
        return directory
    root = tmp_path_factory.getbasetemp().parent  # common to this run's workers only
    directory, complete = root / name, root / f"{name}.complete"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not complete.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            produce(directory)
            complete.touch()
    return directory

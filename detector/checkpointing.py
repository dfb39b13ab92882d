"""Orbax checkpoints of the train state under `WORKDIR/checkpoints/`.

Saves are asynchronous (training continues while the previous state is
written) and atomic (Orbax writes to a temporary directory and renames it, so
a crash never leaves a half-written step that looks complete). Restores take
an abstract target whose leaves carry the *current* mesh's shardings, so a
checkpoint written on one mesh loads onto any other.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from detector.train_state import TrainState

STATE_ITEM = "state"
METADATA_ITEM = "metadata"


def checkpoint_dir(workdir: str) -> epath.Path:
    """`WORKDIR/checkpoints`, absolute: Orbax refuses relative paths (`--workdir=runs/x`)."""
    path = epath.Path(workdir)
    if "://" not in str(workdir):  # local paths only; gs:// and friends are absolute already
        path = epath.Path(os.path.abspath(workdir))
    return path / "checkpoints"


def create_manager(workdir: str, *, max_to_keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max(1, int(max_to_keep)),
        enable_async_checkpointing=True,
        create=True,
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                                 item_names=(STATE_ITEM, METADATA_ITEM))


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, metadata: dict[str, Any]) -> bool:
    """Starts an async save of `state` at `step`; returns whether a save was started.

    `metadata` is small JSON (e.g. where the input pipeline stands) kept beside the state.
    """
    saved = manager.save(
        step,
        args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                   METADATA_ITEM: ocp.args.JsonSave(metadata)}),
        # The trainer decides when to save (its interval and the last step).
        force=True,
    )
    if saved:
        logging.info("checkpoint: saving step %d to %s", step, manager.directory)
    return saved


def restore_latest(manager: ocp.CheckpointManager,
                   abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
    """Restores the newest complete checkpoint onto `abstract_state`'s shardings, or None."""
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(
        step,
        args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                                   METADATA_ITEM: ocp.args.JsonRestore()}),
    )
    logging.info("checkpoint: restored step %d from %s", step, manager.directory)
    return restored[STATE_ITEM], dict(restored[METADATA_ITEM] or {})


def input_position(metadata: dict[str, Any], step: int, global_batch_size: int) -> int:
    """Examples of the input stream consumed by the checkpointed run (where to resume reading).

    Checkpoints record it as `input_position`; older ones only their step, which
    at a fixed global batch size means step * global_batch_size.
    """
    if "input_position" in metadata:
        return int(metadata["input_position"])
    return int(step) * int(global_batch_size)

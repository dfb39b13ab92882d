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
import re
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from detector.errors import ConfigError, TrainingError
from detector.training.train_state import TrainState, merge_params, restart_ema, select_like, select_params

STATE_ITEM = "state"
METADATA_ITEM = "metadata"
PARAMS_ITEM = "params"
EMA_ITEM = "ema_params"
BEST_METRIC = "AP"

# Orbax splits each replicated array's write among its replicas (off on GPUs
# by its own default): every replica's part is a jitted slice, compiled per
# shape and replica at a process's first save. On the tiny test models that
# was 6-11 s of a restart's first checkpoint, and for a real model's many
# small leaves (norms, biases) it buys nothing. Arrays whose part per replica
# would be smaller than this are written whole by one replica; large
# replicated arrays (data-parallel weights) are still written in parallel.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 4 << 20


def _register_array_handler() -> None:
    """Orbax's handler of jax.Array, with REPLICA_PARALLEL_MIN_SLICE_BYTES (its override warning kept quiet)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array,
            ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES),
            override=True,
        )
    finally:
        absl_logger.setLevel(level)


_register_array_handler()


def _state_item(state: TrainState) -> dict[str, Any]:
    """The state as the tree a checkpoint holds: its fields, without an EMA that is off.

    A run without EMA writes exactly the tree it always wrote, so its
    checkpoints and older ones restore alike.
    """
    item = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    if state.ema_params is not None:
        item[EMA_ITEM] = state.ema_params
    return item


def _absolute(workdir: str) -> epath.Path:
    """Orbax refuses relative paths (`--workdir=runs/x`); gs:// and friends are absolute already."""
    return epath.Path(workdir if "://" in str(workdir) else os.path.abspath(workdir))


def checkpoint_dir(workdir: str) -> epath.Path:
    """`WORKDIR/checkpoints`: the full train state, keep-last-K."""
    return _absolute(workdir) / "checkpoints"


def best_dir(workdir: str) -> epath.Path:
    """`WORKDIR/best/STEP/params`: parameters of the evaluation with the highest `config.best_metric`."""
    return _absolute(workdir) / "best"


def export_dir(workdir: str) -> epath.Path:
    """`WORKDIR/export/params`: the final parameters alone, for inference."""
    return _absolute(workdir) / "export"


def create_manager(workdir: str, *, max_to_keep: int, read_only: bool = False) -> ocp.CheckpointManager:
    """The manager of `checkpoint_dir(workdir)`; `read_only` for readers (evaluation, prediction)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max(1, int(max_to_keep)),
        enable_async_checkpointing=True,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=(STATE_ITEM, METADATA_ITEM))


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (no space, permissions, I/O); older complete ones are intact."""


def _write_cause(error: BaseException) -> str:
    """The operating system's reason in a failed write's message ("No space left on device"), else its first line."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, OSError) and candidate.errno and candidate.strerror:
            return f"{candidate.strerror} (errno {candidate.errno})"
    text = str(error)
    tensorstore = re.search(r"([A-Z][^:\"\n]*?) \[os_error_code='?(\d+)'?\]", text)  # TensorStore's form
    if tensorstore:
        return f"{tensorstore.group(1)} (errno {tensorstore.group(2)})"
    python = re.search(r"\[Errno (\d+)\] ([^:'\"\n]+)", text)  # an OSError's text inside another error
    if python:
        return f"{python.group(2).strip()} (errno {python.group(1)})"
    return _first_line(error)


# Orbax names a step being written STEP.orbax-checkpoint-tmp (older versions add -TIMESTAMP).
_PARTIAL_MARKER = ".orbax-checkpoint-tmp"
# A failed save surfaces at its first failed write while its other writes may
# still be running, and TensorStore creates the directories a write needs: a
# partial step removed at once can come back. It is removed until none has
# reappeared for this long (at most _SETTLE_LIMIT_SECONDS, on the error path only).
_QUIET_SECONDS = 2.0
_SETTLE_LIMIT_SECONDS = 60.0


def _remove_partial_steps(directory: epath.Path) -> list[str]:
    """Removes the `STEP.orbax-checkpoint-tmp` directories of failed saves; returns their steps, sorted.

    Keeps removing until no partial directory has reappeared for
    _QUIET_SECONDS, so writes of the failed save still in flight cannot leave
    one behind. Every process removes (a directory another process removed
    first is no error): on a shared filesystem each process's writes can
    recreate it.
    """
    steps: set[str] = set()
    started = quiet_since = time.monotonic()
    while True:
        partial = [path for path in directory.iterdir() if _PARTIAL_MARKER in path.name]
        now = time.monotonic()
        if partial:
            quiet_since = now
            for path in partial:
                steps.add(path.name.split(".", 1)[0])
                try:
                    path.rmtree(missing_ok=True)
                except OSError:  # a write added a file while it was removed: the next round removes it
                    pass
        if now - quiet_since >= _QUIET_SECONDS or now - started >= _SETTLE_LIMIT_SECONDS:
            return sorted(steps, key=lambda step: (len(step), step))
        time.sleep(0.05)


def _write_failure(manager: ocp.CheckpointManager, error: BaseException) -> CheckpointWriteError:
    """The one-line error of a failed save, after removing the partial step directories it left."""
    directory = epath.Path(manager.directory)
    steps = _remove_partial_steps(directory)
    names = [path.name for path in directory.iterdir()]
    left = [name for name in names if _PARTIAL_MARKER in name]
    removed = f"the partial copy could not be removed ({', '.join(left)})" if left else "the partial copy is removed"
    complete = sorted(int(name) for name in names if name.isdigit())
    newest = f"step {complete[-1]} is the newest complete checkpoint" if complete else "there is no complete checkpoint"
    return CheckpointWriteError(
        f"writing checkpoint {'/'.join(steps) or '(unknown step)'} to {directory} failed: {_write_cause(error)}; "
        f"{removed} and {newest}: fix the cause, then rerun the same command to resume from it"
    )


def finish_writes(manager: ocp.CheckpointManager) -> None:
    """Waits for the in-flight async save; a failed one raises CheckpointWriteError (see `save`)."""
    try:
        manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001  (any failure of a save is reported the same way)
        raise _write_failure(manager, error) from error


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, metadata: dict[str, Any]) -> bool:
    """Starts an async save of `state` at `step`; returns whether a save was started.

    `metadata` is small JSON (e.g. where the input pipeline stands) kept beside the state.
    A failed write (this one, or the previous async one found failed now)
    raises CheckpointWriteError after removing the partial step directory;
    Orbax removes older checkpoints only after a newer one is complete, so
    the newest complete one stays.
    """
    try:
        saved = manager.save(
            step,
            args=ocp.args.Composite(
                **{STATE_ITEM: ocp.args.StandardSave(_state_item(state)), METADATA_ITEM: ocp.args.JsonSave(metadata)}
            ),
            # The trainer decides when to save (its interval and the last step).
            force=True,
        )
    except Exception as error:  # noqa: BLE001  (this save's, or the previous async save's, failure)
        raise _write_failure(manager, error) from error
    if saved:
        logging.info("checkpoint: saving step %d to %s", step, manager.directory)
    return saved


def restore_latest(
    manager: ocp.CheckpointManager, abstract_state: TrainState
) -> tuple[TrainState, dict[str, Any]] | None:
    """Restores the newest checkpoint that restores onto `abstract_state`'s shardings, or None when there is none.

    A step that fails to restore (missing or truncated files, unreadable
    metadata) is logged with its cause, moved aside as `STEP.damaged-N` (never
    deleted, out of Orbax's step list; by process 0, the others wait) and the
    next newest is tried. Raises TrainingError listing what was tried when
    none restores, and WorkdirMismatchError (not damage) when the stored
    parameters belong to another model.
    """
    tried = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return _restore_step(manager, step, abstract_state)
        except WorkdirMismatchError:
            raise
        except Exception as error:  # noqa: BLE001  (any failure to read a step is the step's damage)
            cause = _first_line(error)
            tried.append(f"step {step}: {cause}")
            moved = _move_aside(manager, step)
            logging.warning("checkpoint of step %d does not restore (%s); moved it to %s", step, cause, moved)
    if tried:
        raise TrainingError(
            f"no checkpoint in {manager.directory} restores ({'; '.join(tried)}); the damaged steps were moved "
            "aside as STEP.damaged-N: restore them from a backup, or train in a new --workdir"
        )
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _move_aside(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    """Renames `STEP` to the first free `STEP.damaged-N` (process 0; every process waits) and reloads the manager."""
    directory = epath.Path(manager.directory)
    index = 0
    while (directory / f"{step}.damaged-{index}").exists():
        index += 1
    target = directory / f"{step}.damaged-{index}"
    if jax.process_index() == 0:
        (directory / str(step)).rename(target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
    manager.reload()
    return target


def _restore_step(
    manager: ocp.CheckpointManager, step: int, abstract_state: TrainState
) -> tuple[TrainState, dict[str, Any]]:
    check_params_match(manager, step, abstract_state.params, key=PARAMS_ITEM)
    stored = _stored_tree(manager, step)
    _check_opt_state_matches(manager, step, stored.get("opt_state"), abstract_state.opt_state)
    target = _state_item(abstract_state)
    has_ema = EMA_ITEM in stored
    if EMA_ITEM in target and not has_ema:
        # EMA turned on for a run that trained without it: it starts from the restored parameters.
        del target[EMA_ITEM]
        logging.warning("checkpoint of step %d holds no EMA of the parameters; the EMA starts from them", step)
    elif has_ema and EMA_ITEM not in target:
        # Read (the tree must match what is stored: the parameters it averaged) and dropped.
        target[EMA_ITEM] = select_like(abstract_state.params, stored[EMA_ITEM])
        logging.warning("checkpoint of step %d holds an EMA of the parameters; optimizer.ema_decay=0 drops it", step)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(target), METADATA_ITEM: ocp.args.JsonRestore()}
        ),
    )
    logging.info("checkpoint: restored step %d from %s", step, manager.directory)
    item = dict(restored[STATE_ITEM])
    state = TrainState(
        step=item["step"],
        params=item[PARAMS_ITEM],
        opt_state=item["opt_state"],
        ema_params=item.get(EMA_ITEM, abstract_state.ema_params) if abstract_state.ema_params is not None else None,
    )
    if abstract_state.ema_params is not None and not has_ema:
        state = restart_ema(state)
    return state, dict(restored[METADATA_ITEM] or {})


def _check_opt_state_matches(manager: ocp.CheckpointManager, step: int, stored: Any, requested: Any) -> None:
    """Raises WorkdirMismatchError when the stored optimizer state has another number of arrays than the config's.

    Another optimizer, or another `model.backbone.training` (which decides
    the parameters that have state), is a config change, not damage.
    """
    stored_count = len(jax.tree.leaves(stored)) if stored is not None else 0
    requested_count = len(jax.tree.leaves(requested))
    if stored_count != requested_count:
        raise WorkdirMismatchError(
            f"the checkpoint of step {step} in {manager.directory} holds optimizer state of {stored_count} arrays and "
            f"this config's optimizer has {requested_count}: it was trained with another optimizer or "
            "model.backbone.training; train in a new --workdir, or start one from this one's parameters with "
            f"--config.init_from={epath.Path(manager.directory).parent}"
        )


class _NoEmaError(FileNotFoundError):
    """The checkpoint was trained without the EMA the reader asks for (a config choice, not damage)."""


class WorkdirMismatchError(ConfigError):
    """A workdir's checkpoint holds parameters of another model than the config describes."""


def _stored_tree(manager: ocp.CheckpointManager, step: int) -> Any:
    """The state tree stored at `step` as nested dicts of array metadata (shape, dtype); no array is read."""
    metadata = ocp.StandardCheckpointer().metadata(epath.Path(manager.directory) / str(step) / STATE_ITEM)
    return metadata.item_metadata.tree


def parameter_differences(stored_params: Any, requested_params: Any) -> list[tuple[str, Any, Any]]:
    """(path, stored shape or None, requested shape or None) of every parameter that differs, in path order.

    Both trees are nested dicts whose leaves have `.shape` (array metadata,
    ShapeDtypeStructs or arrays); paths are '/'-joined.
    """
    stored = traverse_util.flatten_dict(stored_params, sep="/") if isinstance(stored_params, dict) else {}
    requested = traverse_util.flatten_dict(requested_params, sep="/")
    differences = []
    for path in sorted(set(stored) | set(requested)):
        stored_shape = tuple(stored[path].shape) if path in stored else None
        requested_shape = tuple(requested[path].shape) if path in requested else None
        if stored_shape != requested_shape:
            differences.append((path, stored_shape, requested_shape))
    return differences


def check_params_match(manager: ocp.CheckpointManager, step: int, requested_params: Any, *, key: str) -> None:
    """Raises WorkdirMismatchError, in one line, when the parameters stored at `step` differ from the config's.

    `key`: the state tree's parameter entry to compare ("params" or "ema_params").
    """
    tree = _stored_tree(manager, step)
    stored = tree.get(key) if isinstance(tree, dict) else None
    differences = parameter_differences(stored, requested_params)
    if not differences:
        return
    path, stored_shape, requested_shape = differences[0]

    def described(shape):
        return "absent" if shape is None else str(shape)

    total = len(traverse_util.flatten_dict(requested_params, sep="/"))
    raise WorkdirMismatchError(
        f"the checkpoint of step {step} in {manager.directory} was trained with another model: {path} is "
        f"{described(stored_shape)} there and {described(requested_shape)} in this config ({len(differences)} "
        f"parameters differ, of {total}); train in a new --workdir, or start a new --workdir from this one's "
        f"matching parameters with --config.init_from={epath.Path(manager.directory).parent}"
    )


def restore_params(workdir: str, which: str, abstract_params: Any, *, ema: bool = False) -> tuple[Any, int]:
    """(parameters, step) of a trained workdir, placed by `abstract_params`' shardings.

    `which`: "last" (the newest checkpoint), "best" (the best evaluation's
    parameters: the EMA ones in a run that kept an EMA), or a step number of
    a kept checkpoint. With `ema`, a checkpoint's EMA of the parameters is
    read instead of the parameters (the parameters themselves where the EMA
    holds none: those that did not train). Only those are read, not the
    optimizer state. Raises FileNotFoundError naming what is there instead.
    """
    which = str(which).strip().lower()
    directory = best_dir(workdir) if which == "best" else checkpoint_dir(workdir)
    if not directory.exists():
        raise FileNotFoundError(
            f"{directory} does not exist: train first (python -m detector.train) or check --workdir"
        )
    if which == "best":
        manager = create_best_manager(workdir)
        step = manager.best_step()
        item = PARAMS_ITEM
    else:
        manager = create_manager(workdir, max_to_keep=1, read_only=True)
        steps = manager.all_steps()
        if which == "last":
            step = manager.latest_step()
        elif which.isdigit() and int(which) in steps:
            step = int(which)
        else:
            manager.close()
            raise FileNotFoundError(
                f"--checkpoint={which}: no such checkpoint in {checkpoint_dir(workdir)} (steps there: "
                f"{', '.join(map(str, steps)) or 'none'}); use last, best or one of those steps"
            )
        item = STATE_ITEM

    def read(step):
        target = abstract_params
        if which != "best":
            stored = _stored_tree(manager, step)
            if ema and EMA_ITEM not in stored:
                raise _NoEmaError(
                    f"the checkpoint of step {step} in {directory} holds no EMA of the parameters (trained with "
                    "optimizer.ema_decay=0); pass --raw_params, or --config.optimizer.ema_decay=0"
                )
            check_params_match(manager, step, abstract_params, key=PARAMS_ITEM)
            # The EMA covers the trained parameters (a frozen backbone has none): the rest are the parameters.
            averaged = select_like(abstract_params, stored[EMA_ITEM]) if ema else {}
            averaged_paths = set(traverse_util.flatten_dict(averaged))
            rest = select_params(abstract_params, lambda path: path not in averaged_paths)
            target = {key: tree for key, tree in ((PARAMS_ITEM, rest), (EMA_ITEM, averaged)) if tree}
        # The full train state holds the optimizer state too; read the parameters alone.
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    item: ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True,
                    )
                }
            ),
        )[item]
        if which == "best":
            return restored
        return merge_params(restored.get(PARAMS_ITEM, {}), restored.get(EMA_ITEM, {}))

    try:
        if step is None:
            raise FileNotFoundError(
                f"no complete checkpoint in {directory}; train first (python -m detector.train) or check --workdir"
            )
        if which != "last":
            restored = read(step)
        else:
            # As training resumes: past a damaged newest step to the next newest
            # (left in place: readers do not change a workdir).
            tried = []
            for candidate in sorted(manager.all_steps(), reverse=True):
                try:
                    restored, step = read(candidate), candidate
                    break
                except (WorkdirMismatchError, _NoEmaError):
                    raise
                except Exception as error:  # noqa: BLE001  (any failure to read a step is the step's damage)
                    tried.append(f"step {candidate}: {_first_line(error)}")
                    logging.warning(
                        "checkpoint of step %d does not restore (%s); trying an older one", candidate, tried[-1]
                    )
            else:
                raise TrainingError(
                    f"no checkpoint in {directory} restores ({'; '.join(tried)}); train in a new --workdir"
                )
    finally:
        manager.close()
    return restored, int(step)


def load_matching_params(workdir: str, params: Any) -> tuple[Any, int, list[tuple[str, Any, Any]]]:
    """`params` with every parameter whose path and shape match taken from `workdir`'s newest checkpoint.

    For fine-tuning a changed model from a trained run (`config.init_from`):
    the rest keeps its values in `params` (their initialisation). Returns
    (parameters placed like `params`, the step read, the differences left as
    they were: (path, stored shape or None, requested shape or None)).
    """
    directory = checkpoint_dir(workdir)
    if not directory.exists():
        raise FileNotFoundError(f"config.init_from={workdir}: {directory} does not exist; name a trained workdir")
    manager = create_manager(workdir, max_to_keep=1, read_only=True)
    try:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"config.init_from={workdir}: no complete checkpoint in {directory}")
        stored = _stored_tree(manager, step).get(PARAMS_ITEM, {})
        differences = parameter_differences(stored, params)
        differing = {path for path, _, _ in differences}
        flat = traverse_util.flatten_dict(params, sep="/")
        target = traverse_util.unflatten_dict(
            {
                tuple(path.split("/")): jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
                for path, leaf in flat.items()
                if path not in differing
            }
        )
        item = {PARAMS_ITEM: target}
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.PyTreeRestore(
                        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
                    )
                }
            ),
        )[STATE_ITEM][PARAMS_ITEM]
    finally:
        manager.close()
    loaded = traverse_util.flatten_dict(restored, sep="/")
    merged = {tuple(path.split("/")): loaded.get(path, leaf) for path, leaf in flat.items()}
    return traverse_util.unflatten_dict(merged), int(step), differences


def input_position(metadata: dict[str, Any], step: int, global_batch_size: int) -> int:
    """Examples of the input stream consumed by the checkpointed run (where to resume reading).

    Checkpoints record it as `input_position`; older ones only their step, which
    at a fixed global batch size means step * global_batch_size.
    """
    if "input_position" in metadata:
        return int(metadata["input_position"])
    return int(step) * int(global_batch_size)


def create_best_manager(workdir: str) -> ocp.CheckpointManager:
    """Keeps the parameters of the single best evaluation (highest `config.best_metric`) under `best_dir`."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1,
        best_fn=lambda metrics: metrics[BEST_METRIC],
        best_mode="max",
        keep_checkpoints_without_metrics=False,
        enable_async_checkpointing=False,
        create=True,
    )
    return ocp.CheckpointManager(best_dir(workdir), options=options, item_names=(PARAMS_ITEM,))


def save_if_best(manager: ocp.CheckpointManager, step: int, params: Any, ap: float) -> None:
    """Offers `params` evaluated at `step` with COCO `ap`; Orbax keeps only the best one.

    Every process must call this with the same `ap` (checkpointing is collective).
    A run resumed from before an evaluation it already made evaluates that
    step again: the new parameters and AP replace the old ones.
    """
    if step in manager.all_steps():
        manager.delete(step)
    manager.save(
        step,
        args=ocp.args.Composite(**{PARAMS_ITEM: ocp.args.StandardSave(params)}),
        metrics={BEST_METRIC: float(ap)},
        force=True,
    )


def restore_best(workdir: str) -> tuple[int, Any] | None:
    """(step, parameters as numpy arrays) of the best evaluation saved in `workdir`, or None."""
    manager = create_best_manager(workdir)
    try:
        step = manager.best_step()
        if step is None:
            return None
        restored = manager.restore(step, args=ocp.args.Composite(**{PARAMS_ITEM: ocp.args.StandardRestore()}))
        return step, restored[PARAMS_ITEM]
    finally:
        manager.close()


def export_params(workdir: str, params: Any) -> epath.Path:
    """Writes the parameters alone to `export_dir(workdir)/params` (replacing an older export); returns the path.

    Load for inference with `orbax.checkpoint.StandardCheckpointer().restore(path)` (numpy
    arrays), or with a target tree to place them on devices.
    """
    path = export_dir(workdir) / PARAMS_ITEM
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    logging.info("exported parameters to %s", path)
    return path

import threading

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from detector.training import checkpointing
from detector.training.train_state import TrainState


def make_state(value: float, step: int = 0, *, ema: bool = False) -> TrainState:
    params = {"w": jnp.full((2, 3), value)}
    return TrainState(
        step=jnp.int32(step),
        params=params,
        opt_state={"momentum": jnp.zeros((2, 3))},
        ema_params={"w": jnp.full((2, 3), -value)} if ema else None,
    )


def test_relative_workdir_saves_and_restores(tmp_path, monkeypatch):
    # The README's command uses --workdir=runs/default; Orbax needs absolute paths.
    monkeypatch.chdir(tmp_path)
    manager = checkpointing.create_manager("runs/relative", max_to_keep=2)
    state = make_state(1.5, step=3)
    assert checkpointing.save(manager, 3, state, {"step": 3})
    manager.wait_until_finished()
    assert (tmp_path / "runs" / "relative" / "checkpoints" / "3").is_dir()
    restored, metadata = checkpointing.restore_latest(manager, state)
    np.testing.assert_array_equal(restored.params["w"], state.params["w"])
    assert metadata == {"step": 3}
    manager.close()


def test_keeps_the_last_k(tmp_path):
    manager = checkpointing.create_manager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        checkpointing.save(manager, step, make_state(float(step), step), {"step": step})
        manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
    restored, _ = checkpointing.restore_latest(manager, make_state(0.0))
    np.testing.assert_array_equal(restored.params["w"], np.full((2, 3), 3.0))
    manager.close()


def test_keeps_only_the_best_evaluation(tmp_path):
    manager = checkpointing.create_best_manager(str(tmp_path))
    offers = {1: 0.30, 2: 0.52, 3: 0.41, 4: 0.12}  # step -> AP; step 2 is the best, not the last
    for step, ap in offers.items():
        checkpointing.save_if_best(manager, step, {"w": jnp.full((3,), float(step))}, ap)
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
    manager.close()
    step, restored = checkpointing.restore_best(str(tmp_path))
    assert step == 2
    np.testing.assert_array_equal(restored["w"], [2.0, 2.0, 2.0])
    assert checkpointing.restore_best(str(tmp_path / "elsewhere")) is None


def test_export_params_writes_params_alone(tmp_path):
    import orbax.checkpoint as ocp

    params = {"dense": {"kernel": np.arange(6.0).reshape(2, 3), "bias": np.zeros(3)}}
    path = checkpointing.export_params(str(tmp_path), params)
    assert path == checkpointing.export_dir(str(tmp_path)) / "params"
    checkpointing.export_params(str(tmp_path), {"dense": {"kernel": np.ones((2, 3)), "bias": np.ones(3)}})  # replaces
    restored = ocp.StandardCheckpointer().restore(path)
    np.testing.assert_array_equal(restored["dense"]["kernel"], np.ones((2, 3)))
    assert set(restored) == {"dense"}  # no optimizer state, no step: parameters only


def test_the_ema_is_checkpointed_only_when_kept_and_follows_a_config_change(tmp_path):
    import orbax.checkpoint as ocp

    manager = checkpointing.create_manager(str(tmp_path / "plain"), max_to_keep=2)
    checkpointing.save(manager, 1, make_state(2.0, 1), {"step": 1})
    manager.wait_until_finished()
    # Without an EMA the stored tree is the one runs have always written.
    stored = ocp.StandardCheckpointer().metadata(tmp_path / "plain" / "checkpoints" / "1" / "state")
    assert set(stored.item_metadata.tree) == {"step", "params", "opt_state"}
    # EMA turned on for that run: it starts from the restored parameters.
    restored, _ = checkpointing.restore_latest(manager, make_state(0.0, ema=True))
    np.testing.assert_array_equal(restored.ema_params["w"], np.full((2, 3), 2.0))
    manager.close()

    manager = checkpointing.create_manager(str(tmp_path / "ema"), max_to_keep=2)
    checkpointing.save(manager, 1, make_state(2.0, 1, ema=True), {"step": 1})
    manager.wait_until_finished()
    restored, _ = checkpointing.restore_latest(manager, make_state(0.0, ema=True))
    np.testing.assert_array_equal(restored.ema_params["w"], np.full((2, 3), -2.0))
    np.testing.assert_array_equal(restored.params["w"], np.full((2, 3), 2.0))
    # EMA turned off: the stored average is read and dropped, and saving works after restoring.
    restored, _ = checkpointing.restore_latest(manager, make_state(0.0))
    assert restored.ema_params is None
    checkpointing.save(manager, 2, restored, {"step": 2})
    manager.wait_until_finished()
    manager.close()


def test_reading_the_ema_of_a_run_that_kept_none_is_one_clear_error(tmp_path):
    import pytest

    manager = checkpointing.create_manager(str(tmp_path), max_to_keep=2)
    checkpointing.save(manager, 3, make_state(1.0, 3), {"step": 3})
    manager.wait_until_finished()
    manager.close()
    abstract = {
        "w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    }
    params, step = checkpointing.restore_params(str(tmp_path), "last", abstract)
    assert step == 3
    np.testing.assert_array_equal(params["w"], np.full((2, 3), 1.0))
    with pytest.raises(FileNotFoundError, match="step 3 .* holds no EMA of the parameters .* pass --raw_params"):
        checkpointing.restore_params(str(tmp_path), "last", abstract, ema=True)


def test_a_partial_step_that_a_straggling_write_recreates_is_removed_too(tmp_path):
    # A failed save is reported at its first failed write while others still
    # run, and TensorStore recreates the directories a write needs.
    directory = tmp_path / "checkpoints"
    (directory / "2").mkdir(parents=True)
    (directory / "4.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    straggler = threading.Timer(0.5, lambda: (directory / "4.orbax-checkpoint-tmp" / "state" / "d").mkdir(parents=True))
    straggler.start()
    try:
        steps = checkpointing._remove_partial_steps(epath.Path(directory))
    finally:
        straggler.join()
    assert steps == ["4"]
    assert sorted(path.name for path in directory.iterdir()) == ["2"]


def test_saving_small_replicated_arrays_compiles_no_program(tmp_path):
    """Orbax's replica-parallel save slices every replicated array with a program compiled per shape and replica
    (6-11 s of a restart's first checkpoint on the tiny models); small arrays are written whole instead."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = make_state(1.0, step=1)
    state = state.replace(params={**state.params, **{f"b{n}": jnp.ones((n + 8,)) for n in range(4)}})
    state = jax.device_put(state, replicated)
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    manager = checkpointing.create_manager(str(tmp_path), max_to_keep=1)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert checkpointing.save(manager, 1, state, {"step": 1})
        manager.wait_until_finished()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    manager.close()
    assert compiles == []
    reader = checkpointing.create_manager(str(tmp_path), max_to_keep=1, read_only=True)
    restored, _ = checkpointing.restore_latest(reader, state)
    reader.close()
    np.testing.assert_array_equal(restored.params["b3"], np.ones(11))

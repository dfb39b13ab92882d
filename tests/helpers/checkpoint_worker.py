"""Restores a workdir's newest checkpoint onto a mesh, as one process of a run.

Launched by tests/integration/test_fault_tolerance.py.

usage: python -m tests.helpers.checkpoint_worker CONFIG_JSON SRC_WORKDIR DATA,FSDP,MODEL OUT_NPZ [DST_WORKDIR]
       [--coordinator_address=... --num_processes=N --process_id=I]

Restores the newest checkpoint of SRC_WORKDIR with the trainer's own code onto
this run's devices and the given mesh. Process 0 writes every leaf of the
restored state, gathered from all processes, to OUT_NPZ (keys `params/...`,
`opt_state/I` in leaf order, `ema_params/...` when the run keeps an EMA,
`step`), plus `partitioned`, the number of parameters split over more than
one device. With DST_WORKDIR, every process takes part in
saving the restored state there, as the trainer saves.
"""

import json

import flax
import jax
import ml_collections
import numpy as np
from absl import app
from jax.experimental import multihost_utils

import sharding
from detector.training import checkpointing
from sharding import distributed
from tests.helpers.sharded_training import abstract_state_on_mesh

distributed.define_flags()


def main(argv):
    config_json, src, mesh_shape, out = argv[1:5]
    dst = argv[5] if len(argv) > 5 else None
    distributed.initialize(distributed.options_from_flags())
    config = ml_collections.ConfigDict(json.loads(open(config_json).read()))
    data, fsdp, model_axis = map(int, mesh_shape.split(","))
    mesh = sharding.create_mesh(dict(data=data, fsdp=fsdp, model=model_axis))
    abstract_state = abstract_state_on_mesh(config, mesh)

    manager = checkpointing.create_manager(src, max_to_keep=config.keep_checkpoints)
    state, metadata = checkpointing.restore_latest(manager, abstract_state)
    manager.close()
    for restored, wanted in zip(jax.tree.leaves(state), jax.tree.leaves(abstract_state)):
        assert restored.sharding == wanted.sharding, (restored.sharding, wanted.sharding)  # resharded on load
    partitioned = sum(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.params))

    host_state = multihost_utils.process_allgather(state, tiled=True)  # collective: every process
    if jax.process_index() == 0:
        arrays = {"step": np.asarray(host_state.step), "partitioned": np.int64(partitioned)}
        arrays.update(
            {
                f"params/{k}": np.asarray(v)
                for k, v in flax.traverse_util.flatten_dict(host_state.params, sep="/").items()
            }
        )
        arrays.update({f"opt_state/{i}": np.asarray(v) for i, v in enumerate(jax.tree.leaves(host_state.opt_state))})
        if host_state.ema_params is not None:
            arrays.update(
                {
                    f"ema_params/{k}": np.asarray(v)
                    for k, v in flax.traverse_util.flatten_dict(host_state.ema_params, sep="/").items()
                }
            )
        np.savez(out, **arrays)
    if dst is not None:
        manager = checkpointing.create_manager(dst, max_to_keep=config.keep_checkpoints)
        checkpointing.save(manager, int(host_state.step), state, metadata)
        manager.wait_until_finished()
        manager.close()
    multihost_utils.sync_global_devices("checkpoint worker done")


if __name__ == "__main__":
    app.run(main)

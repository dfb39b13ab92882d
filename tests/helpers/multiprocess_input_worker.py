"""One process of a multi-process input-pipeline run (launched by tests/integration/test_multiprocess_input.py).

usage: python -m tests.helpers.multiprocess_input_worker CONFIG_JSON PORT NUM_PROCESSES PROCESS_ID OUT_NPZ

Joins the others over 127.0.0.1 (gloo CPU collectives), builds the trainer's
mesh and batch sharding, reads its rows of the training stream and assembles
global batches exactly as the trainer does; process 0 writes what the global
arrays hold: the first STEPS batches of a fresh stream, and the batch read
after resuming at position RESUME_STEP * global_batch_size.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

STEPS, RESUME_STEP = 3, 2
KEYS = ("image_id", "image", "boxes", "labels", "boxes_mask")


def main(config_json, port, num_processes, process_id, out):
    import input_pipeline  # noqa: E402
    import sharding  # noqa: E402
    from sharding import distributed  # noqa: E402

    # As the trainer joins: explicit flags, gloo collectives on CPU.
    assert distributed.initialize(
        distributed.DistributedOptions(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=int(num_processes),
            process_id=int(process_id),
            initialization_timeout_s=120,
        )
    )

    config = ml_collections.ConfigDict(json.loads(open(config_json).read()))
    mesh = sharding.create_mesh(dict(data=-1, fsdp=1, model=1))
    axes = sharding.batch_axes(mesh)
    first_row = input_pipeline.process_rows(sharding.batch_sharding(mesh, axes), config.global_batch_size)

    def global_view(local_batch):
        batch = input_pipeline.to_global_batch(local_batch, mesh, axes)
        return {k: np.asarray(multihost_utils.process_allgather(batch[k], tiled=True)) for k in KEYS}

    fresh = input_pipeline.create_train_iterator(config, first_row=first_row)
    batches = [global_view(next(fresh)) for _ in range(STEPS)]
    resumed_iter = input_pipeline.create_train_iterator(
        config, start_position=RESUME_STEP * config.global_batch_size, first_row=first_row
    )
    resumed = global_view(next(resumed_iter))
    first_rows = np.asarray(multihost_utils.process_allgather(np.int32(first_row)))  # every process takes part
    if jax.process_index() == 0:
        arrays = {f"step{t}_{k}": v for t, b in enumerate(batches) for k, v in b.items()}
        arrays.update({f"resumed_{k}": v for k, v in resumed.items()})
        arrays["first_rows"] = first_rows
        np.savez(out, **arrays)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

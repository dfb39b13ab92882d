"""One process of a multi-process preparation of a COCO-format folder (tests/integration/test_multiprocess_prepare.py).

usage: python -m tests.helpers.multiprocess_prepare_worker CONFIG_JSON PORT NUM_PROCESSES PROCESS_ID

Joins the others over 127.0.0.1 (gloo CPU collectives) as the trainer does,
prepares the train split as training would (every process converts a share),
and prints the split it then opens as one JSON line.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_collections  # noqa: E402


def main(config_json, port, num_processes, process_id):
    import jax

    import input_pipeline
    from sharding import distributed

    assert distributed.initialize(
        distributed.DistributedOptions(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=int(num_processes),
            process_id=int(process_id),
            initialization_timeout_s=120,
        )
    )
    config = ml_collections.ConfigDict(json.loads(open(config_json).read()))
    split = input_pipeline.prepare_split(config, "train")
    # Host data for process 0 alone, larger than one piece of the key-value store.
    payload = bytes([int(process_id) + 1]) * (9 * 2**20 + 7)
    received = distributed.send_to_primary("test/payload", payload)
    sent = [[len(p), sorted(set(p))] for p in received] if received is not None else None
    print(
        json.dumps(
            {"directory": split.directory, "records": split.num_records, "shards": len(split.shard_paths), "sent": sent}
        )
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

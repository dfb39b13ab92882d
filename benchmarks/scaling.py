"""What each parallelism choice costs: per-device memory, collective bytes and step time, on 1-8 devices.

  python -m benchmarks.scaling                                  # configs/default.py, 8 fake CPU devices
  python -m benchmarks.scaling --config=configs/retinanet_r50_coco.py \
      --config.input.image_size="(256,256)" --config.global_batch_size=8 --steps=2

For 1, 2, 4 and 8 devices and three mesh shapes - data only (n,1,1), FSDP
(1,n,1) and tensor/spatial model parallelism (1,1,n) - the config's train
step is compiled on the first n devices at a fixed global batch (strong
scaling) and reports, per device: parameter + optimizer-state bytes, XLA's
total memory for the step, the bytes that all-reduce, all-gather,
reduce-scatter, all-to-all and collective-permute move per step (read from
the compiled HLO), and the measured step time.

On a CPU host, `--devices` fake devices share the host's cores, so step
times compare configurations rather than predict accelerator speed; memory
and collective bytes are what each accelerator would hold and move.
"""

from __future__ import annotations

import gc

from absl import app, flags
from ml_collections import config_flags

from benchmarks import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "Fake CPU devices to create on a CPU host (0: the machine's devices).")
_DEVICE_COUNTS = flags.DEFINE_list("device_counts", ["1", "2", "4", "8"], "Mesh sizes to measure.")
_SHAPES = flags.DEFINE_list("shapes", ["data", "fsdp", "model"], "Which axis gets the devices.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per mesh (after one warm-up step).")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 4, "Classes of the detection head.")

_AXES = ("data", "fsdp", "model")


def mesh_shapes(device_counts, shapes) -> list[tuple[int, int, int]]:
    """(data, fsdp, model) sizes to measure, without repeating the single-device mesh."""
    meshes = []
    for count in device_counts:
        for shape in shapes:
            sizes = tuple(count if axis == shape else 1 for axis in _AXES)
            if sizes not in meshes:
                meshes.append(sizes)
    return meshes


def main(argv: list[str]) -> None:
    del argv
    from detector import cli

    if _DEVICES.value > 0:
        cli.use_fake_cpu_devices(_DEVICES.value)  # before JAX starts its backend, below
    import jax

    from benchmarks import jax_step
    from sharding.collectives import COLLECTIVE_KINDS

    config = _CONFIG.value
    unknown = [s for s in _SHAPES.value if s not in _AXES]
    if unknown:
        raise app.UsageError(f"--shapes={','.join(unknown)}: use data, fsdp or model")
    device_counts = [int(n) for n in _DEVICE_COUNTS.value]
    if max(device_counts) > jax.device_count():
        raise app.UsageError(
            f"--device_counts asks for {max(device_counts)} devices but {jax.device_count()} "
            "exist; on a CPU host pass --devices=N"
        )
    rows = []
    for sizes in mesh_shapes(device_counts, _SHAPES.value):
        count = sizes[0] * sizes[1] * sizes[2]
        config.mesh.update(dict(zip(_AXES, sizes)))
        step = jax_step.build(config, _NUM_CLASSES.value, devices=jax.devices()[:count])
        step.run(1)
        seconds = step.run(_STEPS.value)
        plan = step.plan
        moved = plan.collective_summary
        rows.append(
            (
                ",".join(map(str, sizes)),
                count,
                config.global_batch_size // (sizes[0] * sizes[1]),
                (plan.params_bytes + plan.opt_state_bytes) / 2**20,
                plan.total_bytes / 2**20,
                *(moved[kind].bytes / 2**20 for kind in COLLECTIVE_KINDS),
                sum(moved[kind].bytes for kind in COLLECTIVE_KINDS) / 2**20,
                1000 * seconds,
                config.global_batch_size / seconds,
            )
        )
        print(f"mesh {sizes}: {1000 * seconds:.0f} ms/step", flush=True)
        del step
        gc.collect()
    height, width = config.input.image_size
    report.emit(
        "scaling",
        f"Train step on 1-{max(device_counts)} devices: per-device memory, collective MiB per step, step time "
        f"(global batch {config.global_batch_size}, image {height}x{width}, model.dtype={config.model.dtype})",
        [
            "mesh (data,fsdp,model)",
            "devices",
            "per-device batch",
            "params+opt MiB/device",
            "step MiB/device",
            *(f"{kind} MiB" for kind in COLLECTIVE_KINDS),
            "collectives MiB/device",
            "step ms",
            "images/s",
        ],
        rows,
    )


if __name__ == "__main__":
    from detector import cli

    cli.use_cpu_xla_flags()
    app.run(main)

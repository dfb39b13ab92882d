"""Train-step speed and per-device memory of a config, for several mesh shapes.

  python benchmarks/train_step.py --config=configs/default.py --devices=8 \
      --meshes=8,1,1 --meshes=2,2,2 --steps=10

Prints a markdown table: mesh, per-device batch, compile time, step time,
images/s, per-device memory (XLA's memory_analysis) and GFLOP per step
(cost_analysis). Fake CPU devices stand in for accelerators when --devices
is given on a CPU machine; step times then only compare configurations.
Inputs are random, so the input pipeline is not measured (see
input_pipeline benchmarks for that).
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 0, "Fake CPU devices to create (0: the machine's devices).")
_MESHES = flags.DEFINE_multi_string("meshes", ["-1,1,1"], "data,fsdp,model sizes; repeat for several.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per mesh (after 2 warm-up steps).")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 4, "Classes of the detection head.")


def _configure_devices(argv: list[str]) -> None:
    # Must happen before JAX initialises its backend, so it reads argv itself.
    from detector import cli

    for arg in argv:
        if arg.startswith("--devices=") and int(arg.split("=", 1)[1]) > 0:
            cli.use_fake_cpu_devices(int(arg.split("=", 1)[1]))


def main(argv: list[str]) -> None:
    del argv
    import time

    import flax.linen as nn
    import jax
    import numpy as np

    import sharding
    from detector import optim, steps
    from detector.retinanet import create_model
    from detector.steps import compile_train_step
    from detector.train_state import init_train_state
    from sharding import memory

    config = _CONFIG.value
    height, width = config.input.image_size
    rows = []
    for mesh_arg in _MESHES.value:
        data, fsdp, model_axis = (int(v) for v in mesh_arg.split(","))
        config.mesh.update(dict(data=data, fsdp=fsdp, model=model_axis))
        mesh = sharding.create_mesh(config.mesh)
        rules = sharding.logical_rules(config.sharding)
        per_device_batch = sharding.check_global_batch(config.global_batch_size, mesh)
        model = create_model(config.model, _NUM_CLASSES.value, steps.num_anchors_per_location(config))
        tx, schedule = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
        batch_sharding = sharding.batch_sharding(mesh, sharding.batch_axes(mesh))
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            start = time.perf_counter()
            compiled, _, shardings = compile_train_step(config, model, tx, schedule, num_classes=_NUM_CLASSES.value,
                                                        mesh=mesh, rules=rules)
            compile_s = time.perf_counter() - start
            state = init_train_state(model, tx, (height, width), shardings, jax.random.key(0))
        batch = _random_batch(config, np.random.default_rng(0))
        batch = jax.device_put(batch, batch_sharding)
        for _ in range(2):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(_STEPS.value):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - start) / _STEPS.value
        report = memory.memory_report(compiled)
        flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
        rows.append((f"{data},{fsdp},{model_axis}", dict(mesh.shape), per_device_batch, compile_s, step_s,
                     config.global_batch_size / step_s,
                     report.total_bytes / 2**20 if report else float("nan"), flops / 1e9))

    print(f"\n{jax.device_count()} {jax.devices()[0].platform} devices, global batch "
          f"{config.global_batch_size}, image {height}x{width}\n")
    print("| mesh (data,fsdp,model) | per-device batch | compile s | step ms | images/s "
          "| per-device MiB | GFLOP/step/device |")
    print("|---|---|---|---|---|---|---|")
    for arg, _, pdb, compile_s, step_s, ips, mib, gflop in rows:
        print(f"| {arg} | {pdb} | {compile_s:.1f} | {1000 * step_s:.0f} | {ips:.1f} | {mib:.1f} | {gflop:.2f} |")


def _random_batch(config, rng):
    import numpy as np

    b = config.global_batch_size
    height, width = config.input.image_size
    m = config.input.max_boxes
    boxes = np.zeros((b, m, 4), np.float32)
    num_objects = min(4, m)
    size = min(height, width) / 4
    boxes[:, :num_objects] = [size, size, 2.5 * size, 3 * size]
    mask = np.arange(m)[None].repeat(b, 0) < num_objects
    return {
        "image": rng.normal(size=(b, height, width, 3)).astype(np.float32),
        "boxes": boxes,
        "labels": np.where(mask, 1, -1).astype(np.int32),
        "boxes_mask": mask,
        "image_id": np.arange(b, dtype=np.int32),
        "scale": np.ones(b, np.float32),
        "original_size": np.full((b, 2), (height, width), np.int32),
        "example_mask": np.ones(b, bool),
    }


if __name__ == "__main__":
    _configure_devices(sys.argv)
    from detector import cli

    cli.use_fast_cpu_convolutions()
    app.run(main)

"""Plan a run before launching it: per-device memory, FLOPs and communication of the train step.

    python -m detector.plan --config=configs/vitdet_h_coco.py --devices=64 \
        [--config.mesh.model=8] [--device_memory_gb=80] [--json=OUT]

Compiles the config's train step ahead of time for `--devices` fake CPU
devices (nothing is allocated or run) and prints, per device: parameter,
optimizer-state, gradient and batch bytes, XLA's temporaries (activations
and gradients among them) and total, FLOPs per step,
and the bytes each collective kind moves per step (parsed from the compiled
HLO). It says whether the step fits `--device_memory_gb` and, when the
configured mesh does not, compiles larger fsdp/model splits until one fits
and names it. The trainer runs the same accounting on its real devices and
refuses a step that will not fit before the first step.

Numbers come from XLA's CPU compiler, with convolutions built as
accelerators run them (XLA's own, not the matmul kernel gradient a CPU
training run uses: `layers.accelerator_convolutions`). GPU compilers
schedule and fuse differently, so treat the totals as estimates within tens
of percent; the ratios between meshes are what the CPU plan measures well.
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from detector import cli, compilation_cache
from detector.errors import ConfigError
from sharding import MeshError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/X.py).", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "Target number of devices (simulated on the CPU).", lower_bound=1)
_DEVICE_MEMORY_GB = flags.DEFINE_float("device_memory_gb", 80.0, "Memory per device, in GB (10^9 bytes).")
_SEARCH = flags.DEFINE_bool("search", True, "When the configured mesh does not fit, search fsdp/model splits.")
_MAX_MODEL = flags.DEFINE_integer("max_model", 8, "Largest `model` axis the search tries (devices per host).")
_MAX_CANDIDATES = flags.DEFINE_integer("max_candidates", 8, "Most splits the search compiles.", lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Also write the plans as JSON to this path.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    # Checked before minutes of compiling, not after.
    if _JSON.value and not os.path.isdir(os.path.dirname(os.path.abspath(_JSON.value))):
        raise FileNotFoundError(f"--json={_JSON.value}: its directory does not exist; create it or pick another path")
    cli.use_fake_cpu_devices(_DEVICES.value)
    import jax

    if len(jax.devices()) != _DEVICES.value:
        raise MeshError(
            f"JAX started with {len(jax.devices())} devices before the plan could ask for "
            f"{_DEVICES.value}; run the plan as its own process"
        )
    # Planning the same config again (another --device_memory_gb, a later
    # search) loads the compiled steps instead of compiling them again.
    compilation_cache.use_compilation_cache(cli.COMPILATION_CACHE_DIR.value)
    from detector.models.layers import accelerator_convolutions
    from detector.training.train_compile import print_plan

    with accelerator_convolutions():
        print_plan(
            _CONFIG.value,
            config_path=flags.FLAGS["config"].config_filename,
            devices=_DEVICES.value,
            device_memory_gb=_DEVICE_MEMORY_GB.value,
            search=_SEARCH.value,
            max_model=_MAX_MODEL.value,
            max_candidates=_MAX_CANDIDATES.value,
            json_path=_JSON.value,
        )


if __name__ == "__main__":
    cli.run(main, runs_programs=False)

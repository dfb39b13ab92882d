"""Benchmark output: a markdown table on stdout and the same rows as JSON, with the machine they ran on."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "benchmark_results", "Directory for the JSON copy of the table (NAME.json)."
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(versions: dict[str, str] | None = None) -> dict[str, Any]:
    """Where the numbers come from: host CPU and cores, accelerators, library versions (plus `versions`)."""
    import jax

    described = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    described.update(versions or {})
    return described


def _cell(value: Any) -> str:
    """A float to 3 significant digits (whole numbers from 100 up, NaN as n/a); anything else as str()."""
    if isinstance(value, float):
        return "n/a" if value != value else (f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}")
    return str(value)


def emit(
    name: str,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    extra: dict[str, Any] | None = None,
    versions: dict[str, str] | None = None,
) -> str:
    """Prints `title` and the table; writes `--output_dir/NAME.json`. Returns the JSON path."""
    described = machine(versions)
    print(f"\n{title}\n")
    print(
        f"machine: {described['cpu']}, {described['cpu_cores']} cores; devices: {described['devices']}; "
        f"jax {described['jax']}" + (f", torch {described['torch']}" if "torch" in described else "") + "\n"
    )
    # Imported here, as jax in machine(): vs_torchvision's torch worker imports this module and must not load
    # sharding's JAX and Flax.
    from sharding.tables import markdown_table

    print(markdown_table(columns, [[_cell(v) for v in row] for row in rows]), flush=True)
    os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
    path = os.path.join(_OUTPUT_DIR.value, f"{name}.json")
    record = {
        "benchmark": name,
        "title": title,
        "command": " ".join([os.path.basename(sys.executable), "-m", f"benchmarks.{name}", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": described,
        "columns": list(columns),
        "rows": [dict(zip(columns, row)) for row in rows],
        **(extra or {}),
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(f"\nwrote {path}")
    return path

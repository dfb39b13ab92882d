"""Pieces of the train step: micro-batches for gradient accumulation, the EMA update, their config checks."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from configs import default
from detector.errors import ConfigError
from detector.training import steps


def test_micro_batches_interleave_rows_so_each_device_keeps_its_share():
    batch = {"image_id": jnp.arange(8), "boxes": jnp.arange(8 * 2 * 4).reshape(8, 2, 4)}
    micro = steps.split_micro_batches(batch, 4)
    np.testing.assert_array_equal(micro["image_id"], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert micro["boxes"].shape == (4, 2, 2, 4)
    np.testing.assert_array_equal(micro["boxes"][1, 1], batch["boxes"][5])
    # Devices holding rows 0-3 and 4-7 (two batch shards) each hold one row of every micro-batch.
    for k in range(4):
        assert {int(i) // 4 for i in micro["image_id"][k]} == {0, 1}


def test_ema_follows_the_parameters_with_a_warm_up_of_the_decay():
    ema, params = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
    # Update 0: min(0.999, 1 / 10) = 0.1 of the old average is kept.
    np.testing.assert_allclose(
        steps.ema_update(ema, params, jnp.int32(0), decay=0.999, warmup=True)["w"], 0.9, rtol=1e-6
    )
    # Late, the decay itself: 0.999 kept.
    late = steps.ema_update(ema, params, jnp.int32(10**6), decay=0.999, warmup=True)["w"]
    np.testing.assert_allclose(late, 0.001, rtol=1e-4)  # 1 - 0.999 in float32
    np.testing.assert_allclose(
        steps.ema_update(ema, params, jnp.int32(0), decay=0.9, warmup=False)["w"], 0.1, rtol=1e-6
    )


def test_accumulate_steps_must_split_the_batch_evenly_over_the_devices():
    config = default.get_config()
    mesh = sharding.create_mesh(dict(data=4, fsdp=1, model=2), devices=jax.devices()[:8])
    config.global_batch_size = 16
    config.optimizer.accumulate_steps = 4
    assert steps.check_accumulate_steps(config, mesh) == 4
    config.optimizer.accumulate_steps = 8  # 16 / 8 = 2 rows per micro-batch, 4 batch shards
    with pytest.raises(ConfigError, match=r"accumulate_steps=8: global_batch_size=16 must be a multiple of .* = 32"):
        steps.check_accumulate_steps(config, mesh)
    config.optimizer.accumulate_steps = 0
    with pytest.raises(ConfigError, match="accumulate_steps=0; use a whole number >= 1"):
        steps.check_accumulate_steps(config, mesh)


def test_ema_decay_must_be_below_one():
    config = default.get_config()
    config.optimizer.ema_decay = 1.0
    with pytest.raises(ConfigError, match=r"ema_decay=1.0; use 0 \(off\) or a decay in \(0, 1\)"):
        steps.ema_decay_of(config.optimizer)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; malloc_trim is glibc's")
def test_release_freed_heap_returns_freed_memory_to_the_os():
    """What the compiler leaves freed in the heap stops counting as resident (measured: ~210 of 213 MB)."""

    def resident_bytes():
        return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

    # Freed heap that earlier tests left resident would hold the blocks below without growing the process.
    steps.release_freed_heap()
    base = resident_bytes()
    blocks = [bytes(range(256)) * 4 + bytes(i % 7) for i in range(200_000)]  # ~1 KB each: malloc's heap, not mmap
    sentinel = bytes(range(256)) * 4 + b"x"  # allocated last, so the freed blocks are not at the heap's top
    del blocks
    freed_but_resident = resident_bytes()
    steps.release_freed_heap()
    assert freed_but_resident - base > 150e6
    assert freed_but_resident - resident_bytes() > 100e6
    del sentinel

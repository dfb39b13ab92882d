"""A full disk while saving: one error line, the partial step removed, the complete ones kept, a prompt exit.

On a real 3 MB tmpfs (root can mount one; elsewhere the test is skipped),
the tiny config checkpointing every 2 steps fills it after a few saves.
"""

from __future__ import annotations

import contextlib
import re
import subprocess

import pytest

from tests.integration.test_workdir_mismatch import run_command

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]


@contextlib.contextmanager
def mounted_tmpfs(mount_point, size: str):
    """A real tmpfs of `size` (mount's notation: 3m, 256k) at `mount_point`; skips where none can be mounted."""
    mount_point.mkdir()
    # huge=never: where the kernel makes tmpfs use 2 MB huge pages by
    # default, every small file takes 2 MB and the first save fills the disk.
    for options in (f"size={size},huge=never", f"size={size}"):
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True
        )
        if mounted.returncode == 0:
            break
    else:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        probe = mount_point / "probe"
        probe.write_bytes(b"x" * 4096)
        allocated = probe.stat().st_blocks * 512
        probe.unlink()
        if allocated > 64 * 1024:
            pytest.skip(f"this kernel forces huge pages on tmpfs: a 4 KB file takes {allocated} bytes")
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "3m") as mount_point:
        yield mount_point


def test_a_full_disk_stops_with_one_line_and_keeps_the_complete_checkpoints(small_disk, data_dir):
    workdir = small_disk / "run"
    result = run_command(
        "detector.train", workdir, data_dir, total_steps=40, checkpoint_every_steps=2, eval_every_steps=100
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "No space left on device (errno 28)" in errors[0], errors
    assert "rerun the same command to resume" in errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]

    names = sorted((workdir / "checkpoints").iterdir())
    assert not [path for path in names if "tmp" in path.name], names  # the partial step is gone
    complete = sorted(int(path.name) for path in names if path.name.isdigit())
    failed = int(re.search(r"writing checkpoint (\d+)", errors[0]).group(1))
    assert complete and max(complete) < failed, (complete, failed)
    assert f"step {max(complete)} is the newest complete checkpoint" in errors[0]


def test_a_full_disk_while_generating_the_embedded_dataset_is_one_line_and_leaves_nothing(tmp_path):
    """The quickstart's command with its data directory on a 256 KB disk: the embedded dataset (about 1 MB at
    this size) cannot be generated there; TFDS's partial copy is removed."""
    with mounted_tmpfs(tmp_path / "small", "256k") as disk:
        result = run_command("detector.train", tmp_path / "run", disk / "data")
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-3000:]
        assert errors[0].startswith("error: cannot generate the embedded dataset synthetic_shapes/"), errors
        assert f"in {disk / 'data'} (No space left on device)" in errors[0], errors
        assert "point --config.dataset.data_dir (or $DETECTOR_DATA_DIR) at a larger disk" in errors[0]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        left = [str(path.relative_to(disk)) for path in disk.rglob("*") if "incomplete" in path.name]
        assert not left, left

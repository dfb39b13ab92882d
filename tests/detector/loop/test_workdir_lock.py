"""One trainer per workdir: a real second `python -m detector.train` on a held workdir, and a SIGKILLed holder.

The first holder is a small process that takes the workdir the way the
trainer does (`workdir_lock.hold_workdir`, which `train_and_evaluate` enters
before it writes anything), so the test pays for one trainer start-up only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from detector.errors import TrainingError
from detector.loop import workdir_lock
from tests.helpers import REPO_ROOT, quick_xla_flags
from tests.helpers.processes import free_port
from tests.helpers.tiny_config import as_flags

HOLDER = """
import sys
from detector.loop import workdir_lock
with workdir_lock.hold_workdir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def command_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}


def start_holder(workdir) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(workdir)],
        cwd=REPO_ROOT,
        env=command_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n", "the holder did not take the workdir"
    return holder


def train_command(workdir, data_dir) -> list[str]:
    return [
        sys.executable,
        "-m",
        "detector.train",
        "--config=configs/default.py",
        f"--workdir={workdir}",
        *as_flags(data_dir),
    ]


def lock_file_holder(workdir) -> dict:
    """What the last holder wrote into the workdir's lock file: host, pid, since, command."""
    with open(workdir_lock.lock_path(str(workdir))) as f:
        return json.loads(f.read())


@pytest.mark.slow  # a real detector.train process: ~5 s
def test_a_second_trainer_on_a_held_workdir_stops_with_one_error_line_naming_the_holder(tmp_path):
    workdir = tmp_path / "run"
    holder = start_holder(workdir)
    try:
        second = subprocess.run(
            train_command(workdir, tmp_path / "data"),
            cwd=REPO_ROOT,
            env=command_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 1, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert errors[0].startswith(
            f"error: workdir {workdir} is in use by the trainer pid {holder.pid} on host {socket.gethostname()} (since "
        ), errors[0]
        assert errors[0].endswith("; stop it or choose another --workdir"), errors[0]
        assert "Traceback" not in second.stderr, second.stderr[-3000:]
        # It stopped before writing anything, and the holder runs on, holding the workdir.
        assert sorted(os.listdir(workdir)) == [workdir_lock.LOCK_NAME]
        assert holder.poll() is None
        assert lock_file_holder(workdir)["pid"] == holder.pid
        with pytest.raises(TrainingError, match=f"in use by the trainer pid {holder.pid} "):
            with workdir_lock.hold_workdir(str(workdir)):
                pass
    finally:
        holder.stdin.close()
    assert holder.wait(timeout=60) == 0


def test_a_workdir_held_by_a_trainer_killed_with_sigkill_is_free_at_once(tmp_path):
    workdir = tmp_path / "run"
    holder = start_holder(workdir)
    holder.kill()
    assert holder.wait(timeout=60) == -signal.SIGKILL
    assert lock_file_holder(workdir)["pid"] == holder.pid  # the file stays, naming the dead trainer
    with workdir_lock.hold_workdir(str(workdir)):  # does not wait: a held workdir raises TrainingError at once
        assert lock_file_holder(workdir)["pid"] == os.getpid()


@pytest.mark.slow  # two trainers joining over 127.0.0.1: ~15 s
@pytest.mark.multiprocess
def test_every_process_of_a_launch_stops_when_process_0_finds_the_workdir_held(tmp_path):
    workdir = tmp_path / "run"
    holder = start_holder(workdir)
    address = f"127.0.0.1:{free_port()}"
    env = {**command_env(), "XLA_FLAGS": quick_xla_flags(devices=2)}
    try:
        launch = [
            subprocess.Popen(
                train_command(workdir, tmp_path / "data")
                + [f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        stderrs = [process.communicate(timeout=300)[1] for process in launch]
        assert [process.returncode for process in launch] == [1, 1], stderrs[0][-3000:] + stderrs[1][-3000:]
        errors = [[line for line in stderr.splitlines() if line.startswith("error:")] for stderr in stderrs]
        assert errors[0] == [
            f"error: workdir {workdir} is in use by the trainer pid {holder.pid} on host {socket.gethostname()} "
            f"(since {lock_file_holder(workdir)['since']}); "
            "stop it or choose another --workdir"
        ], stderrs[0][-3000:]
        # Process 1 does not wait in a collective for a process 0 that has left: it stops with it.
        assert errors[1] == [
            f"error: workdir {workdir} is in use by another trainer (process 0's error names it); "
            "stop it or choose another --workdir"
        ], stderrs[1][-3000:]
        assert not any("Traceback" in stderr for stderr in stderrs), stderrs[0][-3000:] + stderrs[1][-3000:]
        assert holder.poll() is None
    finally:
        holder.stdin.close()
    assert holder.wait(timeout=60) == 0

"""Joining processes: flag validation, cluster detection, the local launcher, and a dead peer."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sharding import distributed
from sharding.distributed import DistributedError, DistributedOptions
from tests.helpers import REPO_ROOT, quick_xla_flags
from tests.helpers.processes import free_port

pytestmark = pytest.mark.multiprocess

LAUNCHER = REPO_ROOT / "scripts" / "launch_local.sh"


@pytest.mark.parametrize(
    "options, message",
    [
        (DistributedOptions(coordinator_address="10.0.0.1:1234"), "go together"),
        (DistributedOptions(num_processes=2, process_id=0), "go together"),
        (DistributedOptions("10.0.0.1:1234", num_processes=2, process_id=2), r"--process_id=2 must be in 0\.\.1"),
        (DistributedOptions("10.0.0.1", num_processes=2, process_id=0), "needs a port"),
    ],
)
def test_inconsistent_flags_are_one_line_errors(options, message):
    with pytest.raises(DistributedError, match=message) as error:
        distributed.initialize(options, environ={})
    assert "\n" not in str(error.value)


def test_cluster_detection():
    assert distributed.detected_cluster({}) is None
    assert distributed.detected_cluster({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}) is None  # one task: one process
    assert distributed.detected_cluster({"SLURM_NTASKS": "16"}) == "slurm"
    assert distributed.detected_cluster({"OMPI_COMM_WORLD_SIZE": "4"}) == "open_mpi"
    assert distributed.detected_cluster({"JOBSET_NAME": "train"}) == "kubernetes"
    assert not distributed.initialize(DistributedOptions(), environ={})  # a single process joins nothing


def _env():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("XLA_FLAGS", None)  # the launcher gives each process its own fake devices
    return env


def test_local_launcher_joins_processes():
    result = subprocess.run(
        [str(LAUNCHER), "2", "3", "--", sys.executable, "-m", "sharding.distributed"],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        assert f"[{i}] process {i} of 2: 3 local of 6 devices (cpu); a collective reached 2 processes" in result.stdout


def test_local_launcher_reports_a_failing_process():
    result = subprocess.run(
        [str(LAUNCHER), "2", "--", sys.executable, "-c", "import sys; sys.exit(3)"],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3


PEER = textwrap.dedent("""
    import os, sys, time
    import jax
    from jax.experimental import multihost_utils
    from sharding import distributed
    distributed.initialize(distributed.DistributedOptions(
        coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]), heartbeat_timeout_s=10))
    multihost_utils.sync_global_devices("joined")
    print("joined", flush=True)
    if jax.process_index() == 1:
        os._exit(9)  # dies without a word, like a killed host
    multihost_utils.sync_global_devices("never reached")  # the survivor waits for the dead peer
    print("survivor passed the barrier", flush=True)
""")


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_a_dead_peer_stops_the_survivor_within_a_minute(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    env = {**_env(), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": quick_xla_flags(devices=2)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PEER, address, str(i)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        # The minute runs from the peer's death, not from starting Python and
        # JAX, which a busy machine can take half a minute for.
        joined = []
        for line in procs[0].stdout:
            joined.append(line)
            if line.strip() == "joined":
                break
        start = time.monotonic()
        survivor_output, _ = procs[0].communicate(timeout=90)
        survivor_output = "".join(joined) + survivor_output
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - start
    assert procs[0].returncode != 0, survivor_output[-2000:]
    assert "survivor passed the barrier" not in survivor_output
    assert elapsed < 60, f"survivor took {elapsed:.0f}s to stop"


SIGTERM_REPORTER = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM received", flush=True), sys.exit(0)))
    print("ready", flush=True)
    time.sleep(60)
""")


def test_local_launcher_passes_sigterm_to_every_process_and_waits_for_them():
    """A scheduler's SIGTERM to the launcher reaches each process, whose own exit status (0 here) is the result."""
    launcher = subprocess.Popen(
        [str(LAUNCHER), "2", "--", sys.executable, "-c", SIGTERM_REPORTER],
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = [launcher.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["[0] ready\n", "[1] ready\n"]
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, output
    assert sorted(output.splitlines()) == ["[0] SIGTERM received", "[1] SIGTERM received"]

"""The file lock against real holders: other processes that hold it, let go, or are killed with SIGKILL.

Every test runs with flock and with the exclusive-create fallback that
filesystems without flock get.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from input_pipeline import file_lock
from tests.helpers import REPO_ROOT

# Takes the lock, says so, and lets go when a line arrives on stdin.
HOLDER = """
import sys
from input_pipeline import file_lock
lock = file_lock.FileLock(sys.argv[1], wait=False, use_flock=sys.argv[2] == "flock").acquire()
print("held", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""

MECHANISMS = ["flock", "exclusive_create"]
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def start_holder(path, mechanism: str) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), mechanism],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n", "the holder did not take the lock"
    return holder


def let_go(holder: subprocess.Popen) -> None:
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline() == "released\n"
    assert holder.wait(timeout=30) == 0


def lock(path, mechanism: str, **options) -> file_lock.FileLock:
    return file_lock.FileLock(path, use_flock=mechanism == "flock", **options)


def written_holder(path, mechanism: str) -> file_lock.Holder:
    written = path if mechanism == "flock" else f"{path}{file_lock.FALLBACK_SUFFIX}"
    with open(written) as f:
        return file_lock.Holder.parse(f.read())


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_held_lock_names_its_holder_and_is_free_once_released(tmp_path, mechanism):
    path = tmp_path / "missing_parent" / "thing.lock"
    holder = start_holder(path, mechanism)
    try:
        with pytest.raises(file_lock.LockHeld) as raised:
            lock(path, mechanism, wait=False).acquire()
        found = raised.value.holder
        assert (found.pid, found.host) == (holder.pid, socket.gethostname())
        assert ISO_UTC.match(found.since), found.since
        assert "from input_pipeline import file_lock" in found.command
        assert f"pid {holder.pid} on host {socket.gethostname()} (since {found.since})" in str(raised.value)
    finally:
        let_go(holder)
    with lock(path, mechanism, wait=False) as mine:
        assert mine.held
        assert written_holder(path, mechanism).pid == os.getpid()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_lock_of_a_holder_killed_with_sigkill_does_not_block(tmp_path, mechanism):
    path = tmp_path / "thing.lock"
    holder = start_holder(path, mechanism)
    holder.kill()  # SIGKILL: no cleanup runs in the holder
    assert holder.wait(timeout=30) == -signal.SIGKILL
    assert written_holder(path, mechanism).pid == holder.pid  # its lock file stays behind

    with lock(path, mechanism, wait=False):  # raises LockHeld if the dead holder still counted
        assert written_holder(path, mechanism).pid == os.getpid()
    if mechanism == "flock":
        assert path.exists()  # never deleted (see file_lock's docstring)
    else:
        assert not os.path.exists(f"{path}{file_lock.FALLBACK_SUFFIX}")  # the fallback's file goes on release


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_waiter_logs_whom_it_waits_for_and_gets_the_lock_when_released(tmp_path, mechanism, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "thing.lock"
    holder = start_holder(path, mechanism)
    releaser = threading.Thread(target=let_go, args=(holder,))

    class ReleaseOnceLogged(logging.Handler):
        def emit(self, record):
            if "waiting for" in record.getMessage() and releaser.ident is None:
                releaser.start()

    watcher = ReleaseOnceLogged()
    logging.getLogger().addHandler(watcher)
    try:
        waiter = lock(path, mechanism, wait=True, timeout_s=60, log_every_s=0.1, description="building the thing")
        with waiter:
            assert written_holder(path, mechanism).pid == os.getpid()
    finally:
        logging.getLogger().removeHandler(watcher)
        if releaser.ident is None:
            holder.kill()
        else:
            releaser.join()
    assert holder.wait(timeout=30) == 0  # it let go because the waiter had logged
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waits, "the waiter logged nothing"
    assert f"waiting for pid {holder.pid} on host {socket.gethostname()} (since " in waits[0]
    assert "(building the thing)" in waits[0] and "from input_pipeline import file_lock" in waits[0]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_wait_that_times_out_names_the_holder(tmp_path, mechanism):
    path = tmp_path / "thing.lock"
    holder = start_holder(path, mechanism)
    try:
        with pytest.raises(file_lock.LockHeld) as raised:
            lock(path, mechanism, wait=True, timeout_s=0.5).acquire()
        assert raised.value.holder.pid == holder.pid
    finally:
        let_go(holder)

"""Local processes standing in for hosts: started as a cluster starts them, their output read as it comes."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import threading
import time

import pytest

from tests.helpers import REPO_ROOT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, cache_dir: pathlib.Path) -> dict[str, str]:
    """This test process's environment with `devices` fake CPU devices and the shared compilation cache."""
    xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(xla_flags + [f"--xla_force_host_platform_device_count={devices}"]),
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


class Process:
    """A subprocess whose output is read as it comes, so a test can act when a given line appears."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.command = command
        self.popen = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        """Blocks until a line matches `pattern`; fails if the process ends or the time runs out first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self.lines[seen:]:
                    if match := re.search(pattern, line):
                        return match
                seen = len(self.lines)
                if not self._reader.is_alive() or time.monotonic() > deadline:
                    self.popen.kill()
                    pytest.fail(f"no line matched {pattern!r} (exit code {self.popen.poll()}):\n{self.output[-4000:]}")
                self._new_line.wait(timeout=1.0)

    def finish(self, timeout: float = 300) -> int:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"still running after {timeout}s:\n{self.output[-4000:]}")
        self._reader.join(timeout=10)
        return self.popen.returncode

    def kill(self, signum: int) -> None:
        self.popen.send_signal(signum)


def start_processes(command: list[str], num_processes: int, devices: int, cache_dir) -> list[Process]:
    """`num_processes` processes of `command` joined over 127.0.0.1, as scripts/launch_local.sh starts them."""
    if num_processes == 1:
        return [Process(command, process_env(devices, cache_dir))]
    address = f"127.0.0.1:{free_port()}"
    return [
        Process(
            command + [f"--coordinator_address={address}", f"--num_processes={num_processes}", f"--process_id={i}"],
            process_env(devices, cache_dir),
        )
        for i in range(num_processes)
    ]

"""Side by side with another framework: each side trains in its own worker process, timed in alternating runs.

Both workers are started once (compiling and warm-up are not timed) and then
answer `run N` lines on stdin with the mean seconds per step of N steps and
their process's peak resident memory so far. The parent alternates which
worker goes first every repeat, so both see the same machine state. Workers
speak JSON lines on stdout; their logs go to stderr.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def precision(flag_value: str) -> str:
    """A `--precision` flag's value, with "auto" resolved: bfloat16 on a GPU, float32 elsewhere."""
    if flag_value != "auto":
        return flag_value
    import jax

    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def send(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def serve(run_steps: Callable[[int], float], ready: dict) -> None:
    """A worker's loop: announces `ready`, then answers `run N` with seconds per step and peak RSS until `quit`."""
    send({"ready": True, **ready})
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["run"]:
            seconds = run_steps(int(command[1]))
            send({"seconds_per_step": seconds, "peak_rss_bytes": peak_rss_bytes()})
        elif command[:1] == ["quit"]:
            return


def torch_steps(train_step: Callable[[], None], device) -> Callable[[int], float]:
    """`run_steps(N)`: N calls of a PyTorch `train_step`, the mean seconds per step (a GPU waited for)."""
    import torch

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_steps(num_steps: int) -> float:
        synchronize()
        start = time.perf_counter()
        for _ in range(num_steps):
            train_step()
        synchronize()
        return (time.perf_counter() - start) / max(num_steps, 1)

    return run_steps


class WorkerFailed(RuntimeError):
    """A worker process ended before answering (its own log, on stderr, says why)."""


class Worker:
    """`python -m MODULE --worker=FRAMEWORK ARGS...`, driven line by line."""

    def __init__(self, module: str, framework: str, args: Sequence[str]):
        self.framework = framework
        command = [sys.executable, "-m", module, f"--worker={framework}", *args]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.peak_rss_bytes = 0
        self.ready = self._receive()

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise WorkerFailed(
                f"the {self.framework} worker exited with status {self.process.wait()} (its log is above)"
            )
        return json.loads(line)

    def run(self, num_steps: int) -> float:
        self.process.stdin.write(f"run {num_steps}\n")
        self.process.stdin.flush()
        reply = self._receive()
        self.peak_rss_bytes = max(self.peak_rss_bytes, reply["peak_rss_bytes"])
        return reply["seconds_per_step"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait()


def alternate(workers: Sequence[Worker], repeats: int, steps: int, label: str, batch_size: int) -> dict[str, list]:
    """Seconds per step of each worker's `repeats` timed runs of `steps` steps, the order swapped every repeat."""
    times: dict[str, list] = {worker.framework: [] for worker in workers}
    for repeat in range(repeats):
        order = workers if repeat % 2 == 0 else list(reversed(workers))
        for worker in order:
            seconds = worker.run(steps)
            times[worker.framework].append(seconds)
            print(f"{label}, run {repeat + 1}: {worker.framework} {batch_size / seconds:.3f} images/s", flush=True)
    return times

"""Stopping on SIGTERM or SIGINT: every process saves one checkpoint at an agreed step, then exits 0.

Schedulers (SLURM, Kubernetes, spot VMs) announce an eviction with SIGTERM a
grace period before they kill the job. The trainer asks `stop_requested`
after every step and before every evaluation batch; once it says yes, every
process abandons a running evaluation, saves the checkpoint of the current
step and returns, so a restart continues from there. Checking between
evaluation batches matters: an evaluation can outlast the grace period.

Several processes must agree on the step, or they would save different ones
(or one would wait forever in the save's collectives). JAX's preemption sync
service, which `jax.distributed.initialize` starts, does that: it catches
SIGTERM on any host and gives every host the same stop step (the furthest
step any host has reached, plus one). SIGINT (Ctrl-C) is forwarded to it as
SIGTERM. The service counts calls, not steps: every process asks at the same
points in the same order (after each step, before each evaluation batch), so
the count names the same point everywhere. A single process has nobody to
agree with, so its handler only records the signal and the next question is
answered yes.

A second Ctrl-C aborts at once (KeyboardInterrupt), without the checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils


class PreemptionWatch:
    """Installs the signal handlers for the duration of a `with` block.

    Every process must call `stop_requested()` at the same points of its run,
    in the same order (the sync service's protocol).
    """

    def __init__(self):
        self._multi_process = jax.process_count() > 1
        self._sync_service = self._multi_process and bool(jax.config.jax_enable_preemption_service)
        self.received: str | None = None  # name of the first signal, e.g. "SIGTERM"
        self._interrupts = 0
        self._sync_points = 0
        self._stopping = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is not threading.main_thread():
            logging.warning("not on the main thread: SIGTERM and SIGINT will stop training without a checkpoint")
            return self
        if self._multi_process and not self._sync_service:
            logging.warning(
                "jax_enable_preemption_service is off: SIGTERM and SIGINT will stop training without a checkpoint"
            )
        elif self._multi_process:
            # SIGTERM belongs to JAX's preemption notifier (installed by jax.distributed.initialize).
            self._install(signal.SIGINT, self._forward_interrupt)
        else:
            self._install(signal.SIGTERM, self._record)
            self._install(signal.SIGINT, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def stop_requested(self) -> bool:
        """Whether to stop here (with a checkpoint of the current step); once yes, always yes.

        The same answer on every process, provided all ask at the same points.
        """
        if not self._stopping:
            self._sync_points += 1
            if self._multi_process:
                self._stopping = self._sync_service and multihost_utils.reached_preemption_sync_point(self._sync_points)
            else:
                self._stopping = self.received is not None
        return self._stopping

    def _install(self, signum: int, handler) -> None:
        self._previous[signum] = signal.signal(signum, handler)

    def _count_interrupt(self, signum: int) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt("second interrupt: stopped without saving a checkpoint")
        if self.received is None:
            self.received = signal.Signals(signum).name
            logging.warning(
                "%s received: stopping after this step or evaluation batch, with a checkpoint "
                "(press Ctrl-C again to abort without one)",
                self.received,
            )

    def _record(self, signum: int, frame) -> None:
        self._count_interrupt(signum)

    def _forward_interrupt(self, signum: int, frame) -> None:
        self._count_interrupt(signum)
        os.kill(os.getpid(), signal.SIGTERM)

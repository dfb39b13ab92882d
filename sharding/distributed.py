"""Joining the processes of a multi-host run: `jax.distributed.initialize` from flags or the cluster.

Three ways to start, in this order:
  * explicit: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`
    on every process (all three or none);
  * a cluster JAX recognises (SLURM with more than one task, Open MPI,
    Kubernetes/GKE and Cloud TPU environments): `initialize()` with no
    arguments lets JAX read the environment;
  * otherwise a single process: nothing to join.

A dead peer must not leave the others hanging in a collective: the
coordination service declares a process dead after `heartbeat_timeout_s`
without a heartbeat, and the survivors then stop with an error.

  python -m sharding.distributed [flags]   # joins, then prints what each process sees
"""

from __future__ import annotations

import dataclasses
import os

import jax

DEFAULT_HEARTBEAT_TIMEOUT_S = 30
DEFAULT_INITIALIZATION_TIMEOUT_S = 300
# send_to_primary's largest single value in the key-value store.
_PIECE_BYTES = 4 << 20


class DistributedError(ValueError):
    """The multi-process settings are inconsistent; the message says how to fix them."""


class PeerLost(DistributedError):
    """Another process of the launch is gone (killed, crashed, its host lost) and this one cannot go on.

    The command reports it in one line and exits at once: JAX's own shutdown
    would wait for the dead process and then abort with a stack trace.
    """


# What a collective (gloo's TCP pairs) or the coordination service says when the process at the other end is gone.
_PEER_FAILURE_MARKERS = (
    "Gloo",
    "Connection reset by peer",
    "Connection closed by peer",
    "Socket closed",
    "heartbeat timeout",
    "UNAVAILABLE",
)


def lost_peer(error: BaseException) -> bool:
    """Whether `error`, raised by a collective of a multi-process run, means that another process is gone."""
    return jax.process_count() > 1 and any(marker in str(error) for marker in _PEER_FAILURE_MARKERS)


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """How this process joins the others.

    Attributes:
      coordinator_address: HOST:PORT of process 0's coordination service, or None.
      num_processes: processes in the run, or None.
      process_id: this process's index 0..num_processes-1, or None.
      heartbeat_timeout_s: seconds without a heartbeat after which a peer counts as dead.
      initialization_timeout_s: seconds to wait for every process to join.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S

    def explicit(self) -> bool:
        """Whether the flags name the run; raises DistributedError when only some of them are given."""
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise DistributedError(
                "--coordinator_address, --num_processes and --process_id go together: pass all three on every "
                "process (e.g. --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0), or none "
                "to let a cluster (SLURM, Open MPI, Kubernetes) be detected"
            )
        if not all(given):
            return False
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"--process_id={self.process_id} must be in 0..{self.num_processes - 1} "
                f"for --num_processes={self.num_processes}"
            )
        if ":" not in self.coordinator_address:
            raise DistributedError(
                f"--coordinator_address={self.coordinator_address} needs a port: HOST:PORT, e.g. 10.0.0.1:1234"
            )
        return True


def detected_cluster(environ=None) -> str | None:
    """The multi-process cluster this process runs in, as JAX would detect it, or None.

    Only launchers that start several processes count: a one-task SLURM
    allocation is a single process.
    """
    environ = os.environ if environ is None else environ

    def more_than_one(name):
        try:
            return int(environ.get(name, "1")) > 1
        except ValueError:
            return False

    if more_than_one("SLURM_NTASKS") or more_than_one("SLURM_STEP_NUM_TASKS"):
        return "slurm"
    if more_than_one("OMPI_COMM_WORLD_SIZE"):
        return "open_mpi"
    if environ.get("JOBSET_NAME") or environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "kubernetes"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "environment"
    return None


def initialize(options: DistributedOptions, environ=None) -> bool:
    """Joins the other processes if this is a multi-process run; returns whether it joined.

    Must run before anything touches JAX's devices.
    """
    explicit = options.explicit()
    cluster = None if explicit else detected_cluster(environ)
    if not explicit and cluster is None:
        return False
    if (os.environ.get("JAX_PLATFORMS") or "").startswith("cpu"):
        # CPU processes (tests, the local launcher) exchange collectives over gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(
        heartbeat_timeout_seconds=int(options.heartbeat_timeout_s),
        initialization_timeout=int(options.initialization_timeout_s),
    )
    if explicit:
        kwargs.update(
            coordinator_address=options.coordinator_address,
            num_processes=int(options.num_processes),
            process_id=int(options.process_id),
        )
    jax.distributed.initialize(**kwargs)
    return True


def send_to_primary(key: str, payload: bytes, *, timeout_s: float = 600.0) -> list[bytes] | None:
    """Collects every process's `payload` on process 0 only, without a collective on the devices.

    Host data that only process 0 needs (an evaluation's detections) goes
    through the coordination service's key-value store, which JAX itself uses
    to share compiled programs between processes: the other processes put
    their bytes and go on at once; process 0 blocks until each has arrived
    (so it can do this off the training thread) and deletes them. `key` must
    be unique per exchange and the same on every process.

    Returns:
      On process 0 the payloads of processes 0..P-1 in order; None elsewhere.
    Raises:
      DistributedError: a process's payload did not arrive within `timeout_s`.
    """
    if jax.process_count() == 1:
        return [payload]
    from jax._src import distributed as jax_distributed  # the client JAX's own compilation cache shares through

    client = jax_distributed.global_state.client
    if jax.process_index() != 0:
        # In pieces: a process's share of a large evaluation is tens of MB, more
        # than one message of the coordination service should carry.
        pieces = [payload[i : i + _PIECE_BYTES] for i in range(0, len(payload), _PIECE_BYTES)] or [b""]
        name = f"detector/{key}/{jax.process_index()}"
        for index, piece in enumerate(pieces):
            client.key_value_set_bytes(f"{name}/{index}", piece)
        client.key_value_set_bytes(f"{name}/count", str(len(pieces)).encode())
        return None
    received = [payload]
    for process in range(1, jax.process_count()):
        name = f"detector/{key}/{process}"
        try:
            count = int(client.blocking_key_value_get_bytes(f"{name}/count", int(timeout_s * 1000)))
            pieces = [client.blocking_key_value_get_bytes(f"{name}/{i}", int(timeout_s * 1000)) for i in range(count)]
        except Exception as e:  # noqa: BLE001  the client raises XlaRuntimeError subclasses
            raise DistributedError(
                f"process {process} did not send {key!r} within {timeout_s:.0f}s ({str(e).splitlines()[0][:200]}); "
                "it may have died: see its log"
            ) from e
        for index in range(count):
            client.key_value_delete(f"{name}/{index}")
        client.key_value_delete(f"{name}/count")
        received.append(b"".join(pieces))
    return received


def describe() -> str:
    """One line on what this process sees after joining (for logs and the launch check)."""
    return (
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local of "
        f"{jax.device_count()} devices ({jax.devices()[0].platform})"
    )


def define_flags() -> None:
    """Defines --coordinator_address, --num_processes, --process_id, --heartbeat_timeout_s (absl)."""
    from absl import flags

    flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (multi-process runs).")
    flags.DEFINE_integer("num_processes", None, "Number of processes in the run.")
    flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")
    flags.DEFINE_integer(
        "heartbeat_timeout_s",
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        "Seconds without a heartbeat after which a peer counts as dead and the others stop.",
    )


def options_from_flags() -> DistributedOptions:
    """DistributedOptions from the flags of define_flags()."""
    from absl import flags

    values = flags.FLAGS
    return DistributedOptions(
        coordinator_address=values.coordinator_address,
        num_processes=values.num_processes,
        process_id=values.process_id,
        heartbeat_timeout_s=values.heartbeat_timeout_s,
    )


def _check_main(argv: list[str]) -> None:
    import sys

    from jax.experimental import multihost_utils

    del argv
    try:
        initialize(options_from_flags())
    except DistributedError as e:
        sys.exit(f"error: {e}")
    # A collective across every process proves that they really joined.
    joined = int(multihost_utils.process_allgather(jax.numpy.ones((), jax.numpy.int32)).sum())
    print(f"{describe()}; a collective reached {joined} processes", flush=True)


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(_check_main)

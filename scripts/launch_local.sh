#!/usr/bin/env bash
# Starts N processes of one command on this machine, joined over 127.0.0.1, as
# stand-ins for N hosts (CPU, fake devices): the way to try multi-host runs
# without a cluster.
#
#   scripts/launch_local.sh N [DEVICES_PER_PROCESS] -- python -m detector.train \
#       --config=configs/default.py --workdir=runs/two_hosts
#
# Each process gets --coordinator_address=127.0.0.1:PORT --num_processes=N
# --process_id=I appended and DEVICES_PER_PROCESS (default 4) fake CPU
# devices. Output lines are prefixed with the process index. When one process
# fails, the others are stopped and the script exits with its status.
# SIGTERM or Ctrl-C stops all of them with a checkpoint (see detector/preemption.py).
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "usage: $0 NUM_PROCESSES [DEVICES_PER_PROCESS] -- COMMAND [ARGS...]" >&2
  exit 2
fi
num_processes="$1"; shift
devices_per_process=4
if [[ "$1" != "--" ]]; then devices_per_process="$1"; shift; fi
if [[ "$1" != "--" ]]; then
  echo "usage: $0 NUM_PROCESSES [DEVICES_PER_PROCESS] -- COMMAND [ARGS...]" >&2
  exit 2
fi
shift
if ! [[ "$num_processes" =~ ^[1-9][0-9]*$ && "$devices_per_process" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NUM_PROCESSES and DEVICES_PER_PROCESS must be positive integers" >&2
  exit 2
fi

port="${COORDINATOR_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
pids=()
# SIGTERM/SIGINT to the launcher reach every process as SIGTERM, the preemption
# signal: they agree on a step, save it and exit 0. (Ctrl-C in a terminal also
# reaches them directly as SIGINT; the trainer counts the two as one.)
forward_term() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; }
trap forward_term INT TERM

for ((i = 0; i < num_processes; i++)); do
  (
    # The subshell becomes the command (exec), so $! is the process itself;
    # its output goes through sed for the prefix.
    exec > >(sed -u "s/^/[${i}] /") 2>&1
    JAX_PLATFORMS=cpu \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${devices_per_process}" \
      exec "$@" --coordinator_address="127.0.0.1:${port}" --num_processes="${num_processes}" --process_id="${i}"
  ) &
  pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
  code=0
  wait "$pid" || code=$?
  # A trapped signal interrupts `wait` while the process still runs: wait again.
  while kill -0 "$pid" 2>/dev/null; do code=0; wait "$pid" || code=$?; done
  if [[ $code -ne 0 && $status -eq 0 ]]; then status=$code; forward_term; fi
done
exit "$status"

"""Memory of a process and its descendants, read from /proc (Linux): what a run costs the host."""

from __future__ import annotations


def resident_bytes(pid: int) -> int:
    """VmRSS of `pid` and all its descendants, in bytes; 0 for a process that has gone."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            with open(f"/proc/{current}/task/{current}/children") as f:
                pending += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total

"""An exclusive lock on a path that names its holder, for independent processes that must not do one thing twice.

Two jobs of a sweep started at once on a fresh data dir, or a trainer started
on a workdir that another trainer is using: one of them goes ahead, and the
others wait for it (`wait=True`) or stop (`wait=False`) with a message naming
whom they found there.

The lock is `fcntl.flock` on an open lock file. The kernel drops it when the
holder exits, however it exits (SIGKILL and crashes included), so a lock file
left behind never blocks anybody: only the lock counts, never the file's
existence. The holder writes who it is into the file (host, pid, when it took
the lock in UTC, command line) for the processes that find it taken. The file
is never deleted: a process that has it open and is about to lock it would
then hold a lock on a file nobody else sees, beside a new holder of a new file.

Where flock is unsupported (some network filesystems answer ENOLCK or
EOPNOTSUPP) the lock falls back to creating `PATH.held` exclusively (O_EXCL),
with the same identity inside, deleted on release. That file survives a
killed holder, so it is replaced as stale when its holder ran on this host and
that pid is gone; one left by a process of another host cannot be judged from
here, and blocks until it is deleted (the error and the wait log name it).

Paths with a scheme (gs://...) are not locked: object stores have no locks,
and a warning says that concurrent use goes unnoticed there.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time

# flock's answers on filesystems without it: ENOLCK (NFS without lockd), the rest (FUSE and others).
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_POLL_S = 0.2  # between attempts while waiting: short next to any conversion or training run
_IDENTITY_WAIT_S = 1.0  # how long to wait for a new holder, between taking the lock and writing its name
FALLBACK_SUFFIX = ".held"


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: what its holder wrote into the lock file.

    Attributes:
      host: the holder's host name.
      pid: its process id on that host.
      since: when it took the lock, ISO 8601 UTC to the second (`2026-12-03T06:00:00Z`).
      command: its command line.
    """

    host: str
    pid: int
    since: str
    command: str

    @classmethod
    def of_this_process(cls) -> Holder:
        since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        # orig_argv keeps `python -m detector.train ...` as typed; argv starts with the module's file.
        command = " ".join(sys.orig_argv)
        return cls(socket.gethostname(), os.getpid(), since, command)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder written in `text`, or None when it is empty or not a holder (being written)."""
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), int(fields["pid"]), str(fields["since"]), str(fields["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    def is_gone(self) -> bool:
        """Whether this holder ran on this host and its pid runs no more (a holder elsewhere cannot be judged)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, under another user
            return False
        return False

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host} (since {self.since})"


class LockHeld(Exception):
    """Another process holds the lock: with `wait=False` at once, with a timeout when it ran out.

    Attributes:
      path: the lock file (`PATH.held` where flock is unsupported).
      holder: who holds it; None when it has not written its name (yet).
    """

    def __init__(self, path: str, holder: Holder | None):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {holder or 'another process'}")


class FileLock:
    """An exclusive lock on `path` (a file that is created; its parent directory too), as a `with` block.

    Args:
      path: the lock file, e.g. the thing it guards plus `.lock`. Local paths
        only; one with a scheme (gs://) is not locked.
      wait: True to wait until the holder lets go (logging whom it waits for
        every `log_every_s` seconds); False to raise LockHeld at once.
      timeout_s: with `wait`, seconds after which LockHeld is raised; None waits as long as it takes.
      log_every_s: seconds between the wait's log lines (the first comes at once).
      description: what the holder is doing, for the wait's log lines, e.g. "converting the train split".
      use_flock: False takes the exclusive-create fallback directly (what a filesystem without flock gets).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        wait: bool,
        timeout_s: float | None = None,
        log_every_s: float = 30.0,
        description: str = "",
        use_flock: bool = True,
    ):
        self.path = os.fspath(path)
        self._wait, self._timeout_s, self._log_every_s = wait, timeout_s, log_every_s
        self._description = description
        self._use_flock = use_flock
        self._fd: int | None = None  # the locked file, while flock holds it
        self._marker: str | None = None  # the created PATH.held, while the fallback holds it

    @property
    def held(self) -> bool:
        return self._fd is not None or self._marker is not None

    def acquire(self) -> FileLock:
        """Takes the lock, waiting or not as configured.

        Raises:
          LockHeld: another process holds it (and `wait` is False, or `timeout_s` passed).
          OSError: the lock file cannot be created (e.g. no permission).
        """
        if self.held:
            raise RuntimeError(f"{self.path} is already held by this FileLock")
        if "://" in self.path:
            logging.warning("%s is not on a local filesystem: not locked, so concurrent use goes unnoticed", self.path)
            return self
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        start = time.monotonic()
        next_log, logged_holder = start, None
        while not self._try_once():
            holder = self._read_holder()
            now = time.monotonic()
            if not self._wait or (self._timeout_s is not None and now - start >= self._timeout_s):
                raise LockHeld(self._held_path(), holder)
            # Also when another waiter got it first: the log names whom it waits for now.
            if now >= next_log or holder != logged_holder:
                logging.info(
                    "waiting for %s to release %s%s (%.0f s so far); its command: %s",
                    holder or "another process",
                    self._held_path(),
                    f" ({self._description})" if self._description else "",
                    now - start,
                    holder.command if holder else "unknown",
                )
                next_log, logged_holder = now + self._log_every_s, holder
            time.sleep(_POLL_S)
        return self

    def release(self) -> None:
        """Lets go; the flock file stays (see the module docstring), the fallback's PATH.held goes."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock
        if self._marker is not None:
            marker, self._marker = self._marker, None
            try:
                os.unlink(marker)
            except FileNotFoundError:
                pass

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _held_path(self) -> str:
        return self.path if self._use_flock else self.path + FALLBACK_SUFFIX

    def _try_once(self) -> bool:
        if self._use_flock:
            try:
                return self._try_flock()
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                logging.warning(
                    "%s: the filesystem does not support flock (%s); locking by creating %s instead",
                    self.path,
                    errno.errorcode.get(e.errno, e.errno),
                    self.path + FALLBACK_SUFFIX,
                )
                self._use_flock = False
        return self._try_create()

    def _try_flock(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        # What a dead holder wrote is replaced: its lock went with it.
        os.ftruncate(fd, 0)
        os.pwrite(fd, Holder.of_this_process().to_json().encode(), 0)
        self._fd = fd
        return True

    def _try_create(self) -> bool:
        marker = self.path + FALLBACK_SUFFIX
        for _ in range(2):  # a second try after taking a stale file away
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except FileExistsError:
                holder = self._read_holder()
                if holder is None or not holder.is_gone():
                    return False
                logging.warning("%s was left by %s, which no longer runs: taking it over", marker, holder)
                # Read again just before deleting: another process may have replaced the stale file meanwhile.
                if self._read_holder() != holder:
                    return False
                try:
                    os.unlink(marker)
                except FileNotFoundError:
                    pass
                continue
            try:
                os.write(fd, Holder.of_this_process().to_json().encode())
            finally:
                os.close(fd)
            self._marker = marker
            return True
        return False

    def _read_holder(self) -> Holder | None:
        """Who holds the lock; waits briefly for a holder that has locked but not yet written its name."""
        deadline = time.monotonic() + _IDENTITY_WAIT_S
        while True:
            try:
                with open(self._held_path()) as f:
                    holder = Holder.parse(f.read())
            except FileNotFoundError:
                return None  # the fallback's holder let go meanwhile
            if holder is not None or time.monotonic() >= deadline:
                return holder
            time.sleep(0.05)

"""JAX's persistent compilation cache, on by default: a relaunched run loads its compiled programs from disk.

Compiling the train and predict steps of a large model takes minutes, and a
run that is preempted and started again would otherwise pay for it on every
restart. The cache maps each program (with its shardings, devices and
compiler flags) to its compiled executable, so an identical program is
loaded instead of compiled; a changed config simply misses and compiles.

In a multi-process run every process reads the cache and JAX writes it from
process 0 only (its choice, to avoid contended writes on shared storage), so
on a cluster the directory belongs on a filesystem every host sees: a
host-local directory only ever fills on process 0's host.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import jax
from absl import logging

# Programs that compile faster than this are not written: reading a tiny
# executable back costs about as much as compiling it, and each one is a file.
MIN_COMPILE_TIME_SECS = 1.0


def default_directory(environ: Mapping[str, str] = os.environ) -> str:
    """JAX's own JAX_COMPILATION_CACHE_DIR when set (empty: off), else $XDG_CACHE_HOME/detector/jax_compilation_cache.

    JAX's variable wins so that a cluster already configured for JAX keeps
    its cache. XDG_CACHE_HOME, when unset or not absolute, is ~/.cache, as
    the XDG base directory specification has it.
    """
    if "JAX_COMPILATION_CACHE_DIR" in environ:
        return environ["JAX_COMPILATION_CACHE_DIR"]
    cache_home = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache_home):
        home = environ.get("HOME") or os.path.expanduser("~")
        cache_home = os.path.join(home, ".cache")
    return os.path.join(cache_home, "detector", "jax_compilation_cache")


def _is_remote(directory: str) -> bool:
    return "://" in directory


def _check_writable(directory: str) -> None:
    """Raises OSError unless `directory` exists (creating it) and takes a new file.

    Checked up front because JAX finds out only at its first write, and then
    warns at every compile instead of once.
    """
    os.makedirs(directory, exist_ok=True)
    descriptor, probe = tempfile.mkstemp(dir=directory, prefix=".write_check-")
    os.close(descriptor)
    os.remove(probe)


def use_compilation_cache(directory: str | None) -> str | None:
    """Points JAX's persistent compilation cache at `directory` (None or empty: off); returns the one in use.

    Call before the first compilation: JAX opens its cache then, once. A
    local directory is created; a remote one (gs://...) is left to JAX. A
    local directory that cannot be created or written is reported in one
    warning and the command goes on without the cache: a missing cache costs
    minutes, a failed launch costs the run.
    """
    if directory and not _is_remote(directory):
        directory = os.path.expanduser(directory)
        try:
            _check_writable(directory)
        except OSError as e:
            logging.warning(
                "compiling without the persistent compilation cache: cannot write to %s (%s); point "
                "--compilation_cache_dir at a writable directory, or pass --compilation_cache_dir= to turn it off",
                directory,
                e.strerror or e,
            )
            directory = None
    directory = directory or None
    jax.config.update("jax_compilation_cache_dir", directory)
    # JAX reads its own variable for this at import; read here as well so the
    # variable keeps winning over this module's default.
    min_compile_time = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(min_compile_time) if min_compile_time else MIN_COMPILE_TIME_SECS,
    )
    if directory:
        logging.info("compilation cache: %s (programs compiled here are reused by later runs)", directory)
    else:
        logging.info("compilation cache off")
    return directory

"""Prepared splits: each source split converted once into records + index (cache.py), then reused.

A split is converted under the cache root (`dataset.cache_dir`, default
DATA_DIR/prepared) into a directory named after its source; later runs and
every host reuse it as long as the source's fingerprint is unchanged.
Conversion counts bad records; a source where most images are unusable
stops with a DatasetError.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import jax
import numpy as np
import tensorflow as tf
from jax.experimental import multihost_utils

from input_pipeline import file_lock
from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import cache, conversion, fingerprint, tfds_source
from input_pipeline.datasets.locations import cache_root, coco_json_paths, resolve_data_dir
from input_pipeline.datasets.registry import EVAL, TFDS_DATASETS, TRAIN, check_name
from input_pipeline.datasets.tfds_builders import get_builder

_tf_configured = False


def configure_tf() -> None:
    """Keeps TensorFlow off accelerators: it only feeds the input pipeline."""
    global _tf_configured
    if _tf_configured:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # TF's runtime was already initialized elsewhere; too late to hide.
    _tf_configured = True


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to obtain one prepared split: where it lives and how to convert it."""

    directory: str
    fingerprint: str
    describe: str
    convert: Callable[[], cache.PreparedSplit]
    # Every host converting a share together (conversion.py); None: process 0 converts alone.
    convert_on_hosts: Callable[[conversion.Hosts], cache.PreparedSplit | None] | None = None


def _plan(config, which: str, sync: bool) -> _Plan:
    name = check_name(config)
    data_dir = resolve_data_dir(config)
    root = cache_root(config, data_dir)
    if name == "coco_json":
        json_path, image_root = coco_json_paths(config, which)
        source = fingerprint.coco_json_fingerprint(json_path, image_root, f"{which}_json")
        stem = os.path.splitext(os.path.basename(json_path))[0]
        directory = os.path.join(root, "coco_json", f"{stem}-{fingerprint.short_digest(source)}")

        workers = conversion.default_workers(int(config.dataset.prepare_workers))

        def convert(hosts=None):
            return conversion.convert_coco_json(
                directory, json_path, image_root, fingerprint=source, workers=workers, hosts=hosts
            )

        return _Plan(directory, source, f"{json_path} ({image_root})", convert, convert_on_hosts=convert)

    entry = TFDS_DATASETS[name]
    split = config.dataset.train_split if which == TRAIN else config.dataset.eval_split
    builder = get_builder(config, sync=sync)
    full_name = builder.info.full_name
    directory = os.path.join(root, *full_name.split("/"), split.replace("/", "_"))
    source = fingerprint.tfds_fingerprint(full_name, split)

    def convert():
        counts = collections.Counter()
        try:
            examples = tfds_source.iter_examples(builder, split, entry.layout, len(entry.class_names), counts)
            return cache.write_split(
                directory,
                examples,
                counts,
                fingerprint=source,
                class_names=entry.class_names,
                category_ids=entry.category_ids,
            )
        except (AssertionError, KeyError, ValueError, tf.errors.NotFoundError) as e:
            if isinstance(e, DatasetError):
                raise
            raise DatasetError(
                f"cannot read split {split!r} of {name} from {data_dir} ({str(e).splitlines()[0][:200]}); "
                f"prepare it with `tfds build {name} --data_dir={data_dir}` or set "
                "--config.dataset.data_dir / the split names"
            ) from e

    return _Plan(directory, source, f"{name} split {split!r}", convert)


@contextlib.contextmanager
def _split_lock(plan: _Plan) -> Iterator[None]:
    """Holds `SPLIT.lock`; a conversion that fails leaves neither it nor the directories made for it.

    A source that cannot be read (a TFDS dataset never built) must not leave
    an empty cache tree behind that looks like a half-prepared one.
    """
    lock_path = f"{plan.directory}.lock"
    made = []  # the lock's missing ancestors, deepest first
    parent = os.path.dirname(os.path.abspath(lock_path))
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        with file_lock.FileLock(lock_path, wait=True, description=f"converting {plan.describe}"):
            yield
    except BaseException:
        if not os.path.exists(plan.directory):
            with contextlib.suppress(OSError):
                os.remove(lock_path)
            for directory in made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # only if empty: another process may be using it
        raise


def _convert_once(plan: _Plan) -> cache.PreparedSplit:
    """Converts the split unless another process did; independent processes converting it at once wait for one.

    Two jobs started together on a fresh cache would both convert, and the
    second to finish would replace the first one's split under its readers.
    """
    with _split_lock(plan):
        split = cache.load_split(plan.directory, fingerprint=plan.fingerprint)  # the holder we waited for made it
        return split if split is not None else plan.convert()


def _jax_hosts() -> conversion.Hosts:
    def broadcast(value: int) -> int:
        return int(multihost_utils.broadcast_one_to_all(np.int64(value)))

    def gather(flag: int) -> list[int]:
        return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(flag))).reshape(-1)]

    return conversion.Hosts(jax.process_index(), jax.process_count(), broadcast, gather)


def _convert_on_all_hosts(plan: _Plan) -> None:
    """Every process converts its share (plan.convert_on_hosts); process 0 holds the lock of _convert_once.

    Process 0 first says whether there is anything to do: another job may
    have converted the split while it waited for the lock.
    """
    hosts = _jax_hosts()
    if hosts.index != 0:
        if hosts.broadcast(0):
            plan.convert_on_hosts(hosts)
        return
    with _split_lock(plan):
        todo = cache.load_split(plan.directory, fingerprint=plan.fingerprint) is None
        if hosts.broadcast(int(todo)):
            plan.convert_on_hosts(hosts)


def prepare_split(config, which: str, *, sync: bool = True) -> cache.PreparedSplit:
    """The prepared `which` ('train' or 'eval') split of `config.dataset`.

    Converts the source on first use. In multi-process runs with `sync=True`
    (every process must then call this) every host converts a share of a
    COCO-format folder (conversion.py), while a TFDS split is converted by
    process 0 as the others wait at a barrier; a host that still does not see
    the split afterwards (no shared filesystem) converts its own identical
    copy. Pass `sync=False` only from code that runs on one process.

    Raises:
      DatasetError: unknown or misconfigured dataset, unreadable source, or
        more than input.max_bad_fraction of its images unusable.
    """
    if which not in (TRAIN, EVAL):
        raise ValueError(f"which must be {TRAIN!r} or {EVAL!r}, got {which!r}")
    configure_tf()
    plan = _plan(config, which, sync)
    split = cache.load_split(plan.directory, fingerprint=plan.fingerprint)
    if split is None:
        if sync and jax.process_count() > 1:
            if plan.convert_on_hosts is not None:
                _convert_on_all_hosts(plan)
            elif jax.process_index() == 0:
                _convert_once(plan)
            multihost_utils.sync_global_devices(f"prepare {plan.directory}")
            split = cache.load_split(plan.directory, fingerprint=plan.fingerprint)
        if split is None:
            split = _convert_once(plan)
    cache.check_usable(split, what=plan.describe, max_bad_fraction=float(config.input.max_bad_fraction))
    return split

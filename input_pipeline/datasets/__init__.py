"""Dataset registry: config.dataset -> prepared, random-access splits.

Known datasets (`config.dataset.name`):
  synthetic_shapes  generated locally on first use (input_pipeline/datasets/
                    synthetic_shapes.py); the default, needs no download.
  coco_json         a COCO-format folder: `dataset.train_json` /
                    `dataset.train_images` and `dataset.eval_json` /
                    `dataset.eval_images` (instances JSON + image root), the
                    format custom data comes in.
  coco/2017         TFDS `coco/2017`, already prepared in the data dir
                    (`tfds build coco/2017 --data_dir=DIR`).
  voc/2007, voc/2012  TFDS Pascal VOC, already prepared likewise; `difficult`
                    objects are regions to ignore, like COCO crowds.

Every split is converted once into a prepared split (records + index, see
cache.py) under `dataset.cache_dir` (default DATA_DIR/prepared); later runs
and every host reuse it. Conversion counts bad records; a source where most
images are unusable stops with a DatasetError.

Data dir: `config.dataset.data_dir`, or when None `$DETECTOR_DATA_DIR`, or
`~/.cache/detector/datasets`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from collections.abc import Callable

import jax
import tensorflow as tf
import tensorflow_datasets as tfds
from etils import epath
from jax.experimental import multihost_utils

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import cache, coco_json, tfds_source
from input_pipeline.datasets import synthetic_shapes as ss

KNOWN_DATASETS = ("synthetic_shapes", "coco_json", "coco/2017", "voc/2007", "voc/2012")
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "detector", "datasets")
TRAIN, EVAL = "train", "eval"

# TFDS coco/2017 labels are the 80 used COCO categories in category-id order;
# COCO's own ids (1-90, with gaps) are what its evaluation files use.
COCO_CATEGORY_IDS = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
    25,
    27,
    28,
    31,
    32,
    33,
    34,
    35,
    36,
    37,
    38,
    39,
    40,
    41,
    42,
    43,
    44,
    46,
    47,
    48,
    49,
    50,
    51,
    52,
    53,
    54,
    55,
    56,
    57,
    58,
    59,
    60,
    61,
    62,
    63,
    64,
    65,
    67,
    70,
    72,
    73,
    74,
    75,
    76,
    77,
    78,
    79,
    80,
    81,
    82,
    84,
    85,
    86,
    87,
    88,
    89,
    90,
)
COCO_CLASS_NAMES = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)


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


def resolve_data_dir(config) -> str:
    """Returns the data dir for `config`, creating the default one if needed.

    An explicitly set `config.dataset.data_dir` may not exist yet, but its
    parent directory must (a typo in a path should fail here, loudly, rather
    than prepare a dataset somewhere unexpected).
    """
    data_dir = config.dataset.get("data_dir", None)
    if not data_dir:
        data_dir = os.environ.get("DETECTOR_DATA_DIR") or os.path.expanduser(DEFAULT_DATA_DIR)
        epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
        return os.fspath(data_dir)
    data_dir = os.fspath(data_dir)
    if "://" not in data_dir:  # Local path; remote ones (gs://) are not checked.
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
        parent = os.path.dirname(data_dir)
        if not os.path.isdir(parent):
            raise DatasetError(
                f"data_dir {data_dir} cannot be used: its parent directory {parent} "
                f"does not exist; create it (mkdir -p {parent}) or set "
                "--config.dataset.data_dir to an existing location"
            )
    return data_dir


VOC_CLASS_NAMES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the model and the evaluator need to know about a dataset.

    Attributes:
      name: registry name, e.g. 'synthetic_shapes'.
      num_classes: number of contiguous labels 0..num_classes-1.
      class_names: tuple of num_classes names.
      label_to_category_id: tuple of num_classes category ids; entry i is the
        category id of contiguous label i (used in COCO-format files).
      num_eval_examples: usable images in the eval split.
    """

    name: str
    num_classes: int
    class_names: tuple[str, ...]
    label_to_category_id: tuple[int, ...]
    num_eval_examples: int


def _synthetic_builder(config, data_dir: str, sync: bool):
    ds = config.dataset
    sizes = (
        int(ds.get("num_train_examples", 4096)),
        int(ds.get("num_eval_examples", 256)),
        int(ds.get("image_size", 128)),
    )
    name = ss.config_name(*sizes)

    def make():
        # TFDS refuses a new config object named like a predefined one.
        cfg = name if name in ss.SyntheticShapes.builder_configs else (ss.SyntheticShapesConfig.make(*sizes))
        return ss.SyntheticShapes(data_dir=data_dir, config=cfg)

    epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
    # No network: the dataset is generated here, never fetched from GCS.
    download_config = tfds.download.DownloadConfig(try_download_gcs=False)
    if sync and jax.process_count() > 1:
        if jax.process_index() == 0:
            make().download_and_prepare(download_config=download_config)
        multihost_utils.sync_global_devices(f"prepare synthetic_shapes/{name}")
        builder = make()  # Opened after the barrier so it reads process 0's files.
        if not builder.is_prepared():
            # data_dir is not shared between hosts: generation is deterministic,
            # so a local copy is identical to process 0's.
            builder.download_and_prepare(download_config=download_config)
        return builder
    builder = make()
    builder.download_and_prepare(download_config=download_config)
    return builder


@dataclasses.dataclass(frozen=True)
class _TfdsEntry:
    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]
    layout: tfds_source.TfdsLayout


_TFDS_DATASETS = {
    "synthetic_shapes": _TfdsEntry(
        class_names=tuple(ss.CLASS_NAMES),
        # COCO-format files need ids; 0 is avoided as it is no valid COCO id.
        category_ids=tuple(range(1, len(ss.CLASS_NAMES) + 1)),
        layout=tfds_source.TfdsLayout(image_id_key="image/id", ignore_key=None),
    ),
    "coco/2017": _TfdsEntry(
        class_names=COCO_CLASS_NAMES,
        category_ids=COCO_CATEGORY_IDS,
        layout=tfds_source.TfdsLayout(image_id_key="image/id", ignore_key="is_crowd"),
    ),
    "voc/2007": _TfdsEntry(
        class_names=VOC_CLASS_NAMES,
        category_ids=tuple(range(1, 21)),
        layout=tfds_source.TfdsLayout(image_id_key=None, ignore_key="is_difficult"),
    ),
}
_TFDS_DATASETS["voc/2012"] = _TFDS_DATASETS["voc/2007"]


def _check_name(config) -> str:
    name = config.dataset.name
    if name not in KNOWN_DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    return name


def _cache_root(config, data_dir: str) -> str:
    root = config.dataset.get("cache_dir", None)
    return os.path.abspath(os.path.expanduser(os.fspath(root))) if root else os.path.join(data_dir, "prepared")


def coco_json_paths(config, which: str) -> tuple[str, str]:
    json_key, images_key = f"{which}_json", f"{which}_images"
    json_path = config.dataset.get(json_key, None)
    image_root = config.dataset.get(images_key, None)
    if not json_path or not image_root:
        raise DatasetError(
            f"dataset coco_json needs dataset.{json_key} and dataset.{images_key}; "
            f"pass --config.dataset.{json_key}=PATH/instances.json "
            f"--config.dataset.{images_key}=PATH/images"
        )
    return (os.path.abspath(os.path.expanduser(json_path)), os.path.abspath(os.path.expanduser(image_root)))


def _fingerprint_file(path: str, key: str) -> str:
    try:
        stat = os.stat(path)
    except FileNotFoundError as e:
        raise DatasetError(f"COCO annotations file {path} does not exist; check --config.dataset.{key}") from e
    except OSError as e:
        raise DatasetError(f"cannot read {path} ({e.strerror}); check --config.dataset.{key}") from e
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to obtain one prepared split: where it lives and how to convert it."""

    directory: str
    fingerprint: str
    describe: str
    convert: Callable[[], cache.PreparedSplit]


def _plan(config, which: str, sync: bool) -> _Plan:
    name = _check_name(config)
    data_dir = resolve_data_dir(config)
    root = _cache_root(config, data_dir)
    if name == "coco_json":
        json_path, image_root = coco_json_paths(config, which)
        fingerprint = f"coco_json:{_fingerprint_file(json_path, f'{which}_json')}:{image_root}"
        digest = hashlib.sha1(fingerprint.encode()).hexdigest()[:12]
        stem = os.path.splitext(os.path.basename(json_path))[0]
        directory = os.path.join(root, "coco_json", f"{stem}-{digest}")

        def convert():
            categories = coco_json.read_categories(json_path)
            counts = collections.Counter()
            return cache.write_split(
                directory,
                coco_json.iter_examples(json_path, image_root, counts),
                counts,
                fingerprint=fingerprint,
                class_names=categories.class_names,
                category_ids=categories.category_ids,
            )

        return _Plan(directory, fingerprint, f"{json_path} ({image_root})", convert)

    entry = _TFDS_DATASETS[name]
    split = config.dataset.train_split if which == TRAIN else config.dataset.eval_split
    builder = get_builder(config, sync=sync)
    full_name = builder.info.full_name
    directory = os.path.join(root, *full_name.split("/"), split.replace("/", "_"))
    fingerprint = f"tfds:{full_name}:{split}"

    def convert():
        counts = collections.Counter()
        try:
            examples = tfds_source.iter_examples(builder, split, entry.layout, len(entry.class_names), counts)
            return cache.write_split(
                directory,
                examples,
                counts,
                fingerprint=fingerprint,
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

    return _Plan(directory, fingerprint, f"{name} split {split!r}", convert)


def get_builder(config, *, sync: bool = True) -> tfds.core.DatasetBuilder:
    """The TFDS builder of a TFDS dataset (synthetic_shapes: generated on first use).

    coco/2017 and voc are opened from the data dir and never downloaded (see
    prepare_split for `sync`).
    """
    name = _check_name(config)
    if name not in _TFDS_DATASETS:
        raise DatasetError(f"dataset {name!r} is not a TFDS dataset")
    data_dir = resolve_data_dir(config)
    if name == "synthetic_shapes":
        return _synthetic_builder(config, data_dir, sync)
    return tfds.builder(name, data_dir=data_dir)


def prepare_split(config, which: str, *, sync: bool = True) -> cache.PreparedSplit:
    """The prepared `which` ('train' or 'eval') split of `config.dataset`.

    Converts the source on first use. In multi-process runs with `sync=True`
    (every process must then call this) process 0 converts while the others
    wait at a barrier; a host that still does not see the split afterwards (no
    shared filesystem) converts its own identical copy. Pass `sync=False`
    only from code that runs on one process.

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
            if jax.process_index() == 0:
                plan.convert()
            multihost_utils.sync_global_devices(f"prepare {plan.directory}")
            split = cache.load_split(plan.directory, fingerprint=plan.fingerprint)
        if split is None:
            split = plan.convert()
    max_bad = float((config.get("input", None) or {}).get("max_bad_fraction", 0.5))
    cache.check_usable(split, what=plan.describe, max_bad_fraction=max_bad)
    return split


def eval_ground_truth(config) -> dict:
    """COCO-format ground truth of the eval split, in original image pixels.

    A COCO-format folder is evaluated against the user's own JSON (annotations
    that conversion dropped as unusable left out, missing `area` / `iscrowd`
    filled in as COCO defines them); other sources against their prepared
    split, with crowd / difficult regions as iscrowd=1 so COCO evaluation
    ignores detections on them. Runs on one process and never waits for
    others: call it after the splits are prepared.
    """
    if _check_name(config) == "coco_json":
        return coco_json.load_ground_truth(coco_json_paths(config, EVAL)[0])
    return cache.ground_truth(prepare_split(config, EVAL, sync=False))


def class_names(config) -> tuple[str, ...]:
    """Class names of `config.dataset`, label order, without converting any data."""
    name = _check_name(config)
    if name == "coco_json":
        return coco_json.read_categories(coco_json_paths(config, TRAIN)[0]).class_names
    return _TFDS_DATASETS[name].class_names


def get_dataset_info(config, *, sync: bool = True) -> DatasetInfo:
    """Class names, category ids and eval size of `config.dataset`.

    Prepares both splits if needed (see prepare_split for `sync`).

    Raises:
      DatasetError: as prepare_split, or train and eval splits whose categories
        differ.
    """
    train = prepare_split(config, TRAIN, sync=sync)
    evaluation = prepare_split(config, EVAL, sync=sync)
    if (train.category_ids, train.class_names) != (evaluation.category_ids, evaluation.class_names):
        raise DatasetError(
            f"train and eval categories differ ({len(train.category_ids)} vs "
            f"{len(evaluation.category_ids)} categories); both JSON files must list "
            "the same categories with the same ids"
        )
    return DatasetInfo(
        name=config.dataset.name,
        num_classes=len(train.class_names),
        class_names=train.class_names,
        label_to_category_id=train.category_ids,
        num_eval_examples=evaluation.num_records,
    )


__all__ = [
    "COCO_CATEGORY_IDS",
    "COCO_CLASS_NAMES",
    "DatasetError",
    "DatasetInfo",
    "EVAL",
    "KNOWN_DATASETS",
    "TRAIN",
    "VOC_CLASS_NAMES",
    "class_names",
    "configure_tf",
    "coco_json_paths",
    "eval_ground_truth",
    "get_builder",
    "get_dataset_info",
    "prepare_split",
    "resolve_data_dir",
]

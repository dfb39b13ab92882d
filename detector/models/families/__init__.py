"""Detector families: each network with its training objective and its decoding into detections.

`config.model.name` picks the family from `FAMILIES`, a table of `Family`
(how to build the network, how to make its `Objective`), one module each:
  * "retinanet" (`families.retinanet`): dense anchors, a focal loss over
    anchors matched by IoU, NMS at inference;
  * "dino" (`families.dino`): queries with Hungarian-matched set losses on
    every decoder layer, the encoder proposals, contrastive denoising groups
    and an optional one-to-many branch, top-k at inference without NMS.

The train and predict steps see a family only through `Objective`: pure
functions of (params, batch), so they jit, shard and export the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn

from detector.errors import ConfigError
from detector.models.families import dino, retinanet
from detector.models.families.objective import Objective
from detector.models.families.retinanet import anchors_for_config, num_anchors_per_location
from detector.ops import images as images_lib

__all__ = [
    "FAMILIES",
    "Family",
    "Objective",
    "anchors_for_config",
    "create_model",
    "family_of",
    "num_anchors_per_location",
    "objective",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """A detector family as the steps reach it.

    create: `(config, num_classes, *, data_parallel_devices) -> nn.Module`,
      raising `ConfigError` for values that cannot work.
    objective: `(config, model, num_classes) -> Objective` whose `loss` and
      `detect` take images already normalised (and resampled) by `objective`
      below.
    """

    create: Callable[..., nn.Module]
    objective: Callable[..., Objective]


FAMILIES = {
    "retinanet": Family(create=retinanet.create, objective=retinanet.objective),
    "dino": Family(create=dino.create, objective=dino.objective),
}


def family_of(model_config) -> Family:
    name = model_config.name
    if name not in FAMILIES:
        raise ConfigError(f"model.name={name!r}; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def create_model(config, num_classes: int, *, data_parallel_devices: int = 1) -> nn.Module:
    """The network of `config.model.name` for `num_classes` classes.

    `data_parallel_devices`: the devices the batch, and so each gradient
    reduction, is split over (the mesh's data x fsdp); the default, 1, suits
    prediction, which reduces no gradients. Only `model.head_level_packing="auto"`
    reads it; the parameters do not depend on it.
    """
    return family_of(config.model).create(config, num_classes, data_parallel_devices=data_parallel_devices)


def objective(config, model: nn.Module, num_classes: int, *, predict_model: nn.Module | None = None) -> Objective:
    """The loss and detection functions of `model`, built by `create_model(config, num_classes)`.

    `predict_model`: the network `detect` runs instead, with the same
    parameters (a training run's `model` may pack its head's levels for the
    gradient reduction, which prediction does not need).
    """
    family = family_of(config.model).objective(config, model, num_classes)
    detecting = (
        family if predict_model is None else family_of(config.model).objective(config, predict_model, num_classes)
    )
    mean_rgb, std_rgb = _normalization(config.input)
    resize_on_device = bool(config.input.resize_on_device)
    image_size = tuple(int(v) for v in config.input.image_size)

    def network_images(images, image_hw):
        return images_lib.normalize_images(images, image_hw, mean_rgb, std_rgb)

    def loss(params, batch, rng=None, normalizer=None):
        images = batch["image"]
        if resize_on_device:
            images = images_lib.resample_images(
                images, batch["source_hw"], batch["source_to_image"], batch["source_flipped"], image_size
            )
        batch = {**batch, "image": network_images(images, batch["image_hw"])}
        return family.loss(params, batch, rng, normalizer)

    def detect(params, images, image_hw):
        return detecting.detect(params, network_images(images, image_hw))

    network_model = model if predict_model is None else predict_model

    def network(params, images, image_hw):
        return network_model.apply({"params": params}, network_images(images, image_hw))

    return Objective(loss=loss, detect=detect, outputs_per_image=family.outputs_per_image, network=network)


def _normalization(input_config) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`input.mean_rgb` and `input.std_rgb`, checked: three values each, every std > 0 (0-255 units)."""
    mean_rgb = tuple(float(v) for v in input_config.mean_rgb)
    std_rgb = tuple(float(v) for v in input_config.std_rgb)
    if len(mean_rgb) != 3 or len(std_rgb) != 3 or not all(v > 0 for v in std_rgb):
        raise ConfigError(
            f"input.mean_rgb={mean_rgb} and input.std_rgb={std_rgb}: give three values each (R, G, B, 0-255 "
            "units), every std > 0, e.g. (123.675, 116.28, 103.53) and (58.395, 57.12, 57.375)"
        )
    return mean_rgb, std_rgb

"""The backbones `config.model.backbone.name` picks, and what the families and the optimizer need of one.

A backbone is a Linen module, `images [B, H, W, 3] -> {level: [B, ceil(H / 2**level), ceil(W / 2**level), C]}`,
built from its config block (`configs/common.py`'s `resnet_backbone`, `vit_backbone`): each field of the
module is the block's key of the same name, passed as it is. An option is therefore a default in
`configs/common.py` and a field, check and use in its module, and nothing in between. Adding a backbone
is its module and a row in `BACKBONES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models import resnet, vit

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Keys of every block that no module takes: the weights loader reads `pretrained`, the optimizer `training`.
SHARED_KEYS = ("name", "pretrained", "training")
# Module fields set from `config.model` rather than the block: the compute dtype and `model.remat`.
MODEL_WIDE_FIELDS = ("dtype", "remat")
# Fields every Linen module has, which no config sets.
_LINEN_FIELDS = ("parent", "name")


@dataclasses.dataclass(frozen=True)
class Backbone:
    """A kind of backbone as the families and the optimizer reach it.

    module: the Linen module; `create_backbone` sets each of its fields from the block's key of that name.
    multi_level: True for several levels (a ResNet's C2..C5, for an FPN or a channel mapper), False for
      one stride-16 map at level 4 (a ViT's, for the simple feature pyramid).
    other_keys: keys of the block that are no field of `module`; the hooks below read them.
    frozen_parameters: `backbone_config -> (backbone params -> tree of bools, True: held fixed) or None`,
      what the optimizer keeps fixed while the backbone trains; None: nothing ever is.
    layer_decay: `backbone_config -> ((path below the backbone, shape) -> exponent or None)`, the power of
      `optimizer.layer_decay` that scales a parameter's learning rate (None: x1); None: no layer decay.
    """

    module: type[nn.Module]
    multi_level: bool
    other_keys: tuple[str, ...] = ()
    frozen_parameters: Callable[[Any], Callable[[Any], Any] | None] | None = None
    layer_decay: Callable[[Any], Callable[[tuple[str, ...], tuple[int, ...]], Any]] | None = None


BACKBONES = {
    "resnet": Backbone(
        resnet.ResNet, multi_level=True, other_keys=("freeze_stages",), frozen_parameters=resnet.frozen_parameters
    ),
    "vit": Backbone(vit.ViT, multi_level=False, layer_decay=vit.layer_decay_exponents),
}


def backbone_kind(backbone_config) -> Backbone:
    """The `Backbone` of `config.model.backbone.name`."""
    name = backbone_config.name
    if name not in BACKBONES:
        raise ConfigError(f"model.backbone.name={name!r}; use one of {', '.join(BACKBONES)}")
    return BACKBONES[name]


def compute_dtype(model_config) -> Any:
    """`model.dtype` as a jnp dtype: the compute dtype (parameters, optimizer state and losses stay float32)."""
    if model_config.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={model_config.dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[model_config.dtype]


def create_backbone(model_config, dtype: Any) -> nn.Module:
    """The backbone of `config.model`: its block's keys as the module's fields, `dtype` and `model.remat` as its
    `dtype` and `remat`.

    A block without one of the module's keys, or with a key nothing reads (a misspelt option would
    otherwise leave its default in place unnoticed), is refused with the keys named.
    """
    block = model_config.backbone
    kind = backbone_kind(block)
    fields = [f.name for f in dataclasses.fields(kind.module) if f.init and f.name not in _LINEN_FIELDS]
    options = [name for name in fields if name not in MODEL_WIDE_FIELDS]
    missing = sorted(set(options) - set(block))
    unknown = sorted(set(block) - set(options) - set(SHARED_KEYS) - set(kind.other_keys))
    if missing or unknown:
        problems = [f"lacks {', '.join(missing)}"] * bool(missing)
        problems += [f"has keys no {block.name} backbone reads: {', '.join(unknown)}"] * bool(unknown)
        raise ConfigError(
            f"model.backbone (name={block.name!r}) {' and '.join(problems)}; start from configs/common.py's "
            f"{block.name}_backbone"
        )
    # A list (stage sizes set in Python) becomes a tuple: a module's fields stay immutable and hashable.
    values = {name: tuple(block[name]) if isinstance(block[name], list) else block[name] for name in options}
    model_wide = {"dtype": dtype, "remat": model_config.remat}
    return kind.module(**values, **{name: value for name, value in model_wide.items() if name in fields})

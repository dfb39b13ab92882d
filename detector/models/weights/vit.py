"""A canonical ViT state dict -> parameters of `detector.models.vit.ViT` (D = width, H = heads, i = block).

  patch_embed.proj.weight [D, 3, p, p]    -> patch_embed/kernel [p, p, 3, D]  (.bias -> /bias)
  pos_embed [1, G*G, D]                   -> pos_embed [1, g, g, D]: the G x G grid row by row, resized (see
      `resize_position_embedding`) to the model's g = pretrain_image_size / p if G != g
  class_pos_embed [1, 1, D]               -> class_pos_embed (zeros when the file's class token has none)
  cls_token [1, 1, D], reg_token [1, R, D] -> cls_token, reg_token
  blocks.i.norm{1,2}.{weight,bias}        -> norm{1,2}/{scale,bias}
  blocks.i.attn.qkv.weight [3D, D]        -> attn/qkv/kernel [D, 3, H, D/H]
  blocks.i.attn.qkv.bias [3D]             -> attn/qkv/bias [3, H, D/H]; attn.q_bias, v_bias [D] with k's 0
  blocks.i.attn.proj.weight [D, D]        -> attn/out/kernel [H, D/H, D]     (.bias -> /bias)
  blocks.i.ls{1,2}.gamma [D]              -> ls{1,2}
  blocks.i.mlp.fc1.weight [h, D]          -> mlp/fc1/kernel [D, h]           (GELU; .bias -> /bias)
  blocks.i.mlp.fc1_{g,x}.weight [h, D]    -> mlp/fc1/kernel [D, 2, h], index 0 = g (SwiGLU)
  blocks.i.mlp.norm.{weight,bias} [h]     -> mlp/norm/{scale,bias}           (EVA-02's scale_mlp)
  blocks.i.mlp.fc2.weight [D, h]          -> mlp/fc2/kernel [h, D]           (.bias -> /bias)
  norm.{weight,bias}                      -> norm/{scale,bias}

With k = global_attention_every, block i = s*k + l is slice [s, l] of the
scanned `stages/windowed/...` stacks for l < k - 1 and slice [s] of
`stages/global/...` for l = k - 1 (`stage{s}/windowed{l}/...` and
`stage{s}/global/...` when not scanned). The head count, the stacking and the
grid are config values no tensor of the file holds, so a ViT is mapped when it
is loaded into a model's parameters, not when it is converted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from detector.errors import WeightsFileError
from detector.models.weights.canonical import PATCH_EMBEDDING, ROPE_PERIODS, timm_position_grid
from detector.models.weights.files import describe_names
from detector.models.weights.sources import canonical_vit_state_dict
from detector.models.weights.vit_checks import (
    VitFamily,
    VitSize,
    check_rope_periods,
    check_vit_file,
    family_hint,
    timm_vit_size,
    vit_family,
)


def _same(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    return tensor


def _transposed(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    return tensor.T


def _qkv_kernel(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # torch's Linear weight is [out, in]; timm orders qkv's outputs (q|k|v, head, head_dim).
    return weight.T.reshape(weight.shape[1], 3, num_heads, -1)


def _qkv_bias(bias: np.ndarray, num_heads: int) -> np.ndarray:
    return bias.reshape(3, num_heads, -1)


def _out_kernel(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # timm concatenates the heads' outputs head by head before `proj`.
    return weight.T.reshape(num_heads, -1, weight.shape[0])


def _gated_kernel(weights: tuple[np.ndarray, np.ndarray], num_heads: int) -> np.ndarray:
    # (fc1_g, fc1_x) [hidden, D] each -> [D, 2, hidden], index 0 the gate.
    return np.stack([w.T for w in weights], axis=1)


def _gated_bias(biases: tuple[np.ndarray, np.ndarray], num_heads: int) -> np.ndarray:
    return np.stack(biases)


# Inside a block: our parameter -> (canonical tensor(s) under `blocks.{i}.`, conversion given the head count).
_VIT_BLOCK_TENSORS = {
    "norm1/scale": ("norm1.weight", _same),
    "norm1/bias": ("norm1.bias", _same),
    "attn/qkv/kernel": ("attn.qkv.weight", _qkv_kernel),
    "attn/qkv/bias": ("attn.qkv.bias", _qkv_bias),  # or q_bias/v_bias: see `_qkv_bias_value`
    "attn/out/kernel": ("attn.proj.weight", _out_kernel),
    "attn/out/bias": ("attn.proj.bias", _same),
    "ls1": ("ls1.gamma", _same),
    "norm2/scale": ("norm2.weight", _same),
    "norm2/bias": ("norm2.bias", _same),
    "mlp/fc1/kernel": ("mlp.fc1.weight", _transposed),
    "mlp/fc1/bias": ("mlp.fc1.bias", _same),
    "mlp/norm/scale": ("mlp.norm.weight", _same),
    "mlp/norm/bias": ("mlp.norm.bias", _same),
    "mlp/fc2/kernel": ("mlp.fc2.weight", _transposed),
    "mlp/fc2/bias": ("mlp.fc2.bias", _same),
    "ls2": ("ls2.gamma", _same),
}
_SWIGLU_BLOCK_TENSORS = {
    "mlp/fc1/kernel": (("mlp.fc1_g.weight", "mlp.fc1_x.weight"), _gated_kernel),
    "mlp/fc1/bias": (("mlp.fc1_g.bias", "mlp.fc1_x.bias"), _gated_bias),
}
# The ViT's parameters outside its blocks; the first two and the final norm always exist.
_VIT_TRUNK_PARAMS = (
    "patch_embed/kernel",
    "patch_embed/bias",
    "pos_embed",
    "class_pos_embed",
    "cls_token",
    "reg_token",
    "norm/scale",
    "norm/bias",
)
_SCANNED_BLOCK_PARAM = re.compile(r"^stages/(windowed|global)/(.+)$")
_UNSCANNED_BLOCK_PARAM = re.compile(r"^stage(\d+)/(?:windowed(\d+)|global)/(.+)$")


def _leaf_shape(leaf) -> tuple[int, ...]:
    # A boxed (logically partitioned) leaf's value; unboxing with its constraint would need a mesh.
    value = leaf.unbox(apply_constraint=False) if isinstance(leaf, nn.meta.AxisMetadata) else leaf
    return tuple(value.shape)


@dataclasses.dataclass(frozen=True)
class _VitModelLayout:
    size: VitSize
    family: VitFamily
    num_heads: int
    grid: tuple[int, int] | None  # the position embedding's
    # Each block parameter -> (its name inside a block, the canonical block index of each of its stacked slices).
    blocks: dict[str, tuple[str, np.ndarray]]


def _vit_model_layout(shapes: Mapping[str, tuple[int, ...]]) -> _VitModelLayout:
    """Reads how `detector.models.vit.ViT` placed its blocks from its flat parameter shapes (scanned or not).

    LoRA adapters (`lora_a`, `lora_b`) are no pretrained tensors' and are left out.
    """
    scanned, unscanned, unknown = {}, {}, []
    for name in shapes:
        if name in _VIT_TRUNK_PARAMS or name.rsplit("/", 1)[-1].startswith("lora_"):
            continue
        if (match := _SCANNED_BLOCK_PARAM.match(name)) and match[2] in _VIT_BLOCK_TENSORS:
            scanned[name] = (match[1] == "windowed", match[2])
        elif (match := _UNSCANNED_BLOCK_PARAM.match(name)) and match[3] in _VIT_BLOCK_TENSORS:
            unscanned[name] = (int(match[1]), None if match[2] is None else int(match[2]), match[3])
        else:
            unknown.append(name)
    lacking = [name for name in ("patch_embed/kernel", "patch_embed/bias") if name not in shapes]
    if ("norm/scale" in shapes) != ("norm/bias" in shapes):
        lacking.append("norm/bias" if "norm/scale" in shapes else "norm/scale")
    if unknown or lacking or not (scanned or unscanned):
        raise WeightsFileError(
            "the model's ViT is not laid out as this importer expects (detector.models.vit.ViT): "
            f"parameters no pretrained tensor maps to: {describe_names(unknown) or 'none'}; "
            f"lacking: {describe_names(lacking) or 'none'}"
        )
    blocks = {}
    if scanned:
        num_stages = next(shapes[name][0] for name in scanned)
        windowed = [shapes[name][1] for name, (is_windowed, _) in scanned.items() if is_windowed]
        layers = windowed[0] if windowed else 0
        every = layers + 1
        for name, (is_windowed, inner) in scanned.items():
            stages = np.arange(num_stages) * every
            index = stages[:, None] + np.arange(layers) if is_windowed else stages + layers
            blocks[name] = (inner, index)
    else:
        num_stages = 1 + max(stage for stage, _, _ in unscanned.values())
        layers = 1 + max((layer for _, layer, _ in unscanned.values() if layer is not None), default=-1)
        every = layers + 1
        for name, (stage, layer, inner) in unscanned.items():
            blocks[name] = (inner, np.array(stage * every + (layers if layer is None else layer)))
    for name, (_, index) in blocks.items():
        if shapes[name][: index.ndim] != index.shape:
            raise WeightsFileError(
                f"the model's ViT parameter {name} has shape {shapes[name]}; stacks of {index.shape}"
            )

    def block_shape(inner: str) -> tuple[int, ...] | None:
        found = [(shapes[name], index) for name, (i, index) in blocks.items() if i == inner]
        return tuple(found[0][0][found[0][1].ndim :]) if found else None

    qkv, fc1 = block_shape("attn/qkv/kernel"), block_shape("mlp/fc1/kernel")
    inner_names = {inner for inner, _ in blocks.values()}
    reg = shapes.get("reg_token")
    family = VitFamily(
        class_token="cls_token" in shapes,
        register_tokens=reg[1] if reg else 0,
        absolute_position="pos_embed" in shapes,
        layer_scale="ls1" in inner_names,
        mlp="swiglu" if len(fc1) == 3 else "gelu",
        mlp_norm="mlp/norm/scale" in inner_names,
        qkv_bias="bias" if "attn/qkv/bias" in inner_names else "none",
        final_norm="norm/scale" in shapes,
    )
    return _VitModelLayout(
        size=VitSize(
            depth=num_stages * every,
            width=shapes["patch_embed/kernel"][-1],
            mlp_hidden=fc1[-1],
            patch_size=shapes["patch_embed/kernel"][0],
        ),
        family=family,
        num_heads=qkv[-2],
        grid=tuple(shapes["pos_embed"][1:3]) if "pos_embed" in shapes else None,
        blocks=blocks,
    )


def resize_position_embedding(pos_embed: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """`[1, G, G', D]` -> `[1, grid[0], grid[1], D]` float32, resampled as `ViT` resamples it to an input's grid.

    `jax.image.resize(method='bicubic')`: Keys' cubic kernel (a = -0.5) on
    half-pixel centres (align_corners=False), widened to antialias when
    shrinking, taps beyond the grid dropped and the rest renormalised. That is
    torch's `F.interpolate(mode='bicubic', align_corners=False,
    antialias=True)`, timm's `resample_abs_pos_embed` default (and
    transformers' Dinov2WithRegisters'); ViTDet's `get_abs_pos` and
    transformers' Dinov2Model use antialias=False (a = -0.75, edges
    repeated), slightly different. The model's forward pass resizes with
    this one, so loading does too.
    """
    if tuple(pos_embed.shape[1:3]) == tuple(grid):
        return np.asarray(pos_embed, np.float32)
    # On the host: a few thousand values, before any sharded computation exists.
    on_host = jax.device_put(np.asarray(pos_embed, np.float32), jax.devices("cpu")[0])
    return np.asarray(jax.image.resize(on_host, (1, *grid, pos_embed.shape[-1]), method="bicubic"), np.float32)


def _qkv_bias_value(tensors: Mapping[str, np.ndarray], block: str, num_heads: int, qkv_bias: str) -> np.ndarray:
    """`attn/qkv/bias [3, H, Dh]` from `attn.qkv.bias`, or from q_bias/v_bias with k's zero."""
    if f"{block}attn.qkv.bias" in tensors:
        bias = tensors[f"{block}attn.qkv.bias"].reshape(3, -1)
        if qkv_bias == "qv" and np.any(bias[1]):
            raise WeightsFileError(
                f"{block}attn.qkv.bias has a non-zero k part, which model.backbone.qkv_bias='qv' masks out: "
                "set qkv_bias='all'"
            )
        return _qkv_bias(bias.ravel(), num_heads)
    q, v = tensors[f"{block}attn.q_bias"], tensors[f"{block}attn.v_bias"]
    return _qkv_bias(np.concatenate([q, np.zeros_like(q), v]), num_heads)


def convert_timm_vit(
    state_dict: Mapping[str, Any], backbone_params, backbone_config: Mapping[str, Any] | None = None
) -> dict:
    """A ViT state dict (any layout of `canonical_vit_state_dict`) -> values for `backbone_params`, a `ViT`'s
    parameters (initialised or abstract), LoRA adapters left out.

    The model's parameters tell what the file cannot: the head count (how
    qkv and proj split), which blocks are windowed and how `nn.scan` stacks
    them, the position embedding's grid, to which `pos_embed` is resized
    (`resize_position_embedding`) when its own differs, and whether the model
    has class and register tokens: without them the file's are dropped, as
    intended for windowed attention. `backbone_config` (`config.model.backbone`),
    when given, adds what no parameter shows: the RoPE kind and temperature,
    checked against RoPE periods in the file, and qkv_bias 'all' vs 'qv'.
    Returns a nested dict of float32 numpy arrays shaped like
    `backbone_params` (the table in this module's docstring). Raises
    WeightsFileError naming missing, unexpected or misshapen tensors, with
    the config keys that make the model fit the file.
    """
    flat = traverse_util.flatten_dict(backbone_params, sep="/")
    shapes = {name: _leaf_shape(leaf) for name, leaf in flat.items()}
    model = _vit_model_layout(shapes)
    tensors = canonical_vit_state_dict(state_dict)
    model_family = model.family
    if backbone_config is not None and model_family.qkv_bias == "bias":
        model_family = dataclasses.replace(model_family, qkv_bias=backbone_config.get("qkv_bias", "all"))
    file_size, file_family = timm_vit_size(tensors), vit_family(tensors)
    # What the model deliberately goes without: the file's prefix tokens and their position.
    dropped = set()
    if not model_family.class_token:
        dropped |= {"cls_token", "class_pos_embed"}
    elif not model_family.absolute_position:
        dropped.add("class_pos_embed")
    if not model_family.register_tokens:
        dropped.add("reg_token")
    kept = {name: value for name, value in tensors.items() if name not in dropped}
    # A file with q/v-only biases loads into an 'all' model (k bias 0), one with a zero k bias into a 'qv' model.
    if model_family.qkv_bias == "none" or file_family.qkv_bias == "none":
        bias = "none" if model_family.qkv_bias == "none" else "all"
    else:
        bias = file_family.qkv_bias
    hint = family_hint(file_size, file_family, model.size, model_family)
    check_vit_file(
        kept, model.size, dataclasses.replace(model_family, qkv_bias=bias), f"the model's ViT ({model.size})", hint
    )
    if ROPE_PERIODS in kept:
        check_rope_periods(kept[ROPE_PERIODS], backbone_config, model.size.width // model.num_heads)
    if backbone_config is not None and not backbone_config.get("rope") and not file_family.absolute_position:
        raise WeightsFileError(
            "the file has no position embedding (a RoPE ViT such as DINOv3) but model.backbone.rope='': "
            "set rope='dinov3', rope_temperature=100.0, absolute_position=False"
        )

    params = {
        "patch_embed/kernel": kept[PATCH_EMBEDDING].transpose(2, 3, 1, 0),
        "patch_embed/bias": kept["patch_embed.proj.bias"],
    }
    if model_family.final_norm:
        params.update({"norm/scale": kept["norm.weight"], "norm/bias": kept["norm.bias"]})
    if model.grid is not None:
        side, _ = timm_position_grid(kept)
        pos_embed = kept["pos_embed"].reshape(1, side, side, model.size.width)
        params["pos_embed"] = resize_position_embedding(pos_embed, model.grid)
    if model_family.class_token:
        params["cls_token"] = kept["cls_token"]
        if "class_pos_embed" in shapes:
            # timm's DINOv2-with-registers adds no position to its class token: zeros compute the same.
            params["class_pos_embed"] = kept.get("class_pos_embed", np.zeros(shapes["class_pos_embed"], np.float32))
    if model_family.register_tokens:
        params["reg_token"] = kept["reg_token"]
    for name, (inner, index) in model.blocks.items():
        canonical, convert = (
            _SWIGLU_BLOCK_TENSORS[inner]
            if model_family.mlp == "swiglu" and inner in _SWIGLU_BLOCK_TENSORS
            else _VIT_BLOCK_TENSORS[inner]
        )
        slices = []
        for i in index.ravel():
            block = f"blocks.{i}."
            if inner == "attn/qkv/bias":
                slices.append(_qkv_bias_value(kept, block, model.num_heads, model_family.qkv_bias))
            elif isinstance(canonical, tuple):
                slices.append(convert(tuple(kept[block + c] for c in canonical), model.num_heads))
            else:
                slices.append(convert(kept[block + canonical], model.num_heads))
        params[name] = np.stack(slices).reshape(shapes[name])
    return traverse_util.unflatten_dict({name: np.ascontiguousarray(value) for name, value in params.items()}, sep="/")

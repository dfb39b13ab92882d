"""What a canonical ViT state dict declares, its size and family, and the checks that it fits a model, with the fix.

Every tensor of a file is used or deliberately dropped: its source's
ignored tensors always; the class token with its position entry and the
register tokens when the model has none (ViTDet-style windowed blocks
cannot carry prefix tokens). `rope.periods` is checked against the model's
own formula (`vit.rope_angles`: temperature ** (i / n)) and dropped: other
periods would load another network. Anything else the model does not use
is a WeightsFileError naming it and the config key that makes the model
fit (`layer_scale`, `mlp`, `mlp_norm`, `qkv_bias`, `absolute_position`,
`register_tokens`, `patch_size`, `final_norm`, ...). A file without
`norm.*` (timm's average-pooling ViTs, EVA-02 as registered, keep `fc_norm`
instead, which normalises the pooled vector only) computes its features
with no final normalisation: it loads into a model with `final_norm=False`
only, which has none either. No tensor holds the LayerNorm epsilon (DINOv3:
`norm_epsilon=1e-5`) or the RoPE kind of files without RoPE buffers
(DINOv3: `rope='dinov3'`, `rope_temperature=100`; EVA-02: `rope='eva02'`,
`rope_reference_grid=16`): the config sets them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from detector.errors import WeightsFileError
from detector.models.weights.canonical import BLOCK_KEY, PATCH_EMBEDDING, ROPE_PERIODS, timm_position_grid
from detector.models.weights.files import describe_names
from detector.models.weights.sources import patch_embedding_names

# The head count shapes no tensor (qkv is [3D, D] however it is split), so
# the converter can only name it for timm's standard sizes: (width, depth) -> (name, heads).
STANDARD_VITS = {
    (192, 12): ("ViT-Ti", 3),
    (384, 12): ("ViT-S", 6),
    (768, 12): ("ViT-B", 12),
    (1024, 24): ("ViT-L", 16),
    (1280, 32): ("ViT-H", 16),
    (1536, 40): ("ViT-g", 24),
    (4096, 40): ("ViT-7B", 32),
}
VITDET_CONFIGS = {
    "ViT-B": "configs/vitdet_b_coco.py",
    "ViT-L": "configs/vitdet_l_coco.py",
    "ViT-H": "configs/vitdet_h_coco.py",
}


@dataclasses.dataclass(frozen=True)
class VitSize:
    """What fixes a ViT's tensor shapes: blocks, model width, MLP hidden units, patch side in pixels."""

    depth: int
    width: int
    mlp_hidden: int
    patch_size: int

    def __str__(self) -> str:
        return f"depth {self.depth}, width {self.width}, MLP {self.mlp_hidden}, patch {self.patch_size}"


@dataclasses.dataclass(frozen=True)
class VitFamily:
    """What a ViT's tensors say of its architecture beyond its size, with the config key of each field."""

    class_token: bool = False
    register_tokens: int = 0
    absolute_position: bool = True
    layer_scale: bool = False
    mlp: str = "gelu"
    mlp_norm: bool = False
    qkv_bias: str = "all"  # 'all', 'qv', 'none'; a model's is 'bias' when its config is not known
    final_norm: bool = True  # a LayerNorm `norm` after the last block

    def config_keys(self) -> str:
        """`class_token=True, register_tokens=4, ...`: the config values for this family (all of them)."""
        return ", ".join(
            [
                f"class_token={self.class_token}",
                f"register_tokens={self.register_tokens}",
                f"absolute_position={self.absolute_position}",
                f"layer_scale={'1e-05' if self.layer_scale else '0.0'}",
                f"mlp={self.mlp!r}",
                f"mlp_norm={self.mlp_norm}",
                f"qkv_bias={self.qkv_bias!r}",
                f"final_norm={self.final_norm}",
            ]
        )


def _vit_shapes(size: VitSize, family: VitFamily) -> dict[str, tuple[int, ...]]:
    """The canonical tensor shapes of a ViT, without `pos_embed`/`class_pos_embed` (grid-sized)."""
    d, hidden = size.width, size.mlp_hidden
    block = {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d)}
    if family.qkv_bias in ("all", "bias"):
        block["attn.qkv.bias"] = (3 * d,)
    elif family.qkv_bias == "qv":
        block.update({"attn.q_bias": (d,), "attn.v_bias": (d,)})
    block.update({"attn.proj.weight": (d, d), "attn.proj.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,)})
    if family.mlp == "swiglu":
        for part in ("fc1_g", "fc1_x"):
            block.update({f"mlp.{part}.weight": (hidden, d), f"mlp.{part}.bias": (hidden,)})
    else:
        block.update({"mlp.fc1.weight": (hidden, d), "mlp.fc1.bias": (hidden,)})
    if family.mlp_norm:
        block.update({"mlp.norm.weight": (hidden,), "mlp.norm.bias": (hidden,)})
    block.update({"mlp.fc2.weight": (d, hidden), "mlp.fc2.bias": (d,)})
    if family.layer_scale:
        block.update({"ls1.gamma": (d,), "ls2.gamma": (d,)})
    shapes = {PATCH_EMBEDDING: (d, 3, size.patch_size, size.patch_size), "patch_embed.proj.bias": (d,)}
    if family.class_token:
        shapes["cls_token"] = (1, 1, d)
    if family.register_tokens:
        shapes["reg_token"] = (1, family.register_tokens, d)
    for i in range(size.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def timm_vit_size(state_dict: Mapping[str, Any]) -> VitSize:
    """The size a canonical ViT state dict declares: width and patch from `patch_embed.proj.weight`,
    depth from the `blocks.{i}.` names, MLP width from block 0's fc1 (or fc1_g; 4 x width without either)."""
    if PATCH_EMBEDDING not in state_dict:
        raise WeightsFileError(
            f"not a ViT state dict: it has no {patch_embedding_names()} (names: {describe_names(state_dict)})"
        )
    shape = tuple(np.shape(state_dict[PATCH_EMBEDDING]))
    if len(shape) != 4 or shape[2] != shape[3]:
        raise WeightsFileError(f"{PATCH_EMBEDDING} has shape {shape}; a ViT's is [width, 3, patch, patch]")
    blocks = [int(match[1]) for name in state_dict if (match := BLOCK_KEY.match(name))]
    fc1 = state_dict.get("blocks.0.mlp.fc1.weight", state_dict.get("blocks.0.mlp.fc1_g.weight"))
    return VitSize(
        depth=max(blocks) + 1 if blocks else 0,
        width=shape[0],
        mlp_hidden=int(np.shape(fc1)[0]) if fc1 is not None and np.ndim(fc1) == 2 else 4 * shape[0],
        patch_size=shape[2],
    )


def vit_family(tensors: Mapping[str, Any]) -> VitFamily:
    """The family a canonical ViT state dict declares, read from its trunk and block 0's names."""
    reg = tensors.get("reg_token")
    if "blocks.0.attn.qkv.bias" in tensors:
        qkv_bias = "all"
    elif "blocks.0.attn.q_bias" in tensors or "blocks.0.attn.v_bias" in tensors:
        qkv_bias = "qv"
    else:
        qkv_bias = "none"
    return VitFamily(
        class_token="cls_token" in tensors,
        register_tokens=int(np.shape(reg)[1]) if reg is not None and np.ndim(reg) == 3 else 0,
        absolute_position="pos_embed" in tensors,
        layer_scale="blocks.0.ls1.gamma" in tensors,
        mlp="swiglu" if "blocks.0.mlp.fc1_g.weight" in tensors else "gelu",
        mlp_norm="blocks.0.mlp.norm.weight" in tensors,
        qkv_bias=qkv_bias,
        final_norm="norm.weight" in tensors or "norm.bias" in tensors,
    )


def rope_temperature_of(periods: np.ndarray, head_dim: int | None = None) -> float:
    """The temperature T of periods `T ** (i / n)`, i < n (DINOv3's schedule), or WeightsFileError if they are not."""
    periods = np.asarray(periods, np.float64).ravel()
    n = periods.size
    if n < 2 or (head_dim is not None and n != head_dim // 4) or np.any(periods <= 0):
        raise WeightsFileError(
            f"{ROPE_PERIODS} (RoPE periods) has {n} values; a ViT with head width {head_dim} has head_dim / 4"
        )
    temperature = float(periods[1] ** n)
    expected = temperature ** (np.arange(n) / n)
    if not np.allclose(periods, expected, rtol=1e-5, atol=0):
        raise WeightsFileError(
            f"{ROPE_PERIODS} (RoPE periods) are not temperature ** (i / {n}) for any temperature: a RoPE "
            "this model does not compute"
        )
    return temperature


def check_rope_periods(periods: np.ndarray, backbone_config: Mapping[str, Any] | None, head_dim: int) -> None:
    """The file's RoPE periods against the model's own formula (`rope_angles`), when the config says which."""
    temperature = rope_temperature_of(periods, head_dim)
    if backbone_config is None:
        return
    if backbone_config.get("rope", "") != "dinov3":
        raise WeightsFileError(
            f"the file holds DINOv3 RoPE periods ({ROPE_PERIODS}, temperature {temperature:g}) but "
            f"model.backbone.rope={backbone_config.get('rope', '')!r}: set rope='dinov3', "
            f"rope_temperature={temperature:g}, absolute_position=False"
        )
    expected = float(backbone_config.get("rope_temperature", 10000.0)) ** (np.arange(head_dim // 4) / (head_dim // 4))
    if not np.allclose(np.asarray(periods, np.float64), expected, rtol=1e-5, atol=0):
        raise WeightsFileError(
            f"the file's RoPE periods ({ROPE_PERIODS}) are those of temperature {temperature:g}, the model's "
            f"model.backbone.rope_temperature={backbone_config.get('rope_temperature')}: set it to {temperature:g}"
        )


def family_hint(file_size: VitSize, file_family: VitFamily, model_size: VitSize, model_family: VitFamily) -> str:
    """'set model.backbone.X=..., Y=...' for what differs between the file and the model, or ''."""
    if file_size != model_size:
        name = STANDARD_VITS.get((file_size.width, file_size.depth), ("",))[0]
        config = f" ({VITDET_CONFIGS[name]} is {name})" if name in VITDET_CONFIGS else ""
        hint = (
            f"the file is a ViT of {file_size}: set model.backbone.depth/embed_dim/num_heads/mlp_ratio "
            f"(or mlp_hidden) to its size{config}, or use weights of the model's size"
        )
        if file_size.patch_size != model_size.patch_size:
            hint += f"; set model.backbone.patch_size={file_size.patch_size}"
        return hint
    keys = []
    if model_family.class_token and not file_family.class_token:
        keys.append("class_token=False (the file has no cls_token)")
    if model_family.register_tokens and model_family.register_tokens != file_family.register_tokens:
        keys.append(f"register_tokens={file_family.register_tokens}")
    if model_family.absolute_position != file_family.absolute_position:
        rope = "" if file_family.absolute_position else " (no pos_embed: a RoPE ViT such as DINOv3, rope='dinov3')"
        keys.append(f"absolute_position={file_family.absolute_position}{rope}")
    if model_family.layer_scale != file_family.layer_scale:
        keys.append(f"layer_scale={'1e-05 (any value: the file sets it)' if file_family.layer_scale else '0.0'}")
    if model_family.mlp != file_family.mlp:
        keys.append(f"mlp={file_family.mlp!r}")
    if model_family.mlp_norm != file_family.mlp_norm:
        keys.append(f"mlp_norm={file_family.mlp_norm}")
    if (model_family.qkv_bias == "none") != (file_family.qkv_bias == "none"):
        keys.append(f"qkv_bias={file_family.qkv_bias!r}")
    if model_family.final_norm != file_family.final_norm:
        keys.append(
            "final_norm=False (the file has no norm.*: its source does not normalise the last block's tokens)"
            if model_family.final_norm
            else "final_norm=True (the file has a final norm.*)"
        )
    return f"the file's ViT differs from the model's: set model.backbone.{', '.join(keys)}" if keys else ""


# Canonical tensor names -> the config key that makes a model have (or not have) them; every source's
# names are canonical by the time they are checked, so these serve all of them.
_TENSOR_HINTS = (
    (re.compile(r"\.ls[12]\.gamma$"), "LayerScale (ls1/ls2.gamma) needs model.backbone.layer_scale > 0, e.g. 1e-5"),
    (re.compile(r"\.mlp\.fc1_[gx]\."), "a gated MLP (fc1_g/fc1_x) needs model.backbone.mlp='swiglu'"),
    (re.compile(r"\.mlp\.norm\."), "a norm over the MLP's hidden units needs model.backbone.mlp_norm=True"),
    (
        re.compile(r"\.attn\.(qkv\.bias|[qv]_bias)$"),
        "qkv biases are set by model.backbone.qkv_bias ('all', 'qv', 'none')",
    ),
    (re.compile(r"^pos_embed$"), "a position embedding needs model.backbone.absolute_position=True"),
    (re.compile(r"rope"), "a RoPE buffer this importer does not recompute (it knows DINOv3's periods)"),
)


def _tensor_hint(names: Iterable[str]) -> str:
    """What the config keys say about these tensor names, or that the file is incomplete."""
    hints = []
    for pattern, hint in _TENSOR_HINTS:
        if any(pattern.search(name) for name in names) and hint not in hints:
            hints.append(hint)
    return "; ".join(hints) or "every block needs the same tensors; is the file complete?"


def check_vit_file(tensors: Mapping[str, Any], size: VitSize, family: VitFamily, fits: str, hint: str) -> None:
    """Raises WeightsFileError unless canonical `tensors` hold exactly a ViT of `size` and `family`.

    `fits` names what they should fit in the message; `hint` is its fix, or '' for the hints of the
    tensors' names.
    """
    expected: dict[str, tuple[int, ...] | None] = dict(_vit_shapes(size, family))
    if family.absolute_position:
        expected["pos_embed"] = None
        if "pos_embed" in tensors:
            side, _ = timm_position_grid(tensors)
            expected["pos_embed"] = (1, side * side, size.width)
    if "class_pos_embed" in tensors and family.class_token and family.absolute_position:
        expected["class_pos_embed"] = (1, 1, size.width)
    if family.final_norm:
        expected.update({"norm.weight": (size.width,), "norm.bias": (size.width,)})
    if ROPE_PERIODS in tensors:
        expected[ROPE_PERIODS] = tuple(np.shape(tensors[ROPE_PERIODS]))
    present = set(tensors)
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    misshapen = [
        f"{name} {tuple(np.shape(tensors[name]))} for {expected[name]}"
        for name in sorted(set(expected) & present)
        if expected[name] is not None and tuple(np.shape(tensors[name])) != expected[name]
    ]
    if missing or unexpected or misshapen:
        problems = [
            f"{len(missing)} missing ({describe_names(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({describe_names(unexpected)})" if unexpected else "",
            f"{len(misshapen)} misshapen ({describe_names(misshapen)})" if misshapen else "",
        ]
        hint = hint or _tensor_hint(unexpected + missing)
        raise WeightsFileError(
            f"the state dict does not fit {fits}: {'; '.join(p for p in problems if p)} tensors; {hint}"
        )

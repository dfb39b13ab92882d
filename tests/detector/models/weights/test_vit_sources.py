"""ViT checkpoint sources: one-line errors for a file that does not fit, foundation layouts, sources told apart.

State dicts are built with each source's names and random values (numpy: no torch needed).
"""

from __future__ import annotations

import re

import flax.linen as nn
import numpy as np
import pytest
from flax import traverse_util

from configs import default, vitdet_b_coco
from detector.errors import WeightsFileError
from detector.models import families, weights
from detector.models.retinanet import create_model
from detector.models.vit import ViT
from tests.helpers.foundation_vit import dinov3_options
from tests.helpers.vit_checkpoints import (
    HEADS,
    WIDTH,
    abstract_params,
    timm_vit_shapes,
    timm_vit_state_dict,
    tiny_vit,
    zeros_without_memory,
)

# ---- errors: one line each, naming the tensors and the fix ----


def load_error(tmp_path, state, model=None) -> str:
    np.savez(tmp_path / "vit.npz", **state)
    params = {"backbone": abstract_params(model or tiny_vit())}
    with pytest.raises(WeightsFileError) as error:
        weights.load_backbone_params(params, tmp_path / "vit.npz")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'vit.npz'}: ")
    return message


def test_missing_tensor_is_named(tmp_path):
    state = timm_vit_state_dict()
    del state["blocks.2.attn.qkv.bias"]
    message = load_error(tmp_path, state)
    assert (
        "the model's ViT (depth 4, width 64, MLP 256, patch 16): 1 missing (blocks.2.attn.qkv.bias) tensors" in message
    )
    assert "model.backbone.qkv_bias ('all', 'qv', 'none')" in message
    assert "unexpected" not in message and "misshapen" not in message

    state = timm_vit_state_dict()
    del state["norm.bias"]  # a final norm is optional, but not half of one
    assert "1 missing (norm.bias) tensors" in load_error(tmp_path, state)


def test_unexpected_tensor_is_named(tmp_path):
    state = timm_vit_state_dict()
    state["blocks.1.ls1.gamma"] = np.ones(WIDTH, np.float32)  # DINOv2's LayerScale
    message = load_error(tmp_path, state)
    assert (
        "1 unexpected (blocks.1.ls1.gamma) tensors; LayerScale (ls1/ls2.gamma) needs model.backbone.layer_scale"
        in message
    )
    # Skipped tensors are not reported.
    assert "cls_token" not in message and "head." not in message and "missing" not in message


@pytest.mark.parametrize(
    "file,expected",
    [
        (
            dict(depth=6),
            "24 unexpected (blocks.4.attn.proj.bias, blocks.4.attn.proj.weight, blocks.4.attn.qkv.bias, "
            "blocks.4.attn.qkv.weight, blocks.4.mlp.fc1.bias and 19 more) tensors; "
            "the file is a ViT of depth 6, width 64, MLP 256, patch 16: set model.backbone.depth",
        ),
        (
            dict(width=96),
            # All of it: 2 patch embedding + pos_embed + 4 x 12 block tensors + 2 norm.
            "53 misshapen (blocks.0.attn.proj.bias (96,) for (64,), blocks.0.attn.proj.weight (96, 96) for "
            "(64, 64), blocks.0.attn.qkv.bias (288,) for (192,), ",
        ),
        (
            dict(patch=14),
            "1 misshapen (patch_embed.proj.weight (64, 3, 14, 14) for (64, 3, 16, 16)) tensors; the file is a ViT "
            "of depth 4, width 64, MLP 256, patch 14",
        ),
    ],
    ids=["deeper", "wider", "patch14"],
)
def test_misshapen_file_is_named_with_the_fix(tmp_path, file, expected):
    message = load_error(tmp_path, timm_vit_state_dict(**file))
    assert expected in message
    assert "model.backbone.depth/embed_dim/num_heads/mlp_ratio" in message
    if "patch" in file:
        assert message.endswith("set model.backbone.patch_size=14")


def test_vit_l_file_into_vit_b_model_names_the_config(tmp_path):
    state = zeros_without_memory(timm_vit_shapes(1024, 24, 14))
    config = vitdet_b_coco.get_config()
    model = create_model(config.model, 80, families.num_anchors_per_location(config))
    with pytest.raises(WeightsFileError) as error:
        weights.convert_timm_vit(state, abstract_params(model, (224, 224))["backbone"])
    message = str(error.value)
    assert message.startswith("the state dict does not fit the model's ViT (depth 12, width 768, MLP 3072, patch 16)")
    assert "144 unexpected (blocks.12." in message and "misshapen" in message
    assert "the file is a ViT of depth 24, width 1024, MLP 4096, patch 16" in message
    assert "(configs/vitdet_l_coco.py is ViT-L)" in message


def test_not_a_vit_file(tmp_path):
    resnet_like = {"conv1.weight": np.zeros((8, 3, 7, 7), np.float32), "bn1.weight": np.ones(8, np.float32)}
    message = load_error(tmp_path, resnet_like)
    assert (
        "not a ViT state dict (no patch_embed.proj.weight, embeddings.patch_embeddings.projection.weight or " in message
    )
    assert "names: bn1.weight, conv1.weight)" in message

    np.savez(tmp_path / "vit.npz", **timm_vit_state_dict())
    config = default.get_config()  # a ResNet
    model = create_model(config.model, 3, families.num_anchors_per_location(config))
    with pytest.raises(WeightsFileError, match=r"holds a ViT \(timm layout\) but the model's backbone is a ResNet"):
        weights.load_backbone_params(abstract_params(model, (64, 64)), tmp_path / "vit.npz")

    state = timm_vit_state_dict()
    state["pos_embed"] = state["pos_embed"][:, :51]  # neither 7 x 7 + 1 nor a square
    assert "pos_embed has shape (1, 51, 64); timm's is [1, G*G, width] or [1, 1 + G*G, width]" in load_error(
        tmp_path, state
    )


def test_converter_checks_the_file_on_its_own(tmp_path):
    state = timm_vit_state_dict()
    state["blocks.3.attn.rope.freqs"] = np.ones(8, np.float32)  # EVA-02-like
    del state["blocks.0.mlp.fc2.bias"]
    np.savez(tmp_path / "eva.npz", **state)
    with pytest.raises(WeightsFileError) as error:
        weights.convert_pretrained_file(tmp_path / "eva.npz", tmp_path / "out.npz")
    assert str(error.value).startswith(
        f"{tmp_path / 'eva.npz'}: the state dict does not fit a ViT of depth 4, width 64, MLP 256, patch 16 "
        "(read from patch_embed.proj.weight and blocks.*): 1 missing (blocks.0.mlp.fc2.bias); "
        "1 unexpected (blocks.3.attn.rope.freqs) tensors"
    )
    assert not (tmp_path / "out.npz").exists()


# ---- foundation-backbone files (numpy state dicts: no torch needed) ----


def dinov3_like_state_dict(width=WIDTH, depth=2, head_dim=16, temperature=100.0, seed=0):
    """timm's DINOv3 layout (Eva: gamma_1/2, cls/reg tokens, no pos_embed, no qkv bias) plus Meta's RoPE periods."""
    state = timm_vit_state_dict(width=width, depth=depth, seed=seed)
    del state["pos_embed"]
    for i in range(depth):
        del state[f"blocks.{i}.attn.qkv.bias"]
        state[f"blocks.{i}.gamma_1"] = np.full(width, 0.3, np.float32)
        state[f"blocks.{i}.gamma_2"] = np.full(width, 0.3, np.float32)
    state["reg_token"] = np.zeros((1, 4, width), np.float32)
    state["rope_embed.periods"] = (temperature ** (np.arange(head_dim // 4) / (head_dim // 4))).astype(np.float32)
    return state


def dinov3_vit(**overrides):
    return ViT(**dinov3_options(WIDTH, 2, HEADS, **overrides))


def dinov3_config(vit):
    return {key: getattr(vit, key) for key in ("rope", "rope_temperature", "qkv_bias")}


def convert_error(state, vit, config=None) -> str:
    with pytest.raises(WeightsFileError) as error:
        weights.convert_timm_vit(state, abstract_params(vit), config)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_dinov3_file_loads_and_drops_prefix_tokens_only_when_the_model_has_none():
    state = dinov3_like_state_dict()
    vit = dinov3_vit()
    params = traverse_util.flatten_dict(
        weights.convert_timm_vit(state, abstract_params(vit), dinov3_config(vit)), sep="/"
    )
    np.testing.assert_array_equal(params["stages/global/ls1"][1], state["blocks.1.gamma_1"])
    assert params["reg_token"].shape == (1, 4, WIDTH)
    # Windowed: no prefix tokens; the file's cls_token and reg_token are dropped, not an error.
    windowed = dinov3_vit(global_attention_every=2, window_size=4, class_token=False, register_tokens=0)
    params = weights.convert_timm_vit(state, abstract_params(windowed), dinov3_config(windowed))
    assert "cls_token" not in params and "reg_token" not in params


def test_unused_layer_scale_names_the_tensor_and_the_config_key():
    message = convert_error(dinov3_like_state_dict(), dinov3_vit(layer_scale=0.0))
    assert "4 unexpected (blocks.0.ls1.gamma, blocks.0.ls2.gamma, blocks.1.ls1.gamma, blocks.1.ls2.gamma)" in message
    assert "set model.backbone.layer_scale=1e-05" in message


@pytest.mark.parametrize(
    "vit_overrides,file_overrides,expected",
    [
        (dict(register_tokens=2), {}, "misshapen (reg_token (1, 4, 64) for (1, 2, 64))"),
        (dict(register_tokens=2), {}, "set model.backbone.register_tokens=4"),
        (dict(qkv_bias="all"), {}, "set model.backbone.qkv_bias='none'"),
        (dict(absolute_position=True, rope="", pretrain_image_size=128), {}, "absolute_position=False (no pos_embed"),
        (dict(mlp="swiglu"), {}, "set model.backbone.mlp='gelu'"),
        (dict(rope_temperature=10000.0), {}, "temperature 100, the model's model.backbone.rope_temperature=10000.0"),
        (dict(), dict(temperature=100.0, head_dim=32), "RoPE periods) has 8 values; a ViT with head width 16"),
    ],
    ids=["registers_shape", "registers_key", "qkv_bias", "absolute", "mlp", "rope_temperature", "rope_width"],
)
def test_family_mismatch_is_one_line_naming_the_config_keys(vit_overrides, file_overrides, expected):
    vit = dinov3_vit(**vit_overrides)
    assert expected in convert_error(dinov3_like_state_dict(**file_overrides), vit, dinov3_config(vit))


def test_rope_periods_of_another_formula_are_refused():
    state = dinov3_like_state_dict()
    state["rope_embed.periods"] = np.linspace(1.0, 50.0, 4).astype(np.float32)
    assert "are not temperature ** (i / 4) for any temperature" in convert_error(state, dinov3_vit())
    vit = dinov3_vit(rope="")
    message = convert_error(dinov3_like_state_dict(), vit, dinov3_config(vit))
    assert "holds DINOv3 RoPE periods (rope.periods, temperature 100) but model.backbone.rope=''" in message


def test_transformers_dinov2_names_as_published_map_to_the_canonical_ones():
    """transformers' Dinov2 checkpoints on the hub (attention.attention.query, weights_in/out for ViT-g)."""
    rng = np.random.default_rng(0)
    d, h = 8, 12
    state = {
        "embeddings.cls_token": rng.standard_normal((1, 1, d)),
        "embeddings.mask_token": rng.standard_normal((1, d)),
        "embeddings.position_embeddings": rng.standard_normal((1, 5, d)),
        "embeddings.patch_embeddings.projection.weight": rng.standard_normal((d, 3, 14, 14)),
        "layernorm.weight": rng.standard_normal(d),
    }
    for part in ("query", "key", "value"):
        state[f"encoder.layer.0.attention.attention.{part}.weight"] = rng.standard_normal((d, d))
        state[f"encoder.layer.0.attention.attention.{part}.bias"] = rng.standard_normal(d)
    state["encoder.layer.0.attention.output.dense.weight"] = rng.standard_normal((d, d))
    state["encoder.layer.0.layer_scale1.lambda1"] = rng.standard_normal(d)
    state["encoder.layer.0.mlp.weights_in.weight"] = rng.standard_normal((2 * h, d))
    state["encoder.layer.0.mlp.weights_out.weight"] = rng.standard_normal((d, h))
    state = {name: value.astype(np.float32) for name, value in state.items()}
    assert weights.vit_layout(state) == "transformers Dinov2"  # not ViTModel's, whose patch embedding is the same
    canonical = weights.canonical_vit_state_dict(state)
    assert sorted(canonical) == sorted(
        [
            "cls_token",
            "pos_embed",
            "class_pos_embed",
            "patch_embed.proj.weight",
            "norm.weight",
            "blocks.0.attn.qkv.weight",
            "blocks.0.attn.qkv.bias",
            "blocks.0.attn.proj.weight",
            "blocks.0.ls1.gamma",
            "blocks.0.mlp.fc1_g.weight",
            "blocks.0.mlp.fc1_x.weight",
            "blocks.0.mlp.fc2.weight",
        ]
    )
    np.testing.assert_array_equal(
        canonical["blocks.0.attn.qkv.weight"][d : 2 * d], state["encoder.layer.0.attention.attention.key.weight"]
    )
    np.testing.assert_array_equal(
        canonical["blocks.0.mlp.fc1_x.weight"], state["encoder.layer.0.mlp.weights_in.weight"][h:]
    )
    np.testing.assert_array_equal(canonical["class_pos_embed"], state["embeddings.position_embeddings"][:, :1])
    assert weights.canonical_vit_state_dict(canonical).keys() == canonical.keys()  # canonical maps onto itself


# ---- transformers' ViTModel: a source added as one module and a registry line ----

# timm's block modules -> ViTModel's, as published (transformers 4) and as transformers 5 names them in memory.
_VIT_MODEL_BLOCKS = {
    "published": {
        "norm1": "layernorm_before",
        "norm2": "layernorm_after",
        "attn.qkv": "attention.attention.{}",
        "attn.proj": "attention.output.dense",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
    },
    "transformers 5": {
        "norm1": "layernorm_before",
        "norm2": "layernorm_after",
        "attn.qkv": "attention.{}_proj",
        "attn.proj": "attention.o_proj",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    },
}
_VIT_MODEL_TRUNK = {
    "cls_token": "embeddings.cls_token",
    "pos_embed": "embeddings.position_embeddings",
    "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias",
    "norm.weight": "layernorm.weight",
    "norm.bias": "layernorm.bias",
}


def vit_model_state_dict(timm_state, names="published"):
    """A timm-layout state dict in transformers' ViTModel names: qkv split into its thirds, ViTModel's pooler in
    place of timm's classifier (`head.*`), other names kept (so an unknown block tensor stays in its block)."""
    blocks = _VIT_MODEL_BLOCKS[names]
    layer, parts = ("encoder.layer", ("query", "key", "value")) if names == "published" else ("layers", "qkv")
    state = {}
    for name, value in timm_state.items():
        if name in _VIT_MODEL_TRUNK:
            state[_VIT_MODEL_TRUNK[name]] = value
        elif (match := re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", name)) and match[2] in blocks:
            i, module, kind = match.groups()
            if module == "attn.qkv":
                for part, third in zip(parts, np.split(value, 3)):
                    state[f"{layer}.{i}.{blocks[module].format(part)}.{kind}"] = third
            else:
                state[f"{layer}.{i}.{blocks[module]}.{kind}"] = value
        elif name.startswith("blocks."):
            state[f"{layer}.{name[len('blocks.') :]}"] = value
    width = timm_state["patch_embed.proj.weight"].shape[0]
    state["pooler.dense.weight"] = np.ones((width, width), np.float32)
    state["pooler.dense.bias"] = np.ones(width, np.float32)
    return state


def test_every_source_is_told_apart():
    """One name each; of the sources with the same patch embedding, all but one name what else tells them apart."""
    names = [source.name for source in weights.SOURCES]
    assert len(set(names)) == len(names)
    plain = [source.patch_embedding for source in weights.SOURCES if source.also_has is None]
    assert len(set(plain)) == len(plain)


@pytest.mark.parametrize("names", ["published", "transformers 5"], ids=["as_published", "transformers5"])
def test_transformers_vit_layout_loads_as_timm(tmp_path, names):
    timm_state = timm_vit_state_dict()
    state = vit_model_state_dict(timm_state, names)
    assert weights.vit_layout(state) == "transformers ViTModel"
    assert weights.ignored_vit_keys(state) == ["pooler.dense.bias", "pooler.dense.weight"]
    params = {"backbone": abstract_params(tiny_vit())}
    loaded = {}
    for layout, layout_state in (("timm", timm_state), ("transformers", state)):
        np.savez(tmp_path / f"{layout}.npz", **layout_state)
        backbone = weights.load_backbone_params(params, tmp_path / f"{layout}.npz")["backbone"]
        loaded[layout] = traverse_util.flatten_dict(nn.meta.unbox(backbone), sep="/")
    assert loaded["transformers"].keys() == loaded["timm"].keys()
    for name, value in loaded["timm"].items():
        np.testing.assert_array_equal(loaded["transformers"][name], value, err_msg=name)


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_transformers_vit_layout_errors_as_timm(tmp_path, change):
    timm_state = timm_vit_state_dict()
    if change == "missing":
        del timm_state["blocks.2.mlp.fc2.bias"]
        expected = "1 missing (blocks.2.mlp.fc2.bias) tensors"
    else:  # BEiT's relative position table, which ViTModel has no place for
        timm_state["blocks.1.attention.attention.relative_position_bias_table"] = np.ones((9, HEADS), np.float32)
        expected = "1 unexpected (blocks.1.attention.attention.relative_position_bias_table) tensors"
    state = vit_model_state_dict(timm_state)
    assert ("encoder.layer.2.output.dense.bias" in state) == (change != "missing")
    message = load_error(tmp_path, state)
    assert expected in message
    assert message == load_error(tmp_path, timm_state)  # the same line, in the canonical names

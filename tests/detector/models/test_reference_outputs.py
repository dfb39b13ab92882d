"""Imported weights against their sources' own forward passes, from stored reference outputs: no torch needed.

Each `tests/reference_outputs/NAME.npz` holds a state dict under its
source's keys (timm, transformers, torchvision), an input and the source's
output on it; `tests.reference_outputs.generate` wrote them (its docstring
has the layout, the sizes and how to regenerate). Each test writes the state
dict to a file as a checkpoint holds it, loads it the way
`config.model.backbone.pretrained` does (`load_backbone_params`, with the
model's options as `backbone_config`) and compares, in float32:

  ViTs: the patch tokens (`ViT.patch_tokens`: final norm if the source has
    one, prefix tokens dropped, before the patch-14 resize), by max |ours -
    reference| / max |reference| < 1e-4, at input sizes other than the
    checkpoint's where the source allows it (position embeddings resized,
    RoPE recomputed for the grid), and at one that is not whole patches
    (timm's dynamic_img_pad and our patch embedding pad below and right).
  ResNet: the outputs of the four stages (levels 2-5), elementwise within
    1e-4 relative and 1e-4 of the level's largest value absolute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.models import weights
from detector.models.resnet import ResNet
from detector.models.vit import ViT
from tests.reference_outputs import generate

VIT_TOLERANCE = 1e-4
RESNET_TOLERANCE = 1e-4


def load(model, case: generate.Case, images_nhwc, tmp_path, backbone_config=None):
    """The case's state dict, saved as a `.npz` under the source's keys, loaded into `model`'s parameters."""
    path = tmp_path / "checkpoint.npz"
    np.savez(path, **case.state)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(images_nhwc))["params"]
    return weights.load_backbone_params({"backbone": abstract}, path, backbone_config)["backbone"]


def vit_patch_tokens(case: generate.Case, tmp_path) -> np.ndarray:
    """`[B, h, w, D]`: our ViT's patch tokens with the case's weights on its input."""
    vit = ViT(**case.options)
    images = case.arrays["input"].transpose(0, 2, 3, 1)
    params = load(vit, case, images, tmp_path, case.options)
    forward = jax.jit(functools.partial(vit.apply, method=ViT.patch_tokens))
    return np.asarray(forward({"params": params}, images))


@pytest.mark.parametrize("name", generate.names("vit"))
def test_vit_computes_what_its_source_computes(name, tmp_path):
    case = generate.read(name)
    difference = generate.relative_difference(vit_patch_tokens(case, tmp_path), case.arrays["reference"])
    print(f"{name} ({case.source}): max relative difference {difference:.2e}")
    assert difference < VIT_TOLERANCE, (case.source, difference)


@pytest.mark.parametrize("name", generate.names("resnet"))
def test_resnet_computes_what_its_source_computes(name, tmp_path):
    case = generate.read(name)
    options = {**case.options, "stage_sizes": tuple(case.options["stage_sizes"])}
    resnet = ResNet(**options)
    images = case.arrays["input"].transpose(0, 2, 3, 1)
    params = load(resnet, case, images, tmp_path)
    ours = jax.jit(resnet.apply)({"params": params}, images)
    for level in range(2, 6):
        expected = case.arrays[f"reference/{level}"].transpose(0, 2, 3, 1)
        scale = float(np.abs(expected).max())
        print(f"{name} C{level}: max relative difference {generate.relative_difference(ours[level], expected):.2e}")
        np.testing.assert_allclose(
            np.asarray(ours[level]), expected, rtol=RESNET_TOLERANCE, atol=RESNET_TOLERANCE * scale, err_msg=f"C{level}"
        )

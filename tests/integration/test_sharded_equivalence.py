"""Sharding changes placement, never results: ViT, DINO and spatially partitioned detectors.

Three SGD steps from the same parameters on the same batches, on one device
and on a mesh, through the trainer's compiled step.
"""

from __future__ import annotations

import flax
import numpy as np
import pytest

from configs import common, default, dino_tiny, vitdet_tiny
from tests.helpers.sharded_training import (
    METRIC_RTOL,
    NUM_CLASSES,
    assert_same_training,
    continuous_dino,
    equivalence_config,
    initial_params,
    random_batch,
    spatial_config,
    train_on_mesh,
)

pytestmark = pytest.mark.slow


def check_sharded_training(config, mesh_shape, expected_specs, max_collectives, *, accumulate_steps=1):
    """Three SGD steps on one device and on `mesh_shape` give the same losses and updates; returns both runs.

    The runs are `equivalence_config`'s 3 SGD steps, compared under the fixed
    floors of `assert_same_training` (their margin on this machine and under
    other summation orders: `python -m tests.helpers.equivalence_margin`).
    `expected_specs` {parameter: 'PartitionSpec(...)'} pins the layout of a
    few parameters (Megatron's column/row split, FSDP on the other dim):
    placement that changes no number is checked there, and so is what
    sharding constraints on activations buy: `max_collectives` {kind: most
    executions per step} is what the step needs with every constraint in
    place (XLA:CPU's partitioner, the same on every CPU); losing one re-lays
    activations out between devices with more of them.
    `accumulate_steps` > 1: the sharded run takes each batch in that many
    micro-batches, and must still give the one-device run's single pass.
    """
    config = equivalence_config(config)
    initial, batches = initial_params(config), [random_batch(config, seed) for seed in range(3)]
    reference = train_on_mesh(config, (1, 1, 1), initial, batches, NUM_CLASSES)
    sharded_config = config.copy_and_resolve_references()
    sharded_config.optimizer.accumulate_steps = accumulate_steps
    sharded = train_on_mesh(sharded_config, mesh_shape, initial, batches, NUM_CLASSES)
    assert {name: sharded.param_specs[name] for name in expected_specs} == expected_specs
    assert_same_training(reference, sharded, flax.traverse_util.flatten_dict(initial, sep="/"))
    more = {kind: count for kind, count in sharded.collectives.items() if count > max_collectives.get(kind, 0)}
    assert not more, f"collectives per step {sharded.collectives}, more than {max_collectives}"
    return reference, sharded


# Attention and MLP in Megatron's layout: the first projection split by its
# output (heads, hidden) over 'model', the second by its input; the model
# width over 'fsdp'. ViT blocks are scanned: the leading dim is the layer.
VIT_SPECS = {
    "backbone/stages/global/attn/qkv/kernel": "P(None, 'fsdp', None, 'model', None)",
    "backbone/stages/global/attn/out/kernel": "P(None, 'model', None, 'fsdp')",
    "backbone/stages/global/mlp/fc1/kernel": "P(None, 'fsdp', 'model')",
    "backbone/stages/global/mlp/fc2/kernel": "P(None, 'model', 'fsdp')",
    "backbone/stages/global/norm1/scale": "P(None, 'fsdp')",
}
DINO_SPECS = {
    "encoder0/self_attention/value/kernel": "P('fsdp', 'model', None)",
    "encoder0/self_attention/sampling_offsets/kernel": "P('fsdp', 'model', None, None, None)",
    "encoder0/self_attention/output/kernel": "P('model', None, 'fsdp')",
    "decoder0/self_attention/query/kernel": "P('fsdp', 'model', None)",
    "decoder0/ffn/fc1/kernel": "P('fsdp', 'model')",
    "decoder0/ffn/fc2/kernel": "P('model', 'fsdp')",
}
# Spatial partitioning splits activations' height over 'model': kernels keep
# whole channels there.
SPATIAL_SPECS = {
    "backbone/stem_conv/kernel": "P(None, None, None, 'fsdp')",
    "head/cls_conv0/kernel": "P(None, None, None, 'fsdp')",
}

# The neck's 1x1 lateral convolutions run as matmuls on a CPU (models.convolution),
# whose input gradient XLA:CPU's partitioner gathers the FSDP-split kernel for
# again (three more all-gathers of kernels, 41 KB in all; no activation moves).
VIT_COLLECTIVES = {"all-reduce": 40, "all-gather": 188, "reduce-scatter": 0, "all-to-all": 2, "collective-permute": 136}
SPATIAL_COLLECTIVES = {
    "all-reduce": 77,
    "all-gather": 10,
    "reduce-scatter": 0,
    "all-to-all": 8,
    "collective-permute": 195,
}


def test_vit_detector_trains_identically_on_a_2x2x2_mesh():
    config = vitdet_tiny.get_config()
    config.global_batch_size = 4
    check_sharded_training(config, (2, 2, 2), VIT_SPECS, VIT_COLLECTIVES)


# The DINOv3 7B block type at width 32: 2 heads and 2 x 64 SwiGLU units split
# over 'model', LoRA adapters split like their kernels.
FOUNDATION_SPECS = {
    "backbone/stages/global/attn/qkv/kernel": "P(None, 'fsdp', None, 'model', None)",
    "backbone/stages/global/attn/out/kernel": "P(None, 'model', None, 'fsdp')",
    "backbone/stages/global/mlp/fc1/kernel": "P(None, 'fsdp', None, 'model')",
    "backbone/stages/global/mlp/fc2/kernel": "P(None, 'model', 'fsdp')",
    "backbone/stages/global/ls1": "P(None, 'fsdp')",
}
FOUNDATION_LORA_SPECS = {
    "backbone/stages/global/attn/qkv/lora_a": "P(None, 'fsdp', None)",
    "backbone/stages/global/attn/qkv/lora_b": "P(None, None, None, 'model', None)",
    "backbone/stages/global/mlp/fc2/lora_a": "P(None, 'model', None)",
}
# A frozen backbone reduces no gradient of its own: 15 all-reduces fewer.
FOUNDATION_COLLECTIVES = {
    "full": {"all-reduce": 27, "all-gather": 127, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 52},
    "frozen": {"all-reduce": 12, "all-gather": 101, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 51},
    "lora": {"all-reduce": 32, "all-gather": 135, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 79},
}


def foundation_config(training: str):
    """A width-reduced DINOv3 7B-type backbone (RoPE, SwiGLU, LayerScale, class and register tokens, global
    blocks) under a tiny RetinaNet head, trained `training` ('full', 'frozen' or 'lora')."""
    config = default.get_config()
    config.model.backbone = common.dinov3_backbone(32, 2, 2, mlp="swiglu", mlp_hidden=64, training=training)
    if training == "lora":
        config.model.backbone.lora_rank, config.model.backbone.lora_alpha = 2, 4.0
    config.input.image_size = (64, 64)
    config.input.max_boxes = 8
    config.global_batch_size = 4
    config.model.fpn_features = config.model.head_features = 16
    config.model.head_convs = 1
    return config


@pytest.mark.parametrize("training", ["full", "frozen", "lora"])
def test_foundation_vit_trains_identically_on_a_2x2x2_mesh(training):
    """Each way of training the foundation backbone gives one device's numbers on (2, 2, 2)."""
    config = foundation_config(training)
    specs = {**FOUNDATION_SPECS, **(FOUNDATION_LORA_SPECS if training == "lora" else {})}
    check_sharded_training(config, (2, 2, 2), specs, FOUNDATION_COLLECTIVES[training])


def spatial_equivalence_config():
    config = spatial_config(128)
    config.global_batch_size = 4
    return config


def test_spatial_partitioning_trains_identically():
    config = spatial_equivalence_config()
    check_sharded_training(config, (2, 1, 2), SPATIAL_SPECS, SPATIAL_COLLECTIVES)


def dino_config():
    """The tiny DINO at 64 px with every training option on, 8 images a step (micro-batches of 4 fit 2x2x2)."""
    config = dino_tiny.get_config()
    config.global_batch_size = 8  # micro-batches of 4: one image per data x fsdp shard
    # 64 px (85 proposals) and 8 box slots: the layers at full width, at a third of the 128 px step's cost.
    config.input.image_size = (64, 64)
    config.input.max_boxes = 8
    config.model.dino.num_queries = 32
    config.model.dino.denoising_pairs = 16
    # Every training option on (the class loss is the recipe's): 6 copies of the 8 box slots.
    config.model.dino.one_to_many_queries = 48
    return config


# Mask DINO (the mask branch on the tiny DINO above, 8-wide embeddings, 64 points a mask) in 2 micro-batches:
# the network's collectives run once per micro-batch. In one pass DINO alone needs 39 all-reduces, 226
# all-gathers, 21 all-to-alls and 140 collective-permutes; the branch adds its FSDP-split kernels gathered for
# its convolutions and MLP, forward and backward (42 all-gathers), its stride-4 map's rows moved between 'model'
# shards around the 3x3 convolution and the bilinear resize (36 collective-permutes, 1 all-to-all), its
# gradients' one more all-reduce, and one all-reduce per set of queries (11) of its point logits, whose
# contraction runs over the 'model'-split embedding width (the loss takes the sets one at a time, for memory):
# 48, 268, 22 and 176 in one pass.
MASK_DINO_COLLECTIVES = {
    "all-reduce": 96,
    "all-gather": 344,
    "reduce-scatter": 0,
    "all-to-all": 42,
    "collective-permute": 298,
}


def mask_dino_config():
    """`dino_config` with Mask DINO's branch: 8-wide mask embeddings, 64 points a mask."""
    config = dino_config()
    config.model.dino.mask_dim = 8
    config.input.mask_stride = 4
    config.loss.set_prediction.mask_points = 64
    return config


def test_mask_dino_trains_identically_on_a_2x2x2_mesh_in_micro_batches():
    """Denoising, the one-to-many branch, deformable attention and the mask branch with heads, FFN and widths
    split, each batch in 2 micro-batches: the update of one pass on one device.

    The micro-batches split what DINO computes per image (denoising noise, the
    mask points of each image) and the box count that normalises its losses
    over the whole global batch. The pixel embedding's rows go over `model`,
    as convolutions'. The recipe's own structure (1 encoder layer, 2 points).
    Proposal selection and matching are held fixed and bilinear sampling
    smoothed (`continuous_dino`): the other summation order may flip a
    near-tie or move a sampling point across a pixel edge, which changes a
    gradient by a finite amount on some CPUs and not others; the selection's
    and the matcher's own sharding are tested in tests/detector/ops and
    tests/detector/models, the sampling's values and gradients in
    tests/detector/ops. DINO without the branch is the same network with one
    output fewer (tests/detector/models/test_mask_branch.py).
    """
    config = mask_dino_config()
    with continuous_dino():
        reference, sharded = check_sharded_training(
            config, (2, 2, 2), DINO_SPECS, MASK_DINO_COLLECTIVES, accumulate_steps=2
        )
    for expected, actual in zip(reference.metrics, sharded.metrics, strict=True):
        assert actual["num_positives"] == expected["num_positives"]
        assert expected["mask_loss"] > 0 and expected["dice_loss"] > 0
        for key in ("denoising_loss", "mask_loss", "dice_loss"):
            np.testing.assert_allclose(actual[key], expected[key], rtol=METRIC_RTOL, err_msg=key)

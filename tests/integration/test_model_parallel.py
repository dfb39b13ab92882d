"""Model parallelism shards what it promises and moves what it should; the planner finds what fits.

Per-device bytes come from XLA's own `memory_analysis()` of the compiled train
step and collectives from its optimized HLO, through `detector.plan`, the
same code the plan CLI and the trainer use.
"""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharding
from configs import common, vitdet_tiny
from detector.models import backbones, families
from detector.models.retinanet import create_model
from detector.models.vit import ViT
from detector.training.train_compile import plan_train_step
from detector.training.train_state import state_shardings
from sharding import step_plan
from sharding.collectives import parse_collectives
from tests.helpers import REPO_ROOT
from tests.helpers.sharded_training import NUM_CLASSES, spatial_config

pytestmark = pytest.mark.slow


def tensor_parallel_vit_config():
    """A tiny ViT detector whose large dimensions all divide 8.

    8 heads of width 16, MLP 512, pyramid/head width 64, and 6 anchors per
    location so the class and box outputs (24 channels each) split too.
    """
    config = vitdet_tiny.get_config()
    config.model.backbone.embed_dim = 128
    config.model.backbone.num_heads = 8
    config.model.anchors.num_scales = 2
    config.global_batch_size = 8
    return config


def plan_on(config, shape):
    devices = jax.devices()[: math.prod(shape)]
    return plan_train_step(step_plan.with_mesh_shape(config, shape), devices)


@pytest.fixture(scope="module")
def vit_plans():
    """Plans of the tensor-parallel ViT config by mesh shape, compiled once each."""
    config = tensor_parallel_vit_config()
    return functools.cache(lambda shape: plan_on(config, shape))


def state_bytes_from_xla(plan) -> int:
    """Train-state bytes per device as XLA counts its arguments (the batch is the rest)."""
    return plan.memory.argument_bytes - plan.batch_bytes


# ----------------------------------------------------------------------------
# Memory: FSDP and tensor parallelism divide the train state.
# ----------------------------------------------------------------------------


def test_fsdp_divides_parameters_and_optimizer_state_by_eight(vit_plans):
    unsharded, fsdp = vit_plans((1, 1, 1)), vit_plans((1, 8, 1))
    # XLA's argument bytes are the shard shapes we assigned: the accounting
    # agrees (up to unused scalar arguments XLA leaves out).
    for plan in (unsharded, fsdp):
        assigned = plan.params_bytes + plan.opt_state_bytes
        assert abs(state_bytes_from_xla(plan) - assigned) <= 1e-3 * assigned
    assert state_bytes_from_xla(fsdp) <= 1.1 * state_bytes_from_xla(unsharded) / 8


@pytest.mark.parametrize("model", [2, 8])  # the smallest split and the largest (one host's devices)
def test_tensor_parallel_divides_vit_state_by_the_model_axis(vit_plans, model):
    ratio = state_bytes_from_xla(vit_plans((1, 1, 1))) / state_bytes_from_xla(vit_plans((1, 1, model)))
    assert ratio >= 0.9 * model, ratio


# ----------------------------------------------------------------------------
# Communication.
# ----------------------------------------------------------------------------


def _parameter_sizes(config) -> set[int]:
    """Element counts of every parameter and of its per-layer slice (scanned stacks)."""
    model = create_model(config.model, NUM_CLASSES, families.num_anchors_per_location(config))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, *config.input.image_size, 3))))
    sizes = set()
    for leaf in jax.tree.leaves(flax.linen.meta.unbox(shapes)):
        for stacked_dims in range(3):
            sizes.add(math.prod(leaf.shape[stacked_dims:]))
    return sizes


def test_data_parallel_moves_gradients_once_and_no_activations(vit_plans):
    plan, unsharded = vit_plans((8, 1, 1)), vit_plans((1, 1, 1))
    summary = plan.collective_summary
    assert summary["all-reduce"].bytes <= 1.1 * unsharded.params_bytes, (summary, unsharded.params_bytes)
    assert summary["all-reduce"].bytes >= unsharded.params_bytes  # every gradient is averaged
    for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert summary[kind].count == 0, (kind, summary)
    # Every reduced buffer is a gradient (or a scalar metric), never an activation.
    parameter_sizes = _parameter_sizes(tensor_parallel_vit_config()) | {1}
    for collective in plan.collectives:
        for dtype, shape in collective.shapes:
            assert math.prod(shape) in parameter_sizes, (dtype, shape)


def _compiled_backbone_forward(config, mesh_shape):
    backbone_config = config.model.backbone
    backbone = ViT(
        patch_size=16,
        embed_dim=backbone_config.embed_dim,
        depth=backbone_config.depth,
        num_heads=backbone_config.num_heads,
        window_size=backbone_config.window_size,
        global_attention_every=backbone_config.global_attention_every,
        pretrain_image_size=backbone_config.pretrain_image_size,
        scan=backbone_config.scan,
    )
    return _compiled_forward(backbone, config, mesh_shape, lambda features: features[4])


def _compiled_forward(module, config, mesh_shape, select=lambda outputs: outputs):
    """(`module`'s forward pass on `config`'s global batch compiled for `mesh_shape`, its abstract parameters)."""
    mesh = sharding.create_mesh(dict(zip(sharding.MESH_AXES, mesh_shape)), jax.devices()[: math.prod(mesh_shape)])
    rules = sharding.logical_rules(config.sharding)
    images = jax.ShapeDtypeStruct(
        (config.global_batch_size, *config.input.image_size, 3),
        jnp.float32,
        sharding=sharding.batch_sharding(mesh, sharding.batch_axes(mesh)),
    )
    with sharding.use_mesh(mesh, rules):
        # The same shardings the trainer gives parameters; the optimizer is irrelevant here.
        abstract_state, _ = state_shardings(module, optax.sgd(0.1), tuple(config.input.image_size), mesh, rules)
        forward = jax.jit(lambda params, x: select(module.apply({"params": params}, x)))
        return forward.lower(abstract_state.params, images).compile(), abstract_state.params


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_tensor_parallel_block_needs_two_all_reduces_in_the_forward_pass(scan):
    config = tensor_parallel_vit_config()
    config.model.backbone.depth = 4
    config.model.backbone.scan = scan
    compiled, params = _compiled_backbone_forward(config, (2, 1, 4))
    # The blocks' kernels are really split over `model` (Megatron layout).
    specs = {k: str(v.sharding.spec) for k, v in flax.traverse_util.flatten_dict(params, sep="/").items()}
    qkv = next(v for k, v in specs.items() if k.endswith("qkv/kernel"))
    fc2 = next(v for k, v in specs.items() if k.endswith("fc2/kernel"))
    assert "'model'" in qkv and "'model'" in fc2, specs
    all_reduces = [c for c in parse_collectives(compiled.as_text()) if c.kind == "all-reduce"]
    assert sum(c.executions for c in all_reduces) == 2 * config.model.backbone.depth, all_reduces
    assert all(c.group_size == 4 for c in all_reduces), all_reduces


def foundation_vit_config(**backbone_options):
    """A width-reduced DINOv3 7B-type backbone: RoPE, SwiGLU, LayerScale, class + 4 register tokens, global blocks."""
    config = tensor_parallel_vit_config()
    config.model.backbone = common.dinov3_backbone(64, 4, 4, mlp="swiglu", mlp_hidden=128, **backbone_options)
    config.input.image_size = (64, 64)
    return config


@pytest.mark.parametrize("training", ["full", "lora"])
def test_foundation_vit_block_needs_two_all_reduces_in_the_forward_pass(training):
    """The 7B's block type keeps the Megatron count on (data 2, model 4): 2 all-reduces of 4 devices per block.

    With LoRA too: the adapters of the out-projection and fc2 contract the
    split axis as well, but their partial products are summed into the
    kernels' before the one all-reduce.
    """
    config = foundation_vit_config(training=training, lora_rank=4 if training == "lora" else 16)
    backbone = backbones.create_backbone(config.model, jnp.float32)
    compiled, params = _compiled_forward(backbone, config, (2, 1, 4), lambda features: features[4])
    specs = {k: str(v.sharding.spec) for k, v in flax.traverse_util.flatten_dict(params, sep="/").items()}
    assert "'model'" in specs["stages/global/mlp/fc1/kernel"] and "'model'" in specs["stages/global/mlp/fc2/kernel"]
    all_reduces = [c for c in parse_collectives(compiled.as_text()) if c.kind == "all-reduce"]
    assert sum(c.executions for c in all_reduces) == 2 * config.model.backbone.depth, all_reduces
    assert all(c.group_size == 4 for c in all_reduces), all_reduces


# ----------------------------------------------------------------------------
# Rematerialisation, mixed precision, spatial partitioning: temporaries.
# ----------------------------------------------------------------------------


def activation_bound_vit_config():
    """A ViT detector whose backbone activations dominate: 256 tokens per image, a narrow head."""
    config = tensor_parallel_vit_config()
    config.input.image_size = (256, 256)
    config.model.fpn_features = 16
    config.model.head_features = 16
    config.model.head_convs = 1
    config.global_batch_size = 2
    return config


def test_remat_trades_flops_for_temporaries():
    config = activation_bound_vit_config()
    baseline = plan_on(config, (1, 1, 1))
    config.model.remat = "full"
    remat = plan_on(config, (1, 1, 1))
    assert remat.memory.temp_bytes < 0.8 * baseline.memory.temp_bytes, (remat.memory, baseline.memory)
    assert remat.flops > baseline.flops  # the second forward pass
    assert remat.params_bytes == baseline.params_bytes


def test_bfloat16_computes_in_bfloat16_with_float32_parameters_and_outputs():
    config = vitdet_tiny.get_config()
    config.model.dtype = "bfloat16"
    model = create_model(config.model, NUM_CLASSES, families.num_anchors_per_location(config))
    images = jnp.zeros((1, *config.input.image_size, 3))
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), images))
    assert {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(flax.linen.meta.unbox(variables))} == {np.dtype("float32")}
    outputs = jax.eval_shape(lambda v: model.apply(v, images), variables)
    assert all(o.dtype == jnp.float32 for o in outputs)  # losses see float32 logits and deltas
    program = jax.jit(lambda v: model.apply(v, images)).lower(variables).as_text()
    matmuls = [
        line for line in program.splitlines() if "stablehlo.convolution" in line or "stablehlo.dot_general" in line
    ]
    # Every conv and matmul reads bf16 operands (attention logits accumulate
    # into float32 on purpose, so outputs are not checked).
    operand_types = [re.findall(r"x([a-z]\w*)>", line.rsplit(" : ", 1)[-1].split("->")[0]) for line in matmuls]
    assert matmuls and all(types == ["bf16", "bf16"] for types in operand_types), [
        line for line, types in zip(matmuls, operand_types) if types != ["bf16", "bf16"]
    ][:3]


def test_spatial_partitioning_splits_conv_activations_over_model():
    config = spatial_config(512)
    whole = plan_on(config, (1, 1, 1))
    split = plan_on(config, (1, 1, 2))
    assert whole.memory.temp_bytes / split.memory.temp_bytes >= 1.6, (whole.memory, split.memory)
    # Halo rows travel between the two halves of the image.
    assert split.collective_summary["collective-permute"].count > 0


# ----------------------------------------------------------------------------
# The planner.
# ----------------------------------------------------------------------------


def test_candidate_meshes_try_least_model_parallelism_first():
    candidates = step_plan.candidate_meshes(64, 64, max_model=8)
    assert candidates[0] == (64, 1, 1)
    assert candidates[1:3] == [(32, 2, 1), (32, 1, 2)]
    assert all(d * f * m == 64 and m <= 8 for d, f, m in candidates)
    # The batch must divide over data x fsdp: 4 images on 8 devices leave fsdp x model >= 2.
    assert all(d * f <= 4 for d, f, _ in step_plan.candidate_meshes(8, 4))


def test_search_names_the_smallest_split_that_fits(vit_plans):
    config = tensor_parallel_vit_config()
    data_parallel = vit_plans((8, 1, 1))
    limit = data_parallel.total_bytes - 1  # data parallelism alone just misses
    tried = [data_parallel]  # already compiled: reused, not compiled again
    fitting = step_plan.search_fitting_mesh(config, limit, plan_train_step, tried=tried)
    assert fitting is not None and fitting.fits(limit)
    assert fitting.mesh_shape["fsdp"] * fitting.mesh_shape["model"] == 2
    assert tried[0] is data_parallel and tried[1] is fitting and len(tried) == 2
    table = step_plan.format_table(tried, limit)
    assert "| (8, 1, 1) |" in table and "| no |" in table and "| yes |" in table


def test_plan_cli_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "detector.plan",
            "--config=configs/vitdet_tiny.py",
            "--devices=2",
            "--config.global_batch_size=2",
            "--device_memory_gb=80",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| (2, 1, 1) | 1 |" in result.stdout, result.stdout
    assert "fits in 80 GB" in result.stdout
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["fitting_mesh"] == {"data": 2, "fsdp": 1, "model": 1}
    per_device = report["plans"][0]["per_device_bytes"]
    assert per_device["total"] > per_device["params"] > 0
    assert report["plans"][0]["collectives"]["all-reduce"]["count"] > 0


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--devices=0", "--devices=0: 0 is not a positive integer"),
        ("--json=/nonexistent/dir/plan.json", "its directory does not exist"),
        ("--config.mesh.fsdp=3", "cannot fill 8 devices"),
    ],
)
def test_plan_cli_rejects_bad_input_in_one_line(flag, message):
    result = subprocess.run(
        [sys.executable, "-m", "detector.plan", "--config=configs/vitdet_tiny.py", "--devices=8", flag],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]


def _dino_forward_all_reduces(encoder_layers: int, decoder_layers: int, mesh_shape=(2, 1, 4)):
    """All-reduces (kind, executions, group size) in the compiled DINO forward pass on `mesh_shape`."""
    from configs import dino_tiny

    config = dino_tiny.get_config()
    config.model.dino.encoder_layers = encoder_layers
    config.model.dino.decoder_layers = decoder_layers
    config.model.dino.num_heads = 8
    config.global_batch_size = 2
    compiled, params = _compiled_forward(families.create_model(config, NUM_CLASSES), config, mesh_shape)
    specs = {k: str(v.sharding.spec) for k, v in flax.traverse_util.flatten_dict(params, sep="/").items()}
    return [c for c in parse_collectives(compiled.as_text()) if c.kind == "all-reduce"], specs


def test_dino_layers_need_the_megatron_count_of_all_reduces():
    """The DINO forward pass on (data 2, model 4) has exactly 2 all-reduces over `model` per encoder layer
    (deformable self-attention, FFN) and 3 per decoder layer (self-attention, deformable cross-attention,
    FFN), and no other: heads and hidden units split, each output projection summed once."""
    for encoder_layers, decoder_layers in ((1, 1), (2, 1), (1, 2), (3, 2)):
        all_reduces, specs = _dino_forward_all_reduces(encoder_layers, decoder_layers)
        count = sum(c.executions for c in all_reduces)
        assert count == 2 * encoder_layers + 3 * decoder_layers, (encoder_layers, decoder_layers, all_reduces)
        assert all(c.group_size == 4 for c in all_reduces), all_reduces
    for suffix in ("self_attention/value/kernel", "cross_attention/sampling_offsets/kernel", "ffn/fc1/kernel"):
        spec = next(v for k, v in specs.items() if k.endswith(suffix))
        assert "'model'" in spec, (suffix, spec)

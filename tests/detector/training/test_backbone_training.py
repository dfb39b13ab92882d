"""`model.backbone.training`: a frozen backbone, or one trained through LoRA adapters only.

What does not train has no gradient, no optimizer state, no EMA and no
gradient reduction; it stays bitwise, checkpoints and resumes, and a LoRA
backbone exports with its adapters merged.
"""

from __future__ import annotations

import dataclasses
import types

import flax
import jax
import ml_collections
import numpy as np
import pytest

import input_pipeline
import sharding
from configs import common, default, vitdet_tiny
from detector.errors import ConfigError
from detector.models import families
from detector.serving import artifact
from detector.serving.predictor import Predictor
from detector.training import checkpointing, optim, steps, train_compile
from detector.training.run import create_run
from detector.training.train_state import evaluated_params, init_train_state
from sharding import step_plan
from sharding.collectives import parse_collectives, summarize
from sharding.memory import per_device_bytes
from tests.helpers.sharded_training import NUM_CLASSES, abstract_state_on_mesh, random_batch

TINY = {
    "input.image_size": (64, 64),
    "input.max_boxes": 8,
    "global_batch_size": 4,
    "model.fpn_features": 16,
    "model.head_features": 16,
    "model.head_convs": 1,
    "model.backbone.width": 8,
    "optimizer.warmup_steps": 0,
    "optimizer.ema_decay": 0.9,
    "total_steps": 2,
}


def tiny_config(**overrides) -> ml_collections.ConfigDict:
    config = default.get_config()
    config.lock()
    config.update_from_flattened_dict({**TINY, **overrides})
    return config


def _flat(tree) -> dict[str, np.ndarray]:
    return flax.traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _compile_and_train(config, mesh, steps_to_run: int) -> types.SimpleNamespace:
    """The trainer's compiled step for `config` on `mesh`, its initial state and the state after some steps."""
    run = create_run(config, NUM_CLASSES, mesh, training=True)
    with sharding.use_mesh(mesh, run.rules):
        compiled, abstract_state, shardings = steps.compile_train_step(run)
        state = init_train_state(
            run.model, run.tx, run.image_size, shardings, jax.random.key(0), trainable=run.trainable
        )
    initial = _flat(state.params)
    for seed in range(steps_to_run):
        batch = input_pipeline.to_global_batch(random_batch(config, seed), mesh, sharding.batch_axes(mesh))
        state, _ = compiled(state, batch)
    return types.SimpleNamespace(
        config=config,
        run=run,
        compiled=compiled,
        abstract_state=abstract_state,
        initial=initial,
        state=state,
        mesh=mesh,
    )


def _abstract_state(config, mesh_shape=(2, 1, 1)):
    mesh = sharding.create_mesh(dict(zip(sharding.MESH_AXES, mesh_shape)), devices=jax.devices()[: np.prod(mesh_shape)])
    return abstract_state_on_mesh(config, mesh, NUM_CLASSES)


def _bytes(tree, keep=lambda name: True) -> int:
    return sum(x.size * x.dtype.itemsize for name, x in _flat(tree).items() if keep(name))


def _in_backbone(name: str) -> bool:
    return name.startswith("backbone/")


def test_a_frozen_backbone_has_no_optimizer_state_and_no_ema():
    full = _abstract_state(tiny_config(**{"model.backbone.training": "full"}))
    frozen = _abstract_state(tiny_config(**{"model.backbone.training": "frozen"}))
    assert _flat(frozen.params).keys() == _flat(full.params).keys()  # still checkpointed, once
    opt_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(frozen.opt_state)]
    assert opt_paths and not any("backbone" in path for path in opt_paths)
    # AdamW keeps two moments per trained parameter: the backbone's are gone, nothing else is.
    backbone_bytes = _bytes(full.params, _in_backbone)
    assert per_device_bytes(full.opt_state) - per_device_bytes(frozen.opt_state) == 2 * backbone_bytes
    assert _flat(frozen.ema_params).keys() == {name for name in _flat(full.params) if not _in_backbone(name)}


def test_the_partition_keeps_the_sharding_of_parameters_and_their_moments():
    config = tiny_config(**{"model.backbone.training": "frozen"})
    full = _abstract_state(tiny_config(), (2, 2, 2))
    frozen = _abstract_state(config, (2, 2, 2))

    def specs(tree):
        return {name: str(x.sharding.spec) for name, x in _flat(tree).items()}

    assert specs(frozen.params) == specs(full.params)
    head = {name: spec for name, spec in specs(full.params).items() if not _in_backbone(name)}
    assert any("fsdp" in spec for spec in head.values())  # something to keep
    adam = frozen.opt_state[1][0]  # clip_by_global_norm, then adamw's chain: scale_by_adam first
    assert specs(adam.mu) == head and specs(adam.nu) == head
    assert specs(frozen.ema_params) == head


def test_the_gradient_has_no_backbone_leaves():
    config = tiny_config(**{"model.backbone.training": "frozen"})
    model = families.create_model(config, NUM_CLASSES)
    loss = families.objective(config, model, NUM_CLASSES).loss
    params = _abstract_state(config).params
    for accumulate_steps in (1, 2):
        _, _, grads = jax.eval_shape(
            lambda p: steps.gradients(
                p,
                random_batch(config, 0),
                jax.random.key(0),
                loss=loss,
                trainable=optim.trainable_parameters(config.model),
                accumulate_steps=accumulate_steps,
            ),
            params,
        )
        assert _flat(grads).keys() == {name for name in _flat(params) if not _in_backbone(name)}


@pytest.fixture(scope="module")
def runs():
    """Two steps of the tiny RetinaNet, data parallel over 2 devices, with its backbone trained and frozen."""
    mesh = sharding.create_mesh(dict(data=2, fsdp=1, model=1), devices=jax.devices()[:2])
    return {
        mode: _compile_and_train(tiny_config(**{"model.backbone.training": mode}), mesh, 2)
        for mode in ("full", "frozen")
    }


@pytest.mark.slow
def test_a_frozen_backbone_stays_bitwise_while_the_rest_trains(runs):
    run = runs["frozen"]
    after = _flat(run.state.params)
    assert after.keys() == run.initial.keys()
    backbone = [name for name in after if _in_backbone(name)]
    assert backbone and all(np.array_equal(after[name], run.initial[name]) for name in backbone)
    unchanged = [name for name in after if not _in_backbone(name) and np.array_equal(after[name], run.initial[name])]
    assert not unchanged, unchanged
    # Under "full" the same backbone moves.
    full = _flat(runs["full"].state.params)
    assert all(not np.array_equal(full[name], runs["full"].initial[name]) for name in backbone)
    # Evaluation sees the EMA where there is one, and the (fixed) backbone itself.
    evaluated, ema = _flat(evaluated_params(run.state)), _flat(run.state.ema_params)
    assert evaluated.keys() == after.keys()
    assert all(np.array_equal(evaluated[name], ema.get(name, after[name])) for name in evaluated)
    assert not np.array_equal(ema["head/cls_logits/kernel"], after["head/cls_logits/kernel"])


@pytest.mark.slow
def test_the_compiled_step_runs_and_reduces_no_backbone_gradient(runs):
    """The backbone's backward pass (two convolutions per forward one, less the stem's input gradient) and
    the all-reduce of its gradient are gone from the compiled step."""
    config = runs["frozen"].config

    def cost(run):
        flops = run.compiled.cost_analysis()
        flops = (flops[0] if isinstance(flops, (list, tuple)) else flops)["flops"]
        return flops, summarize(parse_collectives(run.compiled.as_text()))["all-reduce"].bytes

    full_flops, full_reduced = cost(runs["full"])
    frozen_flops, frozen_reduced = cost(runs["frozen"])
    model = families.create_model(config, NUM_CLASSES)
    backbone_forward = _backbone_forward_flops(config, model, runs["full"].abstract_state.params)
    assert full_flops - frozen_flops > 1.2 * backbone_forward, (full_flops, frozen_flops, backbone_forward)
    backbone_bytes = _bytes(runs["full"].abstract_state.params, _in_backbone)
    assert full_reduced - frozen_reduced >= backbone_bytes, (full_reduced, frozen_reduced, backbone_bytes)


def _backbone_forward_flops(config, model, abstract_params) -> float:
    """FLOPs of the backbone's forward pass alone on half the global batch (one device's share)."""
    images = jax.ShapeDtypeStruct((config.global_batch_size // 2, *config.input.image_size, 3), np.float32)
    backbone_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params["backbone"])
    compiled = jax.jit(lambda p, x: model.backbone.apply({"params": p}, x)).lower(backbone_params, images).compile()
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.slow
def test_a_frozen_backbone_checkpoints_and_resumes_bitwise(runs, tmp_path):
    run = runs["frozen"]
    manager = checkpointing.create_manager(str(tmp_path), max_to_keep=1)
    try:
        checkpointing.save(manager, 2, run.state, {"step": 2, "input_position": 8})
        checkpointing.finish_writes(manager)
        restored, _ = checkpointing.restore_latest(manager, run.abstract_state)
    finally:
        manager.close()
    for field in ("params", "opt_state", "ema_params"):
        expected, actual = jax.device_get(getattr(run.state, field)), jax.device_get(getattr(restored, field))
        assert jax.tree.structure(expected) == jax.tree.structure(actual), field
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(actual))), field
    # Readers (evaluate, predict, export) get the EMA where kept and the frozen backbone from the parameters.
    params, step = checkpointing.restore_params(str(tmp_path), "last", run.abstract_state.params, ema=True)
    expected = _flat(evaluated_params(run.state))
    assert step == 2 and _flat(params).keys() == expected.keys()
    assert all(np.array_equal(value, expected[name]) for name, value in _flat(params).items())
    # Resuming with the backbone trained again is a config change, not damage: nothing is moved aside.
    manager = checkpointing.create_manager(str(tmp_path), max_to_keep=1)
    try:
        with pytest.raises(checkpointing.WorkdirMismatchError, match="another optimizer or model.backbone.training"):
            checkpointing.restore_latest(manager, runs["full"].abstract_state)
        assert manager.all_steps() == [2]
    finally:
        manager.close()


def _model_config(**backbone) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"backbone": {"name": "resnet", "training": "full", **backbone}})


def test_the_training_mode_is_checked_against_the_backbone():
    with pytest.raises(ConfigError, match=r"model.backbone.training='partial'; use one of 'full', 'frozen', 'lora'"):
        optim.backbone_training(_model_config(training="partial"))
    with pytest.raises(ConfigError, match="training='lora' needs a ViT backbone with model.backbone.lora_rank > 0"):
        optim.backbone_training(_model_config(training="lora"))
    with pytest.raises(ConfigError, match="training='lora' needs a ViT backbone with model.backbone.lora_rank > 0"):
        optim.backbone_training(_model_config(name="vit", training="lora", lora_rank=0))
    with pytest.raises(ConfigError, match=r"lora_rank=4 needs model.backbone.training='lora' \(here 'frozen'\)"):
        optim.backbone_training(_model_config(name="vit", training="frozen", lora_rank=4))
    assert optim.backbone_training(_model_config(name="vit", training="lora", lora_rank=4)) == "lora"
    # The training config refuses it before anything compiles.
    with pytest.raises(ConfigError, match="model.backbone.training='partial'"):
        optim.create_optimizer(
            tiny_config().optimizer, 2, model_config=tiny_config(**{"model.backbone.training": "partial"}).model
        )


def test_which_parameters_train_in_each_mode():
    paths = [
        ("backbone", "stem_conv", "kernel"),
        ("backbone", "stages", "global", "attn", "qkv", "lora_a"),
        ("backbone", "stages", "global", "attn", "qkv", "lora_b"),
        ("neck", "lateral", "kernel"),
        ("head", "cls_logits", "bias"),
    ]

    def trained(mode, **backbone):
        keep = optim.trainable_parameters(_model_config(training=mode, **backbone))
        return None if keep is None else [path[-1] for path in paths if keep(path)]

    assert trained("full") is None
    assert trained("frozen") == ["kernel", "bias"]
    assert trained("lora", name="vit", lora_rank=2) == ["lora_a", "lora_b", "kernel", "bias"]
    # A frozen backbone leaves freeze_stages / frozen BatchNorm nothing to hold fixed.
    assert optim.frozen_parameters(_model_config(training="frozen", norm="frozen_bn", freeze_stages=2)) is None


def tiny_vit_config(training: str) -> ml_collections.ConfigDict:
    """A tiny ViTDet RetinaNet at 64 px; "lora" puts rank-2 adapters (alpha 4) on its projections."""
    config = vitdet_tiny.get_config()
    config.model.backbone = common.vit_backbone(32, 2, 2, window_size=2, global_attention_every=2)
    config.model.backbone.training = training
    config.model.backbone.lora_rank = 2 if training == "lora" else 0
    config.model.backbone.lora_alpha = 4.0
    config.update_from_flattened_dict({key: value for key, value in TINY.items() if key != "model.backbone.width"})
    return config


def _is_adapter(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in optim.LORA_PARAMS


@pytest.fixture(scope="module")
def vit_runs():
    """Two steps of the tiny ViT RetinaNet, data parallel over 2 devices, trained full, frozen and with LoRA."""
    mesh = sharding.create_mesh(dict(data=2, fsdp=1, model=1), devices=jax.devices()[:2])
    return {mode: _compile_and_train(tiny_vit_config(mode), mesh, 2) for mode in ("full", "lora", "frozen")}


@pytest.mark.slow
def test_lora_trains_the_adapters_and_the_detector_and_keeps_the_base_weights(vit_runs):
    run = vit_runs["lora"]
    after = _flat(run.state.params)
    adapters = [name for name in after if _is_adapter(name)]
    base = [name for name in after if _in_backbone(name) and not _is_adapter(name)]
    assert adapters and base
    assert all(np.array_equal(after[name], run.initial[name]) for name in base)
    moved = [name for name in after if not np.array_equal(after[name], run.initial[name])]
    assert sorted(moved) == sorted(name for name in after if not _in_backbone(name) or _is_adapter(name))
    trained = set(moved)
    assert _flat(run.state.ema_params).keys() == trained
    mu = _flat(run.state.opt_state[1][0].mu)
    assert mu.keys() == trained


@pytest.mark.slow
def test_the_plan_shows_what_each_mode_trains(vit_runs):
    plans = {mode: train_compile.step_plan_of(r.run, r.compiled, r.abstract_state) for mode, r in vit_runs.items()}
    params = _flat(_abstract_state(tiny_vit_config("lora")).params)
    adapters = sum(x.size * 4 for name, x in params.items() if _is_adapter(name))
    detector = sum(x.size * 4 for name, x in params.items() if not _in_backbone(name))
    # AdamW's two moments (and a step count) of what trains; gradients of the same.
    assert plans["frozen"].opt_state_bytes - 2 * detector == plans["lora"].opt_state_bytes - 2 * (detector + adapters)
    assert plans["full"].opt_state_bytes > plans["lora"].opt_state_bytes > plans["frozen"].opt_state_bytes
    assert plans["frozen"].gradient_bytes == detector and plans["lora"].gradient_bytes == detector + adapters
    assert plans["full"].gradient_bytes == plans["full"].params_bytes > plans["lora"].gradient_bytes
    # Parameters are all still there; fewer activations are kept for a backward pass.
    assert plans["frozen"].params_bytes == plans["full"].params_bytes
    assert plans["frozen"].memory.temp_bytes < plans["full"].memory.temp_bytes
    assert "grads GB" in step_plan.format_table(list(plans.values()))


@pytest.mark.slow
def test_a_lora_backbone_exports_with_its_adapters_merged():
    config = tiny_vit_config("lora")
    config.postprocess.score_threshold = 0.0  # every slot valid: all of them are compared
    one_device = sharding.create_mesh(dict(data=1, fsdp=1, model=1), devices=jax.devices()[:1])
    run = create_run(config, NUM_CLASSES, one_device, training=False)
    model = run.predict_model
    params = flax.linen.meta.unbox(
        jax.jit(model.init)(jax.random.key(0), np.zeros((1, 64, 64, 3), np.float32))["params"]
    )
    # Adapters far from their zero start, so that dropping them would show, and class scores spread
    # over (0, 1) rather than all at the prior's 0.01, so that rounding cannot reorder detections.
    rng = np.random.default_rng(0)
    spread = {("head", "cls_logits", "kernel"): 0.05, ("head", "cls_logits", "bias"): 0.0}
    params = flax.traverse_util.unflatten_dict(
        {
            path: rng.normal(0.0, spread.get(path, 0.2), leaf.shape).astype(np.float32)
            if path[-1] == "lora_b" or path in spread
            else leaf
            for path, leaf in flax.traverse_util.flatten_dict(params).items()
        }
    )
    predictor = Predictor(
        config=config,
        run=run,
        mesh=None,
        batch_sharding=None,
        params=params,
        step=0,
        predict=None,
        batch_size=2,
        dataset_info=types.SimpleNamespace(num_classes=NUM_CLASSES),
    )
    exported = artifact.export_predictor(predictor, 2, platforms=("cpu",))
    batch = random_batch(config, 0)
    images, image_hw = batch["image"][:2], batch["image_hw"][:2]
    outputs = jax.device_get(exported.call(images, image_hw))
    detect = families.objective(config, model, NUM_CLASSES).detect
    adapted = jax.device_get(jax.jit(detect)(params, images, image_hw))
    assert outputs["valid"].all() and np.array_equal(outputs["classes"], adapted["classes"])
    np.testing.assert_allclose(outputs["scores"], adapted["scores"], atol=1e-5)
    np.testing.assert_allclose(outputs["boxes"], adapted["boxes"], atol=1e-3)
    without = {
        **params,
        "backbone": flax.traverse_util.unflatten_dict(
            {
                p: v
                for p, v in flax.traverse_util.flatten_dict(params["backbone"]).items()
                if p[-1] not in optim.LORA_PARAMS
            }
        ),
    }
    plain_config = tiny_vit_config("full")
    plain_config.postprocess.score_threshold = 0.0
    plain = create_run(plain_config, NUM_CLASSES, one_device, training=False)
    unadapted = jax.device_get(jax.jit(plain.objective.detect)(without, images, image_hw))
    assert np.abs(unadapted["scores"] - adapted["scores"]).max() > 100 * 1e-5
    # The program is the plain backbone's: no adapter matmuls.
    plain_program = artifact.export_predictor(
        dataclasses.replace(predictor, config=plain_config, run=plain, params=without), 2, platforms=("cpu",)
    )
    count = "stablehlo.dot_general"
    assert exported.mlir_module().count(count) == plain_program.mlir_module().count(count)

"""ONNX export: onnxruntime runs what the JAX program computes, for each detector family, at any batch size.

Each model is built with initialised parameters (what is compared is the
program, not what training made of it) at a non-square input, exported once
with its network's raw outputs beside the detections, and run by onnxruntime
on batches of 1 and 8. A score threshold of 0 fills every detection slot.
DINO is exported at a size that takes the deformable attention's scatter-add
form (up to 512 value positions), Mask DINO (DINO's network and a mask
branch) at one that takes its row gathers (above), with its masks.

DINO is compared on images that fill the input. On a padded
one (image_hw smaller than the input) its outputs are sensitive to float
rounding in JAX alone: the same image in a batch of 1 and of 8 gives
encoder logits 4.3e-4 apart (onnxruntime's 4.9e-4 from JAX's), and the
query selection's order follows. RetinaNet and ViTDet are compared on
padded images too.
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from configs import default, dino_tiny, mask_dino_tiny, vitdet_tiny
from detector.errors import ConfigError
from detector.ops import deformable_attention
from detector.serving import artifact
from detector.serving.predictor import Predictor
from detector.training import train_state
from detector.training.run import create_run
from tests.helpers.tiny_config import OVERRIDES

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("jax2onnx")

from detector.serving import onnx_export  # noqa: E402  (needs the converter, checked above)

pytestmark = pytest.mark.slow

NUM_CLASSES = 4
FILLED = {"postprocess.score_threshold": 0.0}
# Float noise between XLA's and onnxruntime's kernels, measured on these models: logits up to 8 differ by
# <= 2e-5, boxes in pixels by <= 3e-5; the bounds the exported model must meet.
NETWORK_ATOL = 1e-4
BOX_ATOL = 1e-3
SCORE_ATOL = 1e-4

TINY_WIDTHS = {key: value for key, value in OVERRIDES.items() if key.startswith("model.")}
# One decoder layer: every operator of the three, a third of the program to convert.
DINO_SHRUNK = {"model.dino.decoder_layers": 1}
# name -> (config module, overrides, whether its detections are compared on padded images too).
CASES = {
    # The default config's RetinaNet at the test widths, as a bf16 recipe: exported computing in float32,
    # compared with JAX's float32 program. (At the default widths, initialised parameters score neighbouring
    # anchors' boxes the same to 1e-6 with IoU 0.9999: rounding picks which one NMS keeps, and the rest of
    # the selection follows.)
    "retinanet": (default, {**TINY_WIDTHS, "model.dtype": "bfloat16", "input.image_size": (96, 128)}, True),
    "dino_scatter_add": (dino_tiny, {**DINO_SHRUNK, "input.image_size": (64, 96)}, False),
    # Mask DINO is DINO's network with a mask branch: its masks, and the gather form at once.
    "mask_dino_gather": (mask_dino_tiny, {**DINO_SHRUNK, "input.image_size": (160, 176)}, False),
    "vitdet": (vitdet_tiny, {"input.image_size": (128, 160)}, True),
}


def make_config(module, overrides):
    config = module.get_config()
    config.update_from_flattened_dict({**FILLED, **overrides})
    return config


def initialized_predictor(config) -> Predictor:
    """A predictor of `config`'s model with initialised parameters (no checkpoint, nothing compiled)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    run = create_run(config, NUM_CLASSES, mesh, training=False)
    boxed = train_state._init_params(run.predict_model, tuple(config.input.image_size), jax.random.key(1))
    return Predictor(
        config=config,
        run=run,
        mesh=mesh,
        batch_sharding=None,
        params=jax.device_get(train_state._strip_axis_metadata(boxed)),
        step=0,
        predict=None,
        batch_size=1,
        dataset_info=types.SimpleNamespace(
            num_classes=NUM_CLASSES, class_names=tuple("abcd"), label_to_category_id=(1, 2, 3, 4)
        ),
    )


def random_inputs(config, batch: int, seed: int, padded: bool = True):
    """Random images; with `padded`, each image's own size inside the padding is random, as the eval transform
    leaves images of other aspect ratios; otherwise each fills the input."""
    height, width = config.input.image_size
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (batch, height, width, 3), dtype=np.uint8)
    image_hw = np.tile(np.array([[height, width]]), (batch, 1))
    if padded:
        image_hw = np.stack(
            [rng.integers(height // 2, height + 1, batch), rng.integers(width // 2, width + 1, batch)], 1
        )
    return images, image_hw.astype(np.int32)


def jax_outputs(predictor, images, image_hw) -> dict[str, np.ndarray]:
    """What the JAX program (the one `detector.export` writes as StableHLO) returns, and its network's outputs."""
    import flax.linen as nn

    predictor = onnx_export.float32_predictor(predictor)
    detect, network = artifact.detection_function(predictor), artifact.network_function(predictor)
    with nn.logical_axis_rules(()):
        detections, raw = jax.jit(lambda *inputs: (detect(*inputs), network(*inputs)))(images, image_hw)
    paths = jax.tree_util.tree_flatten_with_path(raw)[0]
    raw = {
        onnx_export.NETWORK_PREFIX + jax.tree_util.keystr(path, simple=True, separator="/"): value
        for path, value in paths
    }
    return {key: np.asarray(value) for key, value in {**detections, **raw}.items()}


def onnx_session(path):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def run_onnx(session, images, image_hw) -> dict[str, np.ndarray]:
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, {"images": images, "image_hw": image_hw}), strict=True))


def assert_same_detections(got, want):
    """One to one: every valid detection of `want` has one in `got` with its label, its box to 1e-3 px, its
    score to 1e-4 (and a mask model's mask logits to 1e-4), and no more; matched regardless of order, so
    detections whose scores tie within rounding may swap places."""
    for image in range(want["valid"].shape[0]):
        assert got["valid"][image].sum() == want["valid"][image].sum(), f"image {image}: valid counts differ"
        unmatched = list(np.flatnonzero(got["valid"][image]))
        for slot in np.flatnonzero(want["valid"][image]):
            candidates = [
                j
                for j in unmatched
                if got["classes"][image, j] == want["classes"][image, slot]
                and abs(got["scores"][image, j] - want["scores"][image, slot]) <= SCORE_ATOL
                and np.abs(got["boxes"][image, j] - want["boxes"][image, slot]).max() <= BOX_ATOL
            ]
            assert candidates, (
                f"image {image}: no exported detection matches slot {slot}: class {want['classes'][image, slot]}, "
                f"score {want['scores'][image, slot]}, box {want['boxes'][image, slot]}"
            )
            if "masks" in want:
                np.testing.assert_allclose(
                    got["masks"][image, candidates[0]], want["masks"][image, slot], atol=NETWORK_ATOL, rtol=NETWORK_ATOL
                )
            unmatched.remove(candidates[0])


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    module, overrides, padded = CASES[request.param]
    config = make_config(module, overrides)
    predictor = initialized_predictor(config)
    directory = tmp_path_factory.mktemp(f"onnx_{request.param}")
    path = onnx_export.export_onnx(predictor, str(directory), with_network=True)
    return types.SimpleNamespace(
        config=config, predictor=predictor, path=path, padded=padded, session=onnx_session(path)
    )


def test_cases_cover_a_bf16_recipe_masks_and_both_forms_of_the_deformable_attention():
    assert make_config(*CASES["mask_dino_gather"][:2]).model.dino.mask_dim > 0
    assert CASES["retinanet"][1]["model.dtype"] == "bfloat16"

    def positions(overrides):
        height, width = overrides["input.image_size"]
        return sum((height // s) * (width // s) for s in (8, 16, 32, 64))

    assert positions(CASES["dino_scatter_add"][1]) <= deformable_attention.DENSE_MAX_POSITIONS
    assert positions(CASES["mask_dino_gather"][1]) > deformable_attention.DENSE_MAX_POSITIONS


def test_onnx_model_has_a_dynamic_batch_and_the_artifact_inputs(exported):
    model = onnx.load(exported.path)
    onnx.checker.check_model(model)
    inputs = {value.name: value for value in model.graph.input}
    assert list(inputs) == ["images", "image_hw"]
    height, width = exported.config.input.image_size
    dims = [d.dim_param or d.dim_value for d in inputs["images"].type.tensor_type.shape.dim]
    assert dims == [onnx_export.BATCH_DIM, height, width, 3]
    assert inputs["images"].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    # A bf16 recipe computes in float32.
    types_used = {init.data_type for init in model.graph.initializer} | {
        value.type.tensor_type.elem_type for value in (*model.graph.value_info, *model.graph.output)
    }
    assert onnx.TensorProto.BFLOAT16 not in types_used


@pytest.fixture(scope="module", params=[1, 8])
def outputs(request, exported):
    """onnxruntime's and JAX's outputs for a batch of `param` images."""
    images, image_hw = random_inputs(exported.config, request.param, seed=request.param, padded=exported.padded)
    got = run_onnx(exported.session, images, image_hw)
    want = jax_outputs(exported.predictor, images, image_hw)
    return got, want


def test_the_network_before_top_k_and_nms_computes_what_jax_does(outputs):
    got, want = outputs
    assert set(got) == set(want)
    raw = [name for name in want if name.startswith(onnx_export.NETWORK_PREFIX)]
    assert raw, "the network's outputs are among the model's"
    for name in raw:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], atol=NETWORK_ATOL, rtol=NETWORK_ATOL, err_msg=name)


def test_onnxruntime_detects_what_the_jax_program_does(outputs):
    got, want = outputs
    assert want["valid"].all(), "a score threshold of 0 fills every slot"
    assert_same_detections(got, want)


def test_weights_over_the_limit_go_to_external_data_and_load(tmp_path):
    config = make_config(default, {**TINY_WIDTHS, "input.image_size": (96, 128)})
    predictor = initialized_predictor(config)
    path = onnx_export.export_onnx(predictor, str(tmp_path), external_data_bytes=1024)
    data = tmp_path / onnx_export.EXTERNAL_DATA_FILE
    assert data.exists()
    stored = onnx.load(path, load_external_data=False).graph.initializer
    large = [init for init in stored if init.dims and np.prod(init.dims) * 4 > 1024]
    assert large and all(init.data_location == onnx.TensorProto.EXTERNAL for init in large)
    loaded = artifact.load_artifact(tmp_path)
    assert loaded.batch_size is None and loaded.metadata["program_format"] == artifact.PROGRAM_ONNX
    images, image_hw = random_inputs(config, 3, seed=0)
    assert_same_detections(loaded.call(images, image_hw), jax_outputs(predictor, images, image_hw))
    # Exported again under the limit: the stale external data goes.
    onnx_export.export_onnx(predictor, str(tmp_path))
    assert not data.exists()


def test_an_opset_the_converter_does_not_write_is_one_line():
    with pytest.raises(ConfigError, match=r"--opset=7: the ONNX converter writes opsets 18 to \d+") as raised:
        onnx_export.check_opset(7)
    assert "\n" not in str(raised.value)
    assert onnx_export.check_opset(onnx_export.MIN_OPSET) == onnx_export.MIN_OPSET


def test_a_data_dependent_loop_stops_the_export_naming_it():
    def count_up(x):
        return jax.lax.while_loop(lambda v: v.sum() < 10, lambda v: v + 1, x)

    closed = jax.make_jaxpr(count_up)(np.zeros(3, np.float32))
    with pytest.raises(ConfigError, match="lax.while_loop"):
        onnx_export._evaluate(closed.jaxpr, closed.consts, np.zeros(3, np.float32))


def test_max_pooling_form_equals_reduce_window_max():
    x = np.random.default_rng(0).normal(size=(2, 9, 7, 3)).astype(np.float32)
    pooled = jax.lax.reduce_window(
        x, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
    )
    closed = jax.make_jaxpr(
        lambda v: jax.lax.reduce_window(
            v, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
        )
    )(x)
    assert any(eqn.primitive.name == "reduce_window_max" for eqn in closed.jaxpr.eqns)
    (rewritten,) = onnx_export._evaluate(closed.jaxpr, closed.consts, x)
    np.testing.assert_array_equal(np.asarray(rewritten), np.asarray(pooled))

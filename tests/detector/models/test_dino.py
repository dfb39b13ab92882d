"""The DINO detector: the denoising mask through the whole model, shapes, dtypes, sharding names,
the static position embeddings and proposals, and where gradients may and may not flow."""

from __future__ import annotations

import functools
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from configs import dino_tiny
from detector.models import dino, families
from detector.ops import denoising

NUM_CLASSES = 4
BATCH = 2
IMAGE = 64
NUM_QUERIES = 32
MAX_BOXES = 4
# Ground-truth slots: image 0 has 3 boxes, image 1 has 2 (the rest is padding).
GT_MASK = np.array([[True, True, True, False], [True, True, False, False]])


def tiny_config(dtype: str = "float32"):
    config = dino_tiny.get_config()
    config.input.image_size = (IMAGE, IMAGE)
    config.input.max_boxes = MAX_BOXES
    config.model.dino.num_queries = NUM_QUERIES
    # 2 pairs per box slot: image 0's 3 boxes get 2 groups (the leak test needs a second group that must
    # not see the first), image 1's 2 boxes 4 groups.
    config.model.dino.denoising_pairs = 2 * MAX_BOXES
    config.model.dtype = dtype
    return config


def ground_truth():
    rng = np.random.default_rng(0)
    centres = rng.uniform(0.3, 0.7, (BATCH, MAX_BOXES, 2))
    sizes = rng.uniform(0.1, 0.3, (BATCH, MAX_BOXES, 2))
    labels = rng.integers(0, NUM_CLASSES, (BATCH, MAX_BOXES)).astype(np.int32)
    return np.concatenate([centres, sizes], -1).astype(np.float32), labels


def denoising_inputs(pairs: int, rng=jax.random.key(3)) -> dict[str, jax.Array]:
    """What the DINO objective feeds the model: noised queries and their groups."""
    boxes, labels = ground_truth()
    # Compiled: eagerly, each of its ops would compile a program of its own.
    queries = jax.jit(denoising.contrastive_denoising_queries, static_argnames=("denoising_pairs", "num_classes"))(
        rng, boxes, labels, GT_MASK, denoising_pairs=pairs, num_classes=NUM_CLASSES
    )
    return {
        "labels": queries["labels"],
        "boxes_cxcywh": queries["boxes_cxcywh"],
        "group": queries["group"],
    }


@pytest.fixture(scope="module")
def setup():
    """The tiny DINO at 64 px, 32 queries, with every parameter moved off its initial value.

    Several kernels start at zero (the box heads' last layers, the sampling
    offsets and attention weights): at init the boxes would equal their
    references whatever the queries see. A small random shift of every
    parameter makes each output depend on everything it is allowed to.
    """
    config = tiny_config()
    model = families.create_model(config, NUM_CLASSES)
    images = jax.random.normal(jax.random.key(1), (BATCH, IMAGE, IMAGE, 3))
    params = jax.jit(model.init)(jax.random.key(0), images)["params"]
    params = nn.meta.unbox(params)
    # numpy's generator: jax.random.normal would compile a program per parameter shape.
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda p: np.asarray(p) + 0.05 * rng.standard_normal(p.shape, dtype=np.float32), params)
    pairs = config.model.dino.denoising_pairs
    return types.SimpleNamespace(
        config=config,
        model=model,
        params=params,
        images=images,
        pairs=pairs,
        num_denoising=denoising.num_denoising_queries(pairs, MAX_BOXES),
        dn=denoising_inputs(pairs),
        apply=jax.jit(lambda p, x, dn: model.apply({"params": p}, x, dn)),
        apply_plain=jax.jit(lambda p, x: model.apply({"params": p}, x)),
    )


@pytest.fixture(scope="module")
def outputs(setup):
    return setup.apply(setup.params, setup.images, setup.dn)


def assert_same(a, b, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.mark.slow  # compiles the whole model's gradient with respect to one query (about 20 s)
def test_denoising_query_leaks_only_into_its_own_group(setup, outputs):
    """Changing one valid denoising query (image 0, group 0, positive copy of slot 1) changes the other
    queries of group 0 in image 0, and nothing else: not the matching queries, not the encoder outputs,
    not group 1, not image 1."""
    changed = 1
    dn = dict(setup.dn)
    labels = np.asarray(dn["labels"]).copy()
    boxes = np.asarray(dn["boxes_cxcywh"]).copy()
    labels[0, changed] = (labels[0, changed] + 1) % NUM_CLASSES
    boxes[0, changed] = [0.8, 0.2, 0.15, 0.25]
    dn["labels"], dn["boxes_cxcywh"] = jnp.asarray(labels), jnp.asarray(boxes)
    assert int(setup.dn["group"][0, changed]) == int(setup.dn["group"][0, 0]) == 0  # a valid query of group 0
    after = setup.apply(setup.params, setup.images, dn)

    for key in ("logits", "boxes", "encoder_logits", "encoder_boxes"):
        assert_same(after[key], outputs[key])
    group_size = 2 * 3  # image 0's group: its 3 boxes' positive and negative copies
    for key in ("denoising_logits", "denoising_boxes"):
        assert_same(after[key][:, 1], outputs[key][:, 1])  # image 1
        assert_same(after[key][:, 0, group_size:], outputs[key][:, 0, group_size:])  # group 1 of image 0
        # Every other query of group 0 (valid or padding copies alike) sees the change, from layer 0 on.
        others = [q for q in range(group_size) if q != changed]
        diff = np.abs(np.asarray(after[key][:, 0, others]) - np.asarray(outputs[key][:, 0, others])).max(-1)
        assert np.all(diff > 1e-5), (key, diff)


@pytest.mark.slow  # the module's model (the `outputs` fixture) compiles for about 20 s
def test_matching_outputs_do_not_see_the_denoising_queries(setup, outputs):
    """The matching queries' outputs with denoising queries equal those without any."""
    plain = setup.apply_plain(setup.params, setup.images)
    assert set(plain) == {"logits", "boxes", "encoder_logits", "encoder_boxes"}
    for key in plain:
        np.testing.assert_allclose(np.asarray(plain[key]), np.asarray(outputs[key]), rtol=1e-5, atol=1e-5)


ONE_TO_MANY = 24  # NUM_QUERIES + ONE_TO_MANY = 56 of the 85 proposals of a 64 px input


@pytest.mark.slow  # ~9 s of compiling the hybrid model
def test_one_to_many_query_never_reaches_one_to_one_or_denoising_queries(setup, outputs):
    """Through the whole model, with denoising on: changing one one-to-many query's content changes every
    other one-to-many query and nothing else; the one-to-one and denoising outputs equal those without the
    branch, and prediction's parameters are training's."""
    config = tiny_config()
    config.model.dino.one_to_many_queries = ONE_TO_MANY
    model = families.create_model(config, NUM_CLASSES)
    assert model.num_one_to_many_queries == ONE_TO_MANY
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, IMAGE, IMAGE, 3), jnp.float32))
    content = np.random.default_rng(4).standard_normal((ONE_TO_MANY, config.model.dino.hidden_dim), np.float32)
    params = {**setup.params, "one_to_many_content": content}
    assert set(nn.meta.unbox(shapes["params"])) == set(params)
    apply = jax.jit(lambda p, x, dn: model.apply({"params": p}, x, dn, one_to_many=True))
    hybrid = apply(params, setup.images, setup.dn)
    layers = config.model.dino.decoder_layers
    assert hybrid["one_to_many_logits"].shape == (layers, BATCH, ONE_TO_MANY, NUM_CLASSES)
    assert hybrid["one_to_many_boxes"].shape == (layers, BATCH, ONE_TO_MANY, 4)
    for key in outputs:  # the same numbers, to the rounding of longer matrix products
        np.testing.assert_allclose(np.asarray(hybrid[key]), np.asarray(outputs[key]), rtol=1e-5, atol=1e-5)

    changed = content.copy()
    changed[5] += 1.0
    after = apply({**params, "one_to_many_content": changed}, setup.images, setup.dn)
    for key in outputs:  # exactly: masked keys get zero weight
        np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(hybrid[key]), err_msg=key)
    others = [q for q in range(ONE_TO_MANY) if q != 5]
    for key in ("one_to_many_logits", "one_to_many_boxes"):
        diff = np.abs(np.asarray(after[key])[:, :, others] - np.asarray(hybrid[key])[:, :, others]).max(-1)
        assert np.all(diff > 1e-6), (key, diff.min())
    # Prediction never builds the branch: the same outputs as the model without it.
    plain = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, setup.images)
    for key, value in setup.apply_plain(setup.params, setup.images).items():
        np.testing.assert_array_equal(np.asarray(plain[key]), np.asarray(value), err_msg=key)


def test_shapes_and_float32_outputs_and_params_with_bfloat16_compute():
    """bf16 compute: every output is float32 of the documented shape, every parameter float32."""
    config = tiny_config("bfloat16")
    model = families.create_model(config, NUM_CLASSES)
    assert model.dtype == jnp.bfloat16
    images = jax.ShapeDtypeStruct((BATCH, IMAGE, IMAGE, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.meta.unbox(variables["params"])))

    pairs = config.model.dino.denoising_pairs
    d = denoising.num_denoising_queries(pairs, MAX_BOXES)
    layers = config.model.dino.decoder_layers
    out = jax.eval_shape(model.apply, variables, images, denoising_inputs(pairs))
    want = {
        "logits": (layers, BATCH, NUM_QUERIES, NUM_CLASSES),
        "boxes": (layers, BATCH, NUM_QUERIES, 4),
        "encoder_logits": (BATCH, NUM_QUERIES, NUM_CLASSES),
        "encoder_boxes": (BATCH, NUM_QUERIES, 4),
        "denoising_logits": (layers, BATCH, d, NUM_CLASSES),
        "denoising_boxes": (layers, BATCH, d, 4),
    }
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (s, jnp.float32) for k, s in want.items()}
    plain = jax.eval_shape(model.apply, variables, images)
    assert {k: (v.shape, v.dtype) for k, v in plain.items()} == {
        k: (s, jnp.float32) for k, s in want.items() if not k.startswith("denoising")
    }


def test_every_parameter_is_logically_partitioned_and_attention_is_split_by_heads():
    config = tiny_config()
    model = families.create_model(config, NUM_CLASSES)
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, IMAGE, IMAGE, 3), jnp.float32))
    boxed = jax.tree.leaves(variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxed and all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)
    assert all(len(x.names) == x.value.ndim for x in boxed)

    specs = flatten_dict(nn.get_partition_spec(variables["params"]), sep="/")
    want = {
        "self_attention/query/kernel": P("embed", "heads", "kv"),
        "self_attention/key/kernel": P("embed", "heads", "kv"),
        "self_attention/value/kernel": P("embed", "heads", "kv"),
        "self_attention/output/kernel": P("heads", "kv", "embed"),
        "cross_attention/value/kernel": P("embed", "heads", "kv"),
        "cross_attention/sampling_offsets/kernel": P("embed", "heads", None, None, None),
        "cross_attention/attention_weights/kernel": P("embed", "heads", None),
        "cross_attention/output/kernel": P("heads", "kv", "embed"),
        "ffn/fc1/kernel": P("embed", "mlp"),
        "ffn/fc2/kernel": P("mlp", "embed"),
    }
    dino_config = config.model.dino
    for suffix, spec in want.items():
        matches = {name: s for name, s in specs.items() if name.endswith(suffix)}
        # Decoder layers have all of them; encoder layers have (deformable) self-attention and the FFN.
        expected = dino_config.decoder_layers + (dino_config.encoder_layers if suffix.startswith("ffn") else 0)
        if suffix.startswith("self_attention/") and ("value" in suffix or "output" in suffix):
            expected += dino_config.encoder_layers
        assert len(matches) == expected, (suffix, sorted(matches))
        assert all(s == spec for s in matches.values()), (suffix, matches)
    for layer in range(dino_config.encoder_layers):
        assert specs[f"encoder{layer}/self_attention/sampling_offsets/kernel"] == P("embed", "heads", None, None, None)


def sine_reference(position: float, dim: int, temperature: float = 10000.0) -> np.ndarray:
    """DETR: feature 2k is sin(p / T^(2k/dim)), feature 2k+1 is cos(p / T^(2k/dim))."""
    out = np.zeros(dim)
    for j in range(dim):
        frequency = temperature ** (2 * (j // 2) / dim)
        out[j] = math.sin(position / frequency) if j % 2 == 0 else math.cos(position / frequency)
    return out


def test_proposal_selection_sharded_over_the_mesh_gives_one_devices_choice():
    """Scores split over images and tokens: the same proposals, best first, with -inf (invalid) never chosen."""
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(8, 96)).astype(np.float32)
    scores[:, ::7] = -np.inf
    expected = np.asarray(jax.jit(dino.select_proposals, static_argnums=1)(scores, 20))
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    split = NamedSharding(mesh, P(("data", "fsdp"), "model"))
    actual = jax.jit(dino.select_proposals, static_argnums=1, in_shardings=(split,))(scores, 20)
    np.testing.assert_array_equal(np.asarray(actual), expected)
    np.testing.assert_array_equal(expected, np.argsort(-scores, axis=1, kind="stable")[:, :20])


def test_distinct_proposal_selection_sharded_over_the_mesh_gives_one_devices_choice():
    """DDQ's selection with scores and boxes split over images and tokens: one device's choice."""
    rng = np.random.default_rng(4)
    scores = rng.normal(size=(8, 96)).astype(np.float32)
    scores[:, ::7] = -np.inf
    centres = rng.uniform(0.2, 0.8, (8, 12, 2))[:, rng.integers(0, 12, 96)]
    boxes = np.concatenate([centres + rng.normal(0, 0.005, centres.shape), np.full_like(centres, 0.2)], -1)
    boxes = boxes.astype(np.float32)
    select = functools.partial(dino.select_proposals, count=20, distinct_iou=0.7)
    expected = np.asarray(jax.jit(select)(scores, boxes_cxcywh=boxes))
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    split = NamedSharding(mesh, P(("data", "fsdp"), "model"))
    split_boxes = NamedSharding(mesh, P(("data", "fsdp"), "model", None))
    actual = jax.jit(lambda s, b: select(s, boxes_cxcywh=b), in_shardings=(split, split_boxes))(scores, boxes)
    np.testing.assert_array_equal(np.asarray(actual), expected)
    # Distinct selection changed the choice, so the comparison covers the NMS.
    assert not np.array_equal(expected, np.argsort(-scores, axis=1, kind="stable")[:, :20])


def _distinct_reference(scores, boxes_cxcywh, count, iou_threshold):
    """DDQ's selection in numpy for one image: greedy class-agnostic NMS over the best candidates in score
    order, the distinct ones first, then the suppressed ones, each in score order."""
    candidates = np.argsort(-scores, kind="stable")[: min(len(scores), dino.DISTINCT_CANDIDATES_PER_QUERY * count)]
    cx, cy, w, h = boxes_cxcywh.astype(np.float64).T
    x0, y0, x1, y1 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    kept, suppressed = [], []
    for i in candidates:
        overlap = False
        for k in kept:
            inter = max(0.0, min(x1[i], x1[k]) - max(x0[i], x0[k])) * max(0.0, min(y1[i], y1[k]) - max(y0[i], y0[k]))
            overlap |= inter / (w[i] * h[i] + w[k] * h[k] - inter) > iou_threshold
        (suppressed if overlap or not np.isfinite(scores[i]) else kept).append(i)
    return np.asarray((kept + suppressed)[:count])


def test_distinct_proposal_selection_matches_numpy_nms():
    """Proposals in clusters of near-copies (and invalid ones): distinct boxes first, as a numpy greedy NMS
    gives them; off, the plain top-k."""
    rng = np.random.default_rng(5)
    num_proposals, count = 60, 12
    centres = rng.uniform(0.2, 0.8, (2, 8, 2))[:, rng.integers(0, 8, num_proposals)]
    boxes = np.concatenate([centres + rng.normal(0, 0.005, centres.shape), np.full_like(centres, 0.2)], -1)
    boxes = boxes.astype(np.float32)
    scores = rng.normal(size=(2, num_proposals)).astype(np.float32)
    scores[:, ::9] = -np.inf
    select = jax.jit(dino.select_proposals, static_argnums=(1, 3))
    got = np.asarray(select(scores, count, boxes, 0.6))
    plain = np.argsort(-scores, axis=1, kind="stable")[:, :count]
    np.testing.assert_array_equal(np.asarray(select(scores, count, boxes, 0.0)), plain)
    for b in range(2):
        np.testing.assert_array_equal(got[b], _distinct_reference(scores[b], boxes[b], count, 0.6))
        assert len(set(got[b].tolist())) == count
    # 8 clusters for 12 queries: the first 8 are one per cluster, so the choice differs from the plain top-k.
    assert not np.array_equal(got, plain)


def test_map_position_embedding_matches_the_formula():
    """Token i * W + j: the y half embeds 2 pi (i + 0.5) / H, the x half 2 pi (j + 0.5) / W."""
    height, width, dim = 3, 5, 16
    got = dino.map_position_embedding(height, width, dim)
    assert got.shape == (height * width, dim) and got.dtype == np.float32
    for i in range(height):
        for j in range(width):
            want = np.concatenate(
                [
                    sine_reference(2 * math.pi * (i + 0.5) / height, dim // 2),
                    sine_reference(2 * math.pi * (j + 0.5) / width, dim // 2),
                ]
            )
            np.testing.assert_allclose(got[i * width + j], want, atol=1e-6)


def test_box_position_embedding_order_is_y_x_w_h():
    boxes = np.array([[0.3, 0.6, 0.2, 0.45], [0.9, 0.1, 0.05, 0.7]], np.float32)
    got = np.asarray(dino.box_position_embedding(jnp.asarray(boxes), 8))
    assert got.shape == (2, 32)
    for n, (cx, cy, w, h) in enumerate(boxes):
        want = np.concatenate([sine_reference(2 * math.pi * float(v), 8) for v in (cy, cx, w, h)])
        np.testing.assert_allclose(got[n], want, atol=1e-5)


# Level 0 is tall enough that its top and bottom rows (y = 0.5/70, 69.5/70) fall outside (0.01, 0.99);
# level 5's box side 0.05 * 32 = 1.6 is too large everywhere.
SHAPES = [(70, 3), (4, 4), (2, 2), (1, 1), (1, 1), (1, 1)]


def test_encoder_reference_points_are_pixel_centres_in_token_order():
    got = dino.encoder_reference_points(SHAPES)
    assert got.dtype == np.float32
    want = [
        ((j + 0.5) / width, (i + 0.5) / height) for height, width in SHAPES for i in range(height) for j in range(width)
    ]
    np.testing.assert_allclose(got, np.array(want), atol=1e-7)


def test_encoder_proposals_boxes_and_validity():
    logits, valid = dino.encoder_proposals(SHAPES)
    assert logits.dtype == np.float32 and logits.shape == (sum(h * w for h, w in SHAPES), 4)
    rows = []
    for level, (height, width) in enumerate(SHAPES):
        side = 0.05 * 2**level
        rows += [((j + 0.5) / width, (i + 0.5) / height, side, side) for i in range(height) for j in range(width)]
    boxes = np.array(rows)
    want_valid = np.all((boxes > 0.01) & (boxes < 0.99), -1)
    np.testing.assert_array_equal(valid, want_valid)
    assert 0 < want_valid.sum() < len(want_valid)
    assert not want_valid[0] and want_valid[3] and not want_valid[-1]  # top row of level 0; level 5
    np.testing.assert_allclose(1 / (1 + np.exp(-logits[valid])), boxes[valid], rtol=1e-5)
    np.testing.assert_array_equal(logits[~valid], 0.0)


@pytest.fixture(scope="module")
def pullback(setup):
    """`(dn_boxes, cotangent of the outputs) -> (param grads, dn_boxes grads)`, compiled once."""

    @jax.jit
    def run(params, dn_boxes, cotangent):
        def forward(p, b):
            return setup.model.apply({"params": p}, setup.images, {**setup.dn, "boxes_cxcywh": b})

        _, vjp = jax.vjp(forward, params, dn_boxes)
        return vjp(cotangent)

    return run


def cotangent(outputs, **values):
    return {k: values.get(k, jnp.zeros_like(v)) for k, v in outputs.items()}


def clean_denoising_boxes(setup):
    """Boxes well inside (0, 1), where inverse_sigmoid is not clipped."""
    rng = np.random.default_rng(4)
    shape = (BATCH, setup.num_denoising, 2)
    return jnp.asarray(np.concatenate([rng.uniform(0.2, 0.8, shape), rng.uniform(0.1, 0.4, shape)], -1), jnp.float32)


def grad_norms(grads, prefix):
    flat = flatten_dict(grads, sep="/")
    norms = {k: float(jnp.abs(v).max()) for k, v in flat.items() if k.startswith(prefix)}
    assert norms, prefix
    return norms


@pytest.mark.slow  # a gradient per layer: ~13 s
def test_a_layers_boxes_do_not_depend_on_later_layers(setup, outputs, pullback):
    """Layer 0's boxes get gradient from decoder0 and the box head, none from decoder1 and decoder2."""
    ones = jnp.zeros_like(outputs["boxes"]).at[0].set(1.0)
    grads, _ = pullback(setup.params, setup.dn["boxes_cxcywh"], cotangent(outputs, boxes=ones))
    for layer in range(1, setup.config.model.dino.decoder_layers):
        assert all(v == 0.0 for v in grad_norms(grads, f"decoder{layer}/").values())
    assert max(grad_norms(grads, "decoder0/").values()) > 0
    assert max(grad_norms(grads, "box_head/").values()) > 0


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_decoder_references_are_detached_from_the_encoder_proposals(setup, outputs, pullback):
    """The decoder samples around the top-k encoder proposals without their gradient: no decoder output
    (any layer, logits or boxes) trains the proposal heads; layer 1's boxes train the box head."""
    rng = np.random.default_rng(5)
    values = {k: jnp.asarray(rng.normal(size=outputs[k].shape), jnp.float32) for k in ("logits", "boxes")}
    grads, _ = pullback(setup.params, setup.dn["boxes_cxcywh"], cotangent(outputs, **values))
    for prefix in ("encoder_box_head/", "encoder_class_head/", "proposal_proj/", "proposal_norm/"):
        assert all(v == 0.0 for v in grad_norms(grads, prefix).values()), prefix
    # ... while the encoder outputs do train them.
    grads, _ = pullback(
        setup.params,
        setup.dn["boxes_cxcywh"],
        cotangent(outputs, encoder_boxes=jnp.ones_like(outputs["encoder_boxes"])),
    )
    assert max(grad_norms(grads, "encoder_box_head/").values()) > 0

    layer1 = jnp.zeros_like(outputs["boxes"]).at[1].set(1.0)
    grads, _ = pullback(setup.params, setup.dn["boxes_cxcywh"], cotangent(outputs, boxes=layer1))
    assert all(v > 0 for k, v in grad_norms(grads, "box_head/").items() if k.endswith("kernel"))


@pytest.mark.slow  # ~16 s of compiling a pullback
def test_look_forward_twice_gradient_reaches_inputs_only_through_the_previous_boxes(setup, pullback):
    """Layer k's boxes are sigmoid(delta_k + logit(boxes_{k-1})) with delta_k computed around a detached
    reference, so d boxes_k / d input = boxes_k (1 - boxes_k) / (b (1 - b)) elementwise (the chain
    telescopes) and nothing else: no cross terms through the query positions or sampling locations, and
    not zero (the previous boxes keep their gradient)."""
    boxes = clean_denoising_boxes(setup)
    outputs = setup.apply(setup.params, setup.images, {**setup.dn, "boxes_cxcywh": boxes})
    rng = np.random.default_rng(6)
    weights = jnp.asarray(rng.normal(size=outputs["denoising_boxes"].shape), jnp.float32)
    _, got = pullback(setup.params, boxes, cotangent(outputs, denoising_boxes=weights))
    predicted = np.asarray(outputs["denoising_boxes"], np.float64)
    b = np.asarray(boxes, np.float64)
    want = np.sum(np.asarray(weights) * predicted * (1 - predicted), axis=0) / (b * (1 - b))
    # The layers do move the boxes, so the factor is not the identity.
    assert np.abs(predicted[-1] - b).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-5)

"""The detector as an ONNX model: what ONNX Runtime, TensorRT, OpenVINO and Triton run.

`export_onnx` converts the detection function `artifact.export_predictor`
exports as StableHLO (`artifact.detection_function`: uint8 images and their
sizes in; boxes, scores, classes, valid and a mask model's masks out; the
parameters as constants) with jax2onnx, with the batch dimension left open
("batch"), and writes model.json beside it as for StableHLO.

jax2onnx converts JAX primitives one by one, and some of the detectors'
have no form it writes, or one ONNX Runtime cannot run. The function's jaxpr
is evaluated once more, primitive by primitive (`_evaluate`), with those
replaced by the same computation in primitives that convert:

  reduce_window_max   (max pooling) the max of its strided slices
  gather / scatter    with batching dimensions (vmap's indexing: greedy NMS
    with batching dims  per image, the deformable attention's row gathers
                      above 512 positions and its scatter-add below): plain
                      ones whose indices name each batch position
  scatter max/min     of booleans: on 0/1 integers
  a scalar filled to  one broadcast of the scalar, made when read (else a
    a shape, twice    4 MB initializer per IoU matrix's zeros); a multiple
                      of the batch ("6*batch": ViTDet's windows) filled as
                      (batch, 6) and reshaped
  scan                (NMS's fixed-length loop) a scan of the replaced body:
                      an ONNX Loop
  while               a data-dependent loop: the export stops with an error
                      naming it

A bf16 recipe is exported computing in float32. Weights over 2 GB (the
protobuf limit) go to model.onnx.data beside the model (ONNX external data).

jax2onnx 0.17 declares orbax-checkpoint<0.11.37 as a requirement though it
does not import it, and this project runs Orbax 0.12: it is installed beside
the project without its declared requirements (the "onnx" extra holds the rest):

  pip install -e ".[onnx]" && pip install --no-deps "jax2onnx==0.17.1"
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives

from detector.errors import ConfigError
from detector.models import families
from detector.serving import artifact
from detector.serving.predictor import Predictor

ONNX_FILE = "model.onnx"
EXTERNAL_DATA_FILE = "model.onnx.data"
INPUT_NAMES = ("images", "image_hw")
BATCH_DIM = "batch"
# The network's raw outputs' names begin with this (`onnx_function(with_network=True)`).
NETWORK_PREFIX = "network/"
DEFAULT_OPSET = 21
# The lowest opset of the operators the converter writes for the detectors (ScatterND's max reduction).
MIN_OPSET = 18
# Protobuf refuses messages over 2 GB: larger weights go to external data.
PROTO_LIMIT_BYTES = 2_000_000_000
INSTALL_HINT = 'pip install -e ".[onnx]" && pip install --no-deps "jax2onnx==0.17.1"'


def _converter():
    try:
        import jax2onnx
        import onnx
    except ImportError as e:
        raise ConfigError(f"ONNX export needs jax2onnx and onnx ({e.name} is not installed): {INSTALL_HINT}") from e
    return jax2onnx, onnx


def check_opset(opset: int) -> int:
    """`opset` if the converter writes it; ConfigError naming the range otherwise."""
    _, onnx = _converter()
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= int(opset) <= newest:
        raise ConfigError(
            f"--opset={opset}: the ONNX converter writes opsets {MIN_OPSET} to {newest} "
            f"(onnx {onnx.__version__}); choose one of them, e.g. --opset={DEFAULT_OPSET}"
        )
    return int(opset)


# ----------------------------------------------------------------------------
# The jaxpr, evaluated again with ONNX-friendly forms.
# ----------------------------------------------------------------------------


def _max_of_slices(x, *, window_dimensions, window_strides, padding, base_dilation, window_dilation):
    """reduce_window_max as the max of window_dimensions' strided slices of the padded input (same values)."""
    if any(d != 1 for d in (*base_dilation, *window_dilation)):
        raise ConfigError("max pooling with dilation has no ONNX form in this export")
    for axis, (lo, hi) in enumerate(padding):
        # -inf blocks cut from x itself: a pad (or a constant of x's shape) does not convert with a symbolic batch.
        if lo or hi:
            edge = jnp.minimum(jax.lax.slice_in_dim(x, 0, 1, axis=axis), jnp.array(-jnp.inf, x.dtype))
            blocks = [jnp.repeat(edge, lo, axis=axis)] if lo else []
            blocks += [x] + ([jnp.repeat(edge, hi, axis=axis)] if hi else [])
            x = jnp.concatenate(blocks, axis=axis)
    out_shape = [(x.shape[d] - window_dimensions[d]) // window_strides[d] + 1 for d in range(x.ndim)]
    result = None
    for offsets in itertools.product(*(range(w) for w in window_dimensions)):
        limits = [o + (n - 1) * s + 1 for o, n, s in zip(offsets, out_shape, window_strides, strict=True)]
        piece = jax.lax.slice(x, offsets, limits, window_strides)
        result = piece if result is None else jnp.maximum(result, piece)
    return result


def _gather_with_batch_indices(operand, indices, *, dimension_numbers, **params):
    """A gather with batching dimensions (what `vmap` makes of indexing) as a plain gather whose indices
    name each batch position: jax2onnx lowers the batching form to a GatherND of the wrong shape, the
    plain one correctly. Each batching dimension becomes a collapsed one, indexed by an iota over the
    indices' matching dimension; the output is the same array."""
    numbers = dimension_numbers
    batch_shape = indices.shape[:-1]
    positions = [
        jax.lax.broadcasted_iota(indices.dtype, (*batch_shape, 1), dim) for dim in numbers.start_indices_batching_dims
    ]
    plain = jax.lax.GatherDimensionNumbers(
        offset_dims=numbers.offset_dims,
        collapsed_slice_dims=tuple(sorted((*numbers.collapsed_slice_dims, *numbers.operand_batching_dims))),
        start_index_map=(*numbers.start_index_map, *numbers.operand_batching_dims),
        operand_batching_dims=(),
        start_indices_batching_dims=(),
    )
    params = {**params, "indices_are_sorted": False, "unique_indices": False}
    return jax.lax.gather_p.bind(
        operand, jnp.concatenate([indices, *positions], axis=-1), dimension_numbers=plain, **params
    )


def _loop_in_onnx_forms(eqn, args):
    """The scan again, its body evaluated by `_evaluate` (jax2onnx writes it as an ONNX Loop)."""
    params = eqn.params
    body, num_consts, num_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts, carry, xs = (
        args[:num_consts],
        tuple(args[num_consts : num_consts + num_carry]),
        tuple(args[num_consts + num_carry :]),
    )

    def step(carry, x):
        outputs = _evaluate(body.jaxpr, body.consts, *consts, *carry, *x)
        return tuple(outputs[:num_carry]), tuple(outputs[num_carry:])

    carry, ys = jax.lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"])
    return [*carry, *ys]


def _scatter_in_onnx_forms(eqn, operand, indices, updates):
    """A scatter whose batching dimensions are indexed (see `_gather_with_batch_indices`), and whose boolean
    max or min is taken on 0/1 integers (ONNX Runtime's ScatterND reduces no booleans)."""
    numbers = eqn.params["dimension_numbers"]
    params = dict(eqn.params)
    if numbers.operand_batching_dims:
        positions = [
            jax.lax.broadcasted_iota(indices.dtype, (*indices.shape[:-1], 1), dim)
            for dim in numbers.scatter_indices_batching_dims
        ]
        indices = jnp.concatenate([indices, *positions], axis=-1)
        params["dimension_numbers"] = jax.lax.ScatterDimensionNumbers(
            update_window_dims=numbers.update_window_dims,
            inserted_window_dims=tuple(sorted((*numbers.inserted_window_dims, *numbers.operand_batching_dims))),
            scatter_dims_to_operand_dims=(*numbers.scatter_dims_to_operand_dims, *numbers.operand_batching_dims),
            operand_batching_dims=(),
            scatter_indices_batching_dims=(),
        )
        params.update(indices_are_sorted=False, unique_indices=False)
    as_integers = operand.dtype == jnp.bool_ and eqn.primitive.name in ("scatter-max", "scatter-min")
    if as_integers:
        operand, updates = operand.astype(jnp.int32), updates.astype(jnp.int32)
    result = eqn.primitive.bind(operand, indices, updates, **params)
    return result.astype(jnp.bool_) if as_integers else result


def _inner_jaxpr(eqn):
    """The closed jaxpr a call-like primitive (jit, custom_jvp_call, custom_vjp_call) evaluates, or None."""
    for key in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(key)
        if inner is not None and hasattr(inner, "jaxpr"):
            return inner
    return None


@dataclasses.dataclass(frozen=True)
class _Fill:
    """A scalar broadcast to `shape`, not made yet."""

    scalar: object
    shape: tuple
    sharding: object

    def array(self):
        # jax2onnx sizes a broadcast's dimensions from the inputs' symbols only: a multiple of one (windows
        # or heads folded into the batch, "6*batch") is filled as (batch, 6) and reshaped.
        split = []
        for dim in self.shape:
            symbols = ()
            if not isinstance(dim, int):
                symbols = jax.export.symbolic_shape(",".join(sorted(dim._get_vars())), scope=dim.scope)
            factor = dim // symbols[0] if len(symbols) == 1 else None
            if factor is not None and isinstance(factor, int) and factor * symbols[0] == dim and factor != 1:
                split.append((symbols[0], factor))
            else:
                split.append((dim,))
        if all(len(dims) == 1 for dims in split):
            return jax.lax.broadcast_in_dim(self.scalar, self.shape, (), out_sharding=self.sharding)
        filled = jax.lax.broadcast_in_dim(self.scalar, tuple(d for dims in split for d in dims), ())
        return jax.lax.reshape(filled, self.shape)


def _evaluate(jaxpr, consts, *args, memo: dict | None = None) -> list:
    """Evaluates `jaxpr` primitive by primitive (under whatever trace calls it), with the ONNX forms of the
    module docstring in place.

    An equation whose primitive, parameters and inputs were evaluated before is not evaluated again
    (`memo`, shared with the nested calls): the network traced twice (its raw outputs beside the
    detections) converts once.
    """
    memo = {} if memo is None else memo
    env: dict = {}

    def read(var):
        if isinstance(var, jax.extend.core.Literal):
            return var.val
        value = env[var]
        if isinstance(value, _Fill):
            key = ("fill", _value_key(value.scalar), tuple(map(str, value.shape)))
            value = env[var] = _memoized(memo, key, (value.scalar,), lambda fill=value: [fill.array()])[0]
        return value

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            operand = eqn.invars[0]
            source = operand.val if isinstance(operand, jax.extend.core.Literal) else env[operand]
            if isinstance(source, _Fill) or np.ndim(source) == 0:
                # A scalar filling a shape, maybe filled again (vmap broadcasting a constant over the batch):
                # made when read, in one broadcast. jax2onnx writes a constant fill out as an initializer of
                # the fill's size (4 MB for an IoU matrix's zeros), and mis-sizes the second broadcast of it.
                scalar = source.scalar if isinstance(source, _Fill) else source
                env[eqn.outvars[0]] = _Fill(scalar, eqn.params["shape"], eqn.params["sharding"])
                continue
        values = [read(v) for v in eqn.invars]
        if name == "while":
            raise ConfigError(
                "the detection program holds a data-dependent loop (lax.while_loop), which has no fixed ONNX "
                "form; export it as StableHLO (--format=jax)"
            )
        try:
            key = (eqn.primitive, tuple(map(_value_key, values)), tuple(sorted(eqn.params.items())))
            hash(key)
        except TypeError:  # unhashable parameters: evaluated every time
            key = None
        outputs = _memoized(memo, key, values, lambda eqn=eqn, values=values: _evaluate_equation(eqn, values, memo))
        for var, value in zip(eqn.outvars, outputs, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _evaluate_equation(eqn, values, memo) -> list:
    name = eqn.primitive.name
    if name == "reduce_window_max":
        return [_max_of_slices(values[0], **eqn.params)]
    if eqn.primitive is primitives.scan_p:  # a fixed-length loop
        return _loop_in_onnx_forms(eqn, values)
    if name == "gather" and eqn.params["dimension_numbers"].operand_batching_dims:
        return [_gather_with_batch_indices(*values, **eqn.params)]
    if name.startswith("scatter"):
        return [_scatter_in_onnx_forms(eqn, *values)]
    if name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "closed_call") and _inner_jaxpr(eqn):
        # Inference only: a custom derivative rule is dropped with its call.
        inner = _inner_jaxpr(eqn)
        return _evaluate(inner.jaxpr, inner.consts, *values, memo=memo)
    with eqn.ctx.manager:
        outputs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return outputs if eqn.primitive.multiple_results else [outputs]


def _value_key(value):
    """A scalar by its value, anything else by its identity (`_memoized` checks it is the same object)."""
    if np.ndim(value) == 0 and not isinstance(value, jax.core.Tracer):
        return ("scalar", np.asarray(value).dtype.str, np.asarray(value).item())
    return id(value)


def _memoized(memo: dict, key, values, evaluate) -> list:
    if key is None:
        return evaluate()
    hit = memo.get(key)
    # An identity key holds only while its object lives: the memo keeps the inputs and compares them.
    if hit is not None and all(a is b or np.ndim(a) == 0 for a, b in zip(hit[0], values, strict=True)):
        return hit[1]
    outputs = evaluate()
    memo[key] = (list(values), outputs)
    return outputs


# ----------------------------------------------------------------------------
# The export.
# ----------------------------------------------------------------------------


def float32_predictor(predictor: Predictor) -> Predictor:
    """The predictor computing in float32 (a bf16 recipe's `model.dtype`), with the same parameters."""
    if str(predictor.config.model.get("dtype", "float32")) == "float32":
        return predictor
    config = copy.deepcopy(predictor.config)
    with config.unlocked():
        config.model.dtype = "float32"
    num_classes = predictor.dataset_info.num_classes
    objective = families.objective(config, families.create_model(config, num_classes), num_classes)
    run = dataclasses.replace(predictor.run, config=config, objective=objective)
    return dataclasses.replace(predictor, config=config, run=run)


def onnx_function(
    predictor: Predictor, *, with_network: bool = False
) -> tuple[Callable[..., tuple], tuple[str, ...], tuple]:
    """The detection function in its ONNX forms, for any batch size.

    With `with_network`, the function also returns the network's raw outputs
    before top-k and NMS (`artifact.network_function`), named "network" and
    their path in the network's output tree: what a check of the exported
    network against JAX's compares.

    The function is traced here, outside the converter: jax2onnx replaces
    some Flax functions while it traces, and the jaxpr is what is converted.

    Returns:
      (fn(images, image_hw) -> outputs in `names`' order, names, the inputs' ShapeDtypeStructs, whose batch
      dimension is the symbol `BATCH_DIM`).
    """
    # The parameters on this host once: the detections and the network's outputs read the same constants.
    predictor = dataclasses.replace(float32_predictor(predictor), params=artifact.host_params(predictor.params))
    height, width = (int(v) for v in predictor.config.input.image_size)
    batch = jax.export.symbolic_shape(BATCH_DIM)[0]
    inputs = (
        jax.ShapeDtypeStruct((batch, height, width, 3), jnp.uint8),
        jax.ShapeDtypeStruct((batch, 2), jnp.int32),
    )
    detect = artifact.detection_function(predictor)
    network = artifact.network_function(predictor) if with_network else None
    with nn.logical_axis_rules(()):
        shapes = jax.eval_shape(detect, *inputs)
        names = tuple(n for n in (*artifact.OUTPUT_NAMES, *artifact.MASK_OUTPUT_NAMES) if n in shapes)
        if network is not None:
            paths = jax.tree_util.tree_flatten_with_path(jax.eval_shape(network, *inputs))[0]
            names += tuple(NETWORK_PREFIX + jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in paths)

        def program(images, image_hw):
            detections = detect(images, image_hw)
            raw = jax.tree_util.tree_leaves(network(images, image_hw)) if network is not None else []
            return (*(detections[n] for n in names if n in detections), *raw)

        closed = jax.make_jaxpr(program)(*inputs)

    consts = _shared_constants(closed.consts)

    def fn(images, image_hw):
        return tuple(_evaluate(closed.jaxpr, consts, images, image_hw))

    return fn, names, inputs


def _shared_constants(consts: list) -> list:
    """`consts` with each array equal to an earlier one replaced by it: the jaxpr holds a parameter (or a
    table computed while tracing) once per traced call, and `_evaluate` merges equations by their inputs'
    identity. Hashing reads each array once (about 1 GB/s)."""
    canonical: dict = {}
    shared = []
    for const in consts:
        array = np.ascontiguousarray(np.asarray(const))
        key = (array.shape, array.dtype.str, hashlib.blake2b(memoryview(array).cast("B")).digest())
        shared.append(canonical.setdefault(key, const))
    return shared


def export_onnx(
    predictor: Predictor,
    directory: str,
    *,
    opset: int = DEFAULT_OPSET,
    with_network: bool = False,
    external_data_bytes: int = PROTO_LIMIT_BYTES,
) -> str:
    """Writes DIRECTORY/model.onnx and DIRECTORY/model.json; returns the model's path.

    The model takes images uint8 [batch, H, W, 3] and image_hw int32 [batch, 2]
    (as model.json describes them) and returns `artifact.OUTPUT_NAMES` (and
    masks for a mask model) as `artifact.detection_function` does, for any
    batch. Weights over `external_data_bytes` (default: protobuf's 2 GB
    limit) go to DIRECTORY/model.onnx.data. `with_network`: see `onnx_function`.
    """
    fn, names, inputs = onnx_function(predictor, with_network=with_network)
    model = convert(fn, inputs, names, opset=opset)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ONNX_FILE)
    _save(model, path, external_data_bytes)
    _, onnx = _converter()
    program = {
        "exported_file": ONNX_FILE,
        "program_format": artifact.PROGRAM_ONNX,
        "opset": int(opset),
        "onnx_version": onnx.__version__,
    }
    with nn.logical_axis_rules(()):
        shapes = jax.eval_shape(fn, *inputs)
    outputs = {name: shape for name, shape in zip(names, shapes, strict=True) if not name.startswith(NETWORK_PREFIX)}
    metadata = artifact.artifact_metadata(predictor, inputs, outputs, program)
    with open(os.path.join(directory, artifact.METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=2)
    return path


def export_to_directory(predictor: Predictor, directory: str, *, checkpoint: str = "", opset: int = DEFAULT_OPSET):
    """`export_onnx` on process 0 (every process gathers the parameters); returns there one line saying what was
    written where (None on the others)."""
    check_opset(opset)
    # Every process joins the parameters' gather; one writes.
    predictor = dataclasses.replace(predictor, params=artifact.host_params(predictor.params))
    if jax.process_index() != 0:
        return None
    path = export_onnx(predictor, directory, opset=opset)
    written = [
        p
        for p in (path, os.path.join(directory, EXTERNAL_DATA_FILE), os.path.join(directory, artifact.METADATA_FILE))
        if os.path.exists(p)
    ]
    sizes = ", ".join(f"{os.path.basename(p)} ({artifact.format_size(os.path.getsize(p))})" for p in written)
    return (
        f"exported step {predictor.step}{f' ({checkpoint})' if checkpoint else ''} as ONNX (opset {opset}, any "
        f"batch size) to {directory}: {sizes}"
    )


def convert(
    fn: Callable[..., tuple],
    inputs: tuple,
    names: tuple[str, ...],
    *,
    opset: int = DEFAULT_OPSET,
    input_names: tuple[str, ...] = INPUT_NAMES,
):
    """jax2onnx's onnx_ir model of `fn` (already in its ONNX forms, see `onnx_function`) for `inputs`
    (ShapeDtypeStructs, named `INPUT_NAMES`; a symbolic dimension stays a named one), outputs named `names`."""
    jax2onnx, _ = _converter()
    opset = check_opset(opset)
    logging.getLogger("jax2onnx").setLevel(logging.ERROR)
    with _symbolic_dims_as_names(), _linear_converter_lookups(), _converter_errors():
        return jax2onnx.to_onnx(
            fn,
            inputs=list(inputs),
            model_name="detector",
            opset=opset,
            return_mode="ir",
            input_names=list(input_names),
            output_names=list(names),
        )


@contextlib.contextmanager
def _converter_errors():
    """A primitive the converter has no form for: one line naming it and the way out."""
    try:
        yield
    except NotImplementedError as e:
        raise ConfigError(
            f"the ONNX converter cannot write this detector's program ({e}); export it as StableHLO (--format=jax)"
        ) from e


@contextlib.contextmanager
def _symbolic_dims_as_names():
    """Lets onnx_ir record a shape holding JAX's symbolic batch dimension as a named dimension.

    Several of jax2onnx's lowerings give onnx_ir the output shape as JAX computes it, symbolic batch included,
    and onnx_ir accepts ints and names only: the symbol's expression (e.g. "batch") becomes the name.
    """
    import onnx_ir._core as core

    convert = core._maybe_convert_to_symbolic_dim

    def convert_symbolic(dim):
        if isinstance(dim, jax.export.SymbolicDimType if hasattr(jax.export, "SymbolicDimType") else ()) or (
            type(dim).__name__ == "_DimExpr"
        ):
            return core.SymbolicDim(str(dim))
        return convert(dim)

    core._maybe_convert_to_symbolic_dim = convert_symbolic
    try:
        yield
    finally:
        core._maybe_convert_to_symbolic_dim = convert


@contextlib.contextmanager
def _linear_converter_lookups():
    """jax2onnx 0.17 looks values up by scanning: whether an equation's outputs are in the graph (every node made
    so far) and a broadcast operand's constant value (every initializer). Both are quadratic in the program's
    length: minutes for a detector's unrolled loops. onnx_ir knows both directly (a value's producer, whether
    it is a graph input or an initializer, the initializers by name); the scans stay for anything else."""
    from jax2onnx.converter import conversion_api, output_binding
    from jax2onnx.plugins.jax.lax import broadcast_in_dim

    connected_by_search = output_binding._value_is_graph_connected
    optimize = conversion_api._optimize_graph_with_failure_policy
    materialize = broadcast_in_dim._materialize_constant_array

    def connected(ctx, value):
        if value.producer() is not None or value.is_graph_input() or value.is_initializer():
            return True
        return value.name in ctx.builder.graph.initializers or connected_by_search(ctx, value)

    def constant_array(ctx, value, seen=None):
        name = getattr(value, "name", None)
        initializer = ctx.builder.graph.initializers.get(name) if name else None
        if initializer is not None:
            array = broadcast_in_dim._value_to_numpy(initializer)
            if array is not None:
                return array
        # The rest of jax2onnx's search (the value itself, its producer's inputs) without its initializer scan.
        return materialize(_WithoutInitializerList(ctx), value, seen)

    output_binding._value_is_graph_connected = connected
    broadcast_in_dim._materialize_constant_array = constant_array
    # Its graph clean-up passes (redundant casts, dead nodes) scan every node per node too; ONNX Runtime
    # folds the same when it loads the model.
    conversion_api._optimize_graph_with_failure_policy = lambda model, **kwargs: None
    try:
        yield
    finally:
        output_binding._value_is_graph_connected = connected_by_search
        broadcast_in_dim._materialize_constant_array = materialize
        conversion_api._optimize_graph_with_failure_policy = optimize


class _WithoutInitializerList:
    """A conversion context whose builder shows no initializer list (they are looked up by name instead)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.builder = _BuilderWithoutInitializerList(ctx.builder)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


class _BuilderWithoutInitializerList:
    initializers = ()
    _initializers = ()

    def __init__(self, builder):
        self._builder = builder

    def __getattr__(self, name):
        return getattr(self._builder, name)


def _save(model, path: str, external_data_bytes: int) -> None:
    import onnx_ir

    weights = sum(
        int(np.prod(value.shape.numpy())) * value.dtype.itemsize
        for value in model.graph.initializers.values()
        if value.const_value is not None
    )
    external = os.path.join(os.path.dirname(path), EXTERNAL_DATA_FILE)
    if os.path.exists(external):
        os.remove(external)
    if weights > external_data_bytes:
        onnx_ir.save(model, path, external_data=EXTERNAL_DATA_FILE)
    else:
        onnx_ir.save(model, path)

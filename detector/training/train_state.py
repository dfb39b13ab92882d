"""The train state, its shardings, and sharded initialisation.

Shardings come from the parameters' logical axis names: an abstract init
(`jax.eval_shape`) gives the parameter shapes and names without allocating
anything, the config's rules turn names into mesh axes, and the optimizer
state inherits the sharding of the parameter it belongs to.

Parameters that do not train (`optim.trainable_parameters`: a frozen
backbone, the base weights under LoRA) stay in `params` but have no
optimizer state and no EMA: both are built over `select_params(params,
trainable)`, a nested dict of the trainable leaves alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from sharding import mesh_sharding_for_logical_specs, replicated


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    # Of the trainable parameters alone (`select_params`).
    opt_state: Any
    # The exponential moving average of the trainable parameters
    # (`optimizer.ema_decay` > 0), sharded like them; None when off.
    ema_params: Any = None


def select_params(tree: Any, keep: Callable[[tuple[str, ...]], bool] | None) -> Any:
    """The leaves of the nested dict `tree` whose path (tuple of keys) `keep` accepts, as a nested dict.

    `keep` None: `tree` itself. Works on any leaves (arrays, shardings,
    ShapeDtypeStructs); the selection is static, so the result is too.
    """
    if keep is None:
        return tree
    flat = flax.traverse_util.flatten_dict(tree)
    return flax.traverse_util.unflatten_dict({path: leaf for path, leaf in flat.items() if keep(path)})


def select_like(tree: Any, template: Any) -> Any:
    """The leaves of `tree` at the paths that the nested dict `template` holds (e.g. the EMA's)."""
    paths = set(flax.traverse_util.flatten_dict(template))
    return select_params(tree, lambda path: path in paths)


def merge_params(tree: Any, override: Any) -> Any:
    """`tree` with each leaf that `override` (a nested dict over a subset of its paths) holds taken from it."""
    flat = flax.traverse_util.flatten_dict(tree)
    return flax.traverse_util.unflatten_dict({**flat, **flax.traverse_util.flatten_dict(override)})


def evaluated_params(state: TrainState) -> Any:
    """What evaluation, the best checkpoint and the export use: the parameters, with their EMA where kept."""
    return state.params if state.ema_params is None else merge_params(state.params, state.ema_params)


def restart_ema(state: TrainState) -> TrainState:
    """`state` with its EMA (when kept) restarted as a copy of the parameters it averages."""
    if state.ema_params is None:
        return state
    return state.replace(ema_params=jax.tree.map(jnp.copy, select_like(state.params, state.ema_params)))


def _strip_axis_metadata(boxed_params):
    # `nn.meta.unbox` would also apply sharding constraints, which is only
    # valid on traced arrays; here the caller sets shardings explicitly.
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
        boxed_params,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


def _init_params(model: nn.Module, image_size: tuple[int, int], rng: jax.Array):
    dummy_images = jnp.zeros((1, *image_size, 3), jnp.float32)
    return model.init(rng, dummy_images)["params"]


def params_shardings(model: nn.Module, image_size: tuple[int, int], mesh: Mesh, rules) -> tuple[Any, Any]:
    """(abstract parameters, their NamedShardings) on `mesh`, without allocating anything.

    What inference needs (no optimizer state). Must run inside
    `sharding.use_mesh(mesh, rules)`.
    """
    boxed = jax.eval_shape(lambda r: _init_params(model, image_size, r), jax.random.key(0))
    abstract_params = _strip_axis_metadata(boxed)
    shardings = mesh_sharding_for_logical_specs(abstract_params, nn.get_partition_spec(boxed), mesh, rules)
    abstract_params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings
    )
    return abstract_params, shardings


def state_shardings(
    model: nn.Module,
    tx: optax.GradientTransformation,
    image_size: tuple[int, int],
    mesh: Mesh,
    rules,
    *,
    ema: bool = False,
    trainable: Callable[[tuple[str, ...]], bool] | None = None,
) -> tuple[TrainState, TrainState]:
    """Returns (abstract_state, shardings) without allocating parameters.

    `abstract_state` holds `jax.ShapeDtypeStruct`s carrying their sharding, the
    form Orbax needs to restore a checkpoint onto this mesh. With `ema`, the
    state holds an EMA of the trainable parameters, sharded like them.
    `trainable` (`optim.trainable_parameters`; None: all) picks the
    parameters the optimizer state and the EMA are kept for.
    Must run inside `sharding.use_mesh(mesh, rules)`.
    """
    abstract_params, param_shardings = params_shardings(model, image_size, mesh, rules)
    trained_shardings = select_params(param_shardings, trainable)
    abstract_opt_state = jax.eval_shape(tx.init, select_params(abstract_params, trainable))
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        trained_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )
    shardings = TrainState(
        step=replicated(mesh),
        params=param_shardings,
        opt_state=opt_shardings,
        ema_params=trained_shardings if ema else None,
    )
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=abstract_params,
        opt_state=abstract_opt_state,
        ema_params=select_params(abstract_params, trainable) if ema else None,
    )
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    return abstract, shardings


def init_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    image_size: tuple[int, int],
    shardings: TrainState,
    rng: jax.Array,
    *,
    trainable: Callable[[tuple[str, ...]], bool] | None = None,
) -> TrainState:
    """Initialises the state directly in its sharded layout (no host-side full copy).

    `trainable`: as for `state_shardings`, which made `shardings`. The EMA,
    when `shardings` has one, starts as a copy of the trainable parameters.
    """

    def init(rng):
        params = _strip_axis_metadata(_init_params(model, image_size, rng))
        trained = select_params(params, trainable)
        ema = jax.tree.map(jnp.copy, trained) if shardings.ema_params is not None else None
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(trained), ema_params=ema)

    return jax.jit(init, out_shardings=shardings)(rng)


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def describe_param_shardings(params) -> dict[str, str]:
    """`{'backbone/stem_conv/Conv_0/kernel': 'P(None, None, None, model)', ...}` for logs and tests."""
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    return {
        k: str(v.sharding.spec) if isinstance(getattr(v, "sharding", None), NamedSharding) else "?"
        for k, v in flat.items()
    }

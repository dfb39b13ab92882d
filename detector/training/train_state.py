"""The train state, its shardings, and sharded initialisation.

Shardings come from the parameters' logical axis names: an abstract init
(`jax.eval_shape`) gives the parameter shapes and names without allocating
anything, the config's rules turn names into mesh axes, and the optimizer
state inherits the sharding of the parameter it belongs to.
"""

from __future__ import annotations

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
    opt_state: Any
    # The exponential moving average of `params` (`optimizer.ema_decay` > 0),
    # sharded like them; None when off.
    ema_params: Any = None


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
) -> tuple[TrainState, TrainState]:
    """Returns (abstract_state, shardings) without allocating parameters.

    `abstract_state` holds `jax.ShapeDtypeStruct`s carrying their sharding, the
    form Orbax needs to restore a checkpoint onto this mesh. With `ema`, the
    state holds an EMA of the parameters, sharded like them.
    Must run inside `sharding.use_mesh(mesh, rules)`.
    """
    abstract_params, param_shardings = params_shardings(model, image_size, mesh, rules)
    abstract_opt_state = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )
    shardings = TrainState(
        step=replicated(mesh),
        params=param_shardings,
        opt_state=opt_shardings,
        ema_params=param_shardings if ema else None,
    )
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=abstract_params,
        opt_state=abstract_opt_state,
        ema_params=abstract_params if ema else None,
    )
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    return abstract, shardings


def init_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    image_size: tuple[int, int],
    shardings: TrainState,
    rng: jax.Array,
) -> TrainState:
    """Initialises the state directly in its sharded layout (no host-side full copy).

    The EMA, when `shardings` has one, starts as a copy of the parameters.
    """

    def init(rng):
        params = _strip_axis_metadata(_init_params(model, image_size, rng))
        ema = jax.tree.map(jnp.copy, params) if shardings.ema_params is not None else None
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), ema_params=ema)

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

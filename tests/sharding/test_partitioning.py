import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import sharding
from configs import default
from detector.models import families
from detector.models.retinanet import create_model
from detector.training import optim
from detector.training.train_state import describe_param_shardings, init_train_state, state_shardings


def test_logical_rules_reject_unknown_mesh_axis():
    config = default.get_config()
    config.sharding.rules = (("batch", "dta"),)
    with pytest.raises(sharding.MeshError, match="names mesh axis 'dta'"):
        sharding.logical_rules(config.sharding)


def test_indivisible_dimension_stays_replicated():
    mesh = sharding.create_mesh(dict(data=1, fsdp=4, model=2))
    rules = (("conv_in", "fsdp"), ("conv_out", "model"))  # both dims, to test each is fitted
    abstract = {
        "stem": jax.ShapeDtypeStruct((7, 7, 3, 16), jnp.float32),
        "block": jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32),
    }
    logical = {"stem": P(None, None, "conv_in", "conv_out"), "block": P(None, None, "conv_in", "conv_out")}
    shardings = sharding.mesh_sharding_for_logical_specs(abstract, logical, mesh, rules)
    assert shardings["stem"].spec == P(None, None, None, "model")  # 3 input channels do not split 4 ways
    assert shardings["block"].spec == P(None, None, "fsdp", "model")


def _sharded_state(mesh_config, rules=None):
    config = default.get_config()
    config.mesh.update(mesh_config)
    mesh = sharding.create_mesh(config.mesh)
    rules = rules or sharding.logical_rules(config.sharding)
    model = create_model(config.model, 4, families.num_anchors_per_location(config))
    tx, _ = optim.create_optimizer(config.optimizer, 10)
    with sharding.use_mesh(mesh, rules):
        _, shardings = state_shardings(model, tx, (64, 64), mesh, rules)
        state = init_train_state(model, tx, (64, 64), shardings, jax.random.key(0))
    return state


@pytest.mark.parametrize(
    "mesh_config,axis",
    # Each compiles the train state's initialisation on its mesh (7-10 s): the model axis in the slow tier.
    [
        pytest.param(dict(data=4, fsdp=1, model=2), "model", marks=pytest.mark.slow),
        (dict(data=2, fsdp=4, model=1), "fsdp"),
    ],
)
def test_parameters_and_optimizer_state_are_partitioned(mesh_config, axis):
    state = _sharded_state(mesh_config)
    specs = describe_param_shardings(state.params)
    kernel = "backbone/stage2_block1/Conv_1/kernel"
    assert axis in specs[kernel]
    size = 2 if axis == "model" else 4
    param = state.params["backbone"]["stage2_block1"]["Conv_1"]["kernel"]
    # Each device holds 1/size of the kernel.
    assert param.addressable_shards[0].data.size * size == param.size
    # Adam's moments follow their parameter's sharding.
    adam_state = state.opt_state[1][0]
    mu = adam_state.mu["backbone"]["stage2_block1"]["Conv_1"]["kernel"]
    assert mu.sharding == param.sharding
    # Most parameter bytes are split: per-device bytes near total / size.
    leaves = jax.tree.leaves(state.params)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    total = sum(x.nbytes for x in leaves)
    assert per_device < 1.15 * total / size


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
def test_data_parallel_rules_replicate_parameters():
    state = _sharded_state(dict(data=8, fsdp=1, model=1))
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.is_fully_replicated

import jax
import pytest

import sharding
from sharding.mesh import check_global_batch, resolve_mesh_shape


@pytest.mark.parametrize(
    "config,expected",
    [
        (dict(data=-1, fsdp=1, model=1), (8, 1, 1)),
        (dict(data=4, fsdp=1, model=2), (4, 1, 2)),
        (dict(data=2, fsdp=-1, model=2), (2, 2, 2)),
        (dict(data=1, fsdp=1, model=-1), (1, 1, 8)),
    ],
)
def test_resolve_mesh_shape_fills_minus_one(config, expected):
    assert resolve_mesh_shape(config, 8) == expected


@pytest.mark.parametrize(
    "config,message",
    [
        (dict(data=3, fsdp=1, model=1), "needs 3 devices but 8 are available"),
        (dict(data=-1, fsdp=3, model=1), "not divisible by 3"),
        (dict(data=-1, fsdp=-1, model=1), "at most one mesh axis may be -1"),
        (dict(data=0, fsdp=1, model=1), "mesh.data=0 is not a valid axis size"),
    ],
)
def test_resolve_mesh_shape_errors_name_the_problem(config, message):
    with pytest.raises(sharding.MeshError, match=message):
        resolve_mesh_shape(config, 8)


def test_create_mesh_has_auto_axes_and_all_devices():
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    assert mesh.axis_names == ("data", "fsdp", "model")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_check_global_batch():
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    assert check_global_batch(8, mesh) == 2  # model replicas share examples
    with pytest.raises(sharding.MeshError, match="global_batch_size=6 does not divide over .* = 4 devices"):
        check_global_batch(6, mesh)


def test_split_global_batch_is_the_one_divisibility_check():
    assert sharding.split_global_batch(12, 4, "4 processes") == 3
    for size in (6, 0, -4):
        with pytest.raises(sharding.MeshError) as err:
            sharding.split_global_batch(size, 4, "4 processes")
        message = str(err.value)
        assert message.startswith(f"global_batch_size={size} does not divide over 4 processes; use a multiple of 4")
        assert "\n" not in message
    with pytest.raises(sharding.MeshError, match=r"e\.g\. --config\.global_batch_size=4\)"):
        sharding.split_global_batch(6, 4, "4 processes")

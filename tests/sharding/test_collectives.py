"""Collective counting from optimized HLO: compiled programs on 8 CPU devices and hand-written HLO."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.collectives import COLLECTIVE_KINDS, Collective, CollectiveSummary, parse_collectives, summarize

F32 = 4  # bytes per element


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _compiled_hlo(f, args, in_shardings, out_shardings) -> str:
    return jax.jit(f, in_shardings=in_shardings, out_shardings=out_shardings).lower(*args).compile().as_text()


def _only(collectives: list[Collective], kind: str) -> Collective:
    assert [c.kind for c in collectives] == [kind], collectives
    return collectives[0]


# --------------------------------------------------------------- compiled on 8 CPU devices


def test_sum_over_sharded_rows_is_one_all_reduce_of_the_result(mesh):
    # XLA:CPU emits, in ENTRY:
    #   ROOT %all-reduce = f32[1024]{0} all-reduce(%bitcast), channel_id=1,
    #     replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, ..., to_apply=%region_0.0.clone
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    text = _compiled_hlo(lambda a: a.sum(0), [x], (NamedSharding(mesh, P("x", None)),), NamedSharding(mesh, P()))
    ar = _only(parse_collectives(text), "all-reduce")
    assert ar.shapes == (("f32", (1024,)),)
    assert ar.bytes == 1024 * F32
    assert (ar.executions, ar.group_size, ar.executions_exact) == (1, 8, True)
    assert ar.computation.startswith("main")  # the ENTRY computation


def test_replicating_a_sharded_array_is_one_all_gather_of_the_full_array(mesh):
    # ROOT %all-gather = f32[8,1024]{1,0} all-gather(%broadcast_multiply_fusion), channel_id=1,
    #   replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    text = _compiled_hlo(lambda a: a * 2, [x], (NamedSharding(mesh, P("x", None)),), NamedSharding(mesh, P()))
    ag = _only(parse_collectives(text), "all-gather")
    assert ag.shapes == (("f32", (8, 1024)),)
    assert ag.bytes == 8 * 1024 * F32  # the gathered buffer, not the 1/8 shard sent
    assert ag.group_size == 8


def test_all_reduce_in_scan_body_runs_once_per_iteration(mesh):
    # The matmul reads the carry: a loop-invariant `a @ w` is hoisted out of the while
    # loop by XLA, leaving a single all-reduce in ENTRY. XLA:CPU emits, in the body:
    #   %all-reduce = f32[16,32]{1,0} all-reduce(%ynn_fusion), ..., to_apply=%add.clone
    # and in ENTRY:
    #   %while.3 = (...) while(%tuple.6), condition=%region_2.3_spmd, body=%region_0.2_spmd,
    #     backend_config={..."known_trip_count":{"n":"5"}}
    def f(a, w):
        def body(c, _):
            return jnp.tanh(c + (a * c.sum()) @ w), None

        return jax.lax.scan(body, jnp.zeros((16, 32)), None, length=5)[0]

    a = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    text = _compiled_hlo(
        f, [a, w], (NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x", None))), NamedSharding(mesh, P())
    )
    ar = _only(parse_collectives(text), "all-reduce")
    assert ar.bytes == 16 * 32 * F32
    assert (ar.executions, ar.executions_exact) == (5, True)
    assert not ar.computation.startswith("main")  # the while body, not ENTRY
    assert summarize([ar])["all-reduce"] == CollectiveSummary(count=5, bytes=5 * 16 * 32 * F32)


def test_nested_fori_loops_multiply_trip_counts(mesh):
    # Outer while known_trip_count 2 (body calls the inner while), inner known_trip_count 3.
    def f(a, w):
        def outer(i, c):
            return jax.lax.fori_loop(0, 3, lambda j, d: jnp.tanh(d + (a * d.sum()) @ w), c)

        return jax.lax.fori_loop(0, 2, outer, jnp.zeros((16, 32)))

    a = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    text = _compiled_hlo(
        f, [a, w], (NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x", None))), NamedSharding(mesh, P())
    )
    ar = _only(parse_collectives(text), "all-reduce")
    assert ar.executions == 6
    assert summarize([ar])["all-reduce"].bytes == 6 * 16 * 32 * F32


def test_two_reductions_are_combined_into_one_tuple_all_reduce(mesh):
    # XLA:CPU combines them (and reduces the bf16 sum in f32):
    #   %all-reduce.2 = (f32[1024]{0}, f32[256]{0}) all-reduce(%bitcast, %convert_bitcast_fusion), ...
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    y = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    rows = NamedSharding(mesh, P("x", None))
    text = _compiled_hlo(
        lambda a, b: (a.sum(0), b.sum(0)), [x, y], (rows, rows), (NamedSharding(mesh, P()), NamedSharding(mesh, P()))
    )
    ar = _only(parse_collectives(text), "all-reduce")
    assert ar.shapes == (("f32", (1024,)), ("f32", (256,)))
    assert ar.bytes == (1024 + 256) * F32


def test_contraction_into_a_sharded_output_reduces_the_full_product(mesh):
    # A reduce-scatter in principle; XLA:CPU emits an all-reduce of the full f32[16,32]
    # product followed by a dynamic-slice fusion. Either way the reduced buffer is the full
    # product (a reduce-scatter's bytes are its unscattered operand).
    a = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    text = _compiled_hlo(
        lambda a, w: a @ w,
        [a, w],
        (NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x", None))),
        NamedSharding(mesh, P("x", None)),
    )
    summary = summarize(parse_collectives(text))
    reducing = (summary["all-reduce"], summary["reduce-scatter"])
    assert sum(s.count for s in reducing) == 1
    assert sum(s.bytes for s in reducing) == 16 * 32 * F32
    assert summary["all-gather"].count == 0


def test_roll_over_the_sharded_dim_is_a_collective_permute(mesh):
    # ROOT %collective-permute = f32[1,1024]{1,0} collective-permute(%param), channel_id=1,
    #   source_target_pairs={{0,1},{1,2},...,{7,0}}
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    rows = NamedSharding(mesh, P("x", None))
    text = _compiled_hlo(lambda a: jnp.roll(a, 1, axis=0), [x], (rows,), rows)
    cp = _only(parse_collectives(text), "collective-permute")
    assert cp.bytes == 1024 * F32  # one row per device
    assert cp.group_size == 2


def test_rows_to_columns_reshard_is_one_tuple_all_to_all(mesh):
    # %all-to-all.1 = (f32[1,1,128]{2,1,0}, ... 8 elements, /*index=5*/ ...) all-to-all(...)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    text = _compiled_hlo(lambda a: a, [x], (NamedSharding(mesh, P("x", None)),), NamedSharding(mesh, P(None, "x")))
    a2a = _only(parse_collectives(text), "all-to-all")
    assert a2a.shapes == (("f32", (1, 1, 128)),) * 8
    assert a2a.bytes == 1024 * F32  # the per-device shard, all of it redistributed
    assert a2a.group_size == 8


@pytest.mark.parametrize("axis,group_size", [("b", 4), ("a", 2)])
def test_group_size_on_a_2x4_mesh(axis, group_size):
    # Reducing over 'b' prints replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2],
    # device_ids=([2,4]T(1,0)) {'axis_0'}; over 'a' mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    text = _compiled_hlo(lambda a: a.sum(0), [x], (NamedSharding(mesh, P(axis, None)),), NamedSharding(mesh, P()))
    assert _only(parse_collectives(text), "all-reduce").group_size == group_size


# ------------------------------------------------------------------------ hand-written HLO


_ADD = """\
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""


def _module(entry_body: str, *computations: str, header: str = "HloModule m, num_partitions=8") -> str:
    return "\n".join(
        [header, "", _ADD, *computations, "ENTRY %main (p: f32[16,32]) -> f32[16,32] {\n" + entry_body + "}\n"]
    )


def test_tuple_all_reduce_sums_its_elements_with_each_dtype_size():
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %ar = (f32[4,8]{1,0}, bf16[16]{0}, s8[10]{0}, pred[3]{0}, f8e4m3fn[5]{0}, c64[2]{0}) "
        "all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, "
        "to_apply=%add\n"
        "  ROOT %r = f32[16,32]{1,0} copy(%p)\n"
    )
    ar = _only(parse_collectives(text), "all-reduce")
    assert ar.shapes == (
        ("f32", (4, 8)),
        ("bf16", (16,)),
        ("s8", (10,)),
        ("pred", (3,)),
        ("f8e4m3fn", (5,)),
        ("c64", (2,)),
    )
    assert ar.bytes == 4 * 8 * 4 + 16 * 2 + 10 + 3 + 5 + 2 * 8
    assert ar.group_size == 4


def test_async_pairs_count_the_start_once():
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %ags = (f32[2,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), channel_id=1, "
        "replica_groups=[1,8]<=[8], dimensions={0}\n"
        "  %agd = f32[16,32]{1,0} all-gather-done(%ags)\n"
        "  %ars = f32[16,32]{1,0} all-reduce-start(%agd), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add\n"
        "  %ard = f32[16,32]{1,0} all-reduce-done(%ars)\n"
        "  %cps = (f32[16,32]{1,0}, f32[16,32]{1,0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, "
        "source_target_pairs={{0,1},{1,0}}\n"
        "  %cpd = f32[16,32]{1,0} collective-permute-done(%cps)\n"
        "  %rss = ((f32[16,32]{1,0}), f32[2,32]{1,0}) reduce-scatter-start(%cpd), channel_id=4, "
        "replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add\n"
        "  %rsu = ((f32[16,32]{1,0}), f32[2,32]{1,0}) reduce-scatter-update(%rss)\n"
        "  %rsd = f32[2,32]{1,0} reduce-scatter-done(%rsu)\n"
        "  %a2s = ((f32[16,32]{1,0}), f32[16,32]{1,0}, s32[]) all-to-all-start(%p), channel_id=5, "
        "replica_groups=[1,8]<=[8], dimensions={0}\n"
        "  %a2d = f32[16,32]{1,0} all-to-all-done(%a2s)\n"
        "  ROOT %r = f32[16,32]{1,0} copy(%a2d)\n"
    )
    collectives = parse_collectives(text)
    assert [c.kind for c in collectives] == [
        "all-gather",
        "all-reduce",
        "collective-permute",
        "reduce-scatter",
        "all-to-all",
    ]
    full = 16 * 32 * F32
    by_kind = {c.kind: c for c in collectives}
    # all-gather-start is (operand, result): only the gathered result counts.
    assert by_kind["all-gather"].shapes == (("f32", (16, 32)),) and by_kind["all-gather"].bytes == full
    assert by_kind["all-reduce"].bytes == full
    # collective-permute-start is (operand, result, context, context): only the result.
    assert by_kind["collective-permute"].bytes == full and by_kind["collective-permute"].group_size == 2
    # reduce-scatter-start is ((operand), result): the unscattered operand counts.
    assert by_kind["reduce-scatter"].shapes == (("f32", (16, 32)),) and by_kind["reduce-scatter"].bytes == full
    assert by_kind["all-to-all"].bytes == full
    assert all(c.executions == 1 and c.group_size in (2, 8) for c in collectives)


def test_sync_reduce_scatter_counts_its_operand():
    # The operand's shape comes from its defining instruction, or inline when printed with shapes.
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %rs = f32[2,32]{1,0} reduce-scatter(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, "
        "to_apply=%add\n"
        "  %rs2 = f32[16,4]{1,0} reduce-scatter(f32[16,32]{1,0} %p), channel_id=2, replica_groups=[1,8]<=[8], "
        "dimensions={1}, to_apply=%add\n"
        "  ROOT %r = f32[16,32]{1,0} copy(%p)\n"
    )
    rs, rs2 = parse_collectives(text)
    assert rs.kind == rs2.kind == "reduce-scatter"
    assert rs.shapes == rs2.shapes == (("f32", (16, 32)),)
    assert rs.bytes == rs2.bytes == 16 * 32 * F32


def test_reduce_scatter_with_unreadable_operand_is_rebuilt_from_its_result():
    # `%q` has no readable definition: the operand is the result with the scatter
    # dimension multiplied by the group size.
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %rs = bf16[16,8]{1,0} reduce-scatter(%q), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}, "
        "to_apply=%add\n"
        "  ROOT %r = f32[16,32]{1,0} copy(%p)\n"
    )
    rs = _only(parse_collectives(text), "reduce-scatter")
    assert rs.shapes == (("bf16", (16, 32)),)
    assert rs.bytes == 16 * 32 * 2


_LOOP_BODY = """\
%inner_body (ib: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %ib = (s32[], f32[16,32]{1,0}) parameter(0)
  %iv = f32[16,32]{1,0} get-tuple-element(%ib), index=1
  %iar = f32[16,32]{1,0} all-reduce(%iv), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  %ii = s32[] get-tuple-element(%ib), index=0
  ROOT %it = (s32[], f32[16,32]{1,0}) tuple(%ii, %iar)
}

%inner_cond (ic: (s32[], f32[16,32])) -> pred[] {
  %ic = (s32[], f32[16,32]{1,0}) parameter(0)
  %icv = f32[16,32]{1,0} get-tuple-element(%ic), index=1
  %icar = f32[16,32]{1,0} all-reduce(%icv), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %ip = pred[] constant(true)
}

%outer_body (ob: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %ob = (s32[], f32[16,32]{1,0}) parameter(0)
  ROOT %ow = (s32[], f32[16,32]{1,0}) while(%ob), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"}}
}

%outer_cond (oc: (s32[], f32[16,32])) -> pred[] {
  %oc = (s32[], f32[16,32]{1,0}) parameter(0)
  ROOT %op = pred[] constant(true)
}
"""


def test_nested_while_loops_multiply_and_conditions_run_once_more():
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %z = s32[] constant(0)\n"
        "  %t = (s32[], f32[16,32]{1,0}) tuple(%z, %p)\n"
        "  %w = (s32[], f32[16,32]{1,0}) while(%t), condition=%outer_cond, body=%outer_body, "
        'metadata={op_name="jit(f)/while/body"}, backend_config={"known_trip_count":{"n":"2"}}\n'
        "  ROOT %r = f32[16,32]{1,0} get-tuple-element(%w), index=1\n",
        _LOOP_BODY,
    )
    body_ar, cond_ar = parse_collectives(text)
    assert (body_ar.computation, body_ar.executions) == ("inner_body", 2 * 3)
    assert (cond_ar.computation, cond_ar.executions) == ("inner_cond", 2 * (3 + 1))
    assert body_ar.executions_exact and cond_ar.executions_exact
    assert summarize([body_ar, cond_ar])["all-reduce"] == CollectiveSummary(count=14, bytes=14 * 16 * 32 * F32)


def test_while_without_known_trip_count_counts_once_and_says_so(caplog):
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %z = s32[] constant(0)\n"
        "  %t = (s32[], f32[16,32]{1,0}) tuple(%z, %p)\n"
        "  %w = (s32[], f32[16,32]{1,0}) while(%t), condition=%outer_cond, body=%outer_body\n"
        "  ROOT %r = f32[16,32]{1,0} get-tuple-element(%w), index=1\n",
        _LOOP_BODY,
    )
    with caplog.at_level(logging.WARNING, logger="sharding.collectives"):
        body_ar, _ = parse_collectives(text)
    assert body_ar.executions == 3  # outer loop assumed to run once
    assert not body_ar.executions_exact
    assert any("no known trip count" in r.getMessage() and "%w" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "groups,size",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 2),
        ("replica_groups=[2,4]<=[8]", 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", 2),
        ("replica_groups=[1,8]<=[8]", 8),
        ("replica_groups=mesh['x'=8] {'x'}", 8),
        ("replica_groups=mesh['data'=2,'model'=4], device_ids=([2,4]T(1,0)) {'data'}", 2),
        ("replica_groups=mesh['data'=2,'model'=4] {'data','model'}", 8),
        ("replica_groups=mesh['data'=2,'model'=4] {'model':(1)2}", 2),
        ("replica_groups={}", 8),  # all devices (num_partitions=8 in the header)
        ("replica_groups=garbage", 1),
    ],
)
def test_replica_group_sizes(groups, size):
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        f"  ROOT %ar = f32[16,32]{{1,0}} all-reduce(%p), channel_id=1, {groups}, use_global_device_ids=true, "
        "to_apply=%add\n"
    )
    assert _only(parse_collectives(text), "all-reduce").group_size == size


def test_async_start_wrapping_a_collective_counts_it_once():
    wrapped = """\
%wrapped_all_gather (wp: f32[2,32]) -> f32[16,32] {
  %wp = f32[2,32]{1,0} parameter(0)
  ROOT %ag = f32[16,32]{1,0} all-gather(%wp), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
}
"""
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %s = f32[2,32]{1,0} slice(%p), slice={[0:2], [0:32]}\n"
        "  %st = ((f32[2,32]{1,0}), f32[16,32]{1,0}, s32[]) async-start(%s), calls=%wrapped_all_gather\n"
        "  %up = ((f32[2,32]{1,0}), f32[16,32]{1,0}, s32[]) async-update(%st), calls=%wrapped_all_gather\n"
        "  ROOT %dn = f32[16,32]{1,0} async-done(%up), calls=%wrapped_all_gather\n",
        wrapped,
    )
    ag = _only(parse_collectives(text), "all-gather")
    assert (ag.computation, ag.executions, ag.bytes) == ("wrapped_all_gather", 1, 16 * 32 * F32)


def test_calls_fusions_and_conditionals():
    callee = """\
%callee (cp: f32[16,32]) -> f32[16,32] {
  %cp = f32[16,32]{1,0} parameter(0)
  ROOT %car = f32[16,32]{1,0} all-reduce(%cp), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
}

%fused (fp: f32[16,32]) -> f32[16,32] {
  %fp = f32[16,32]{1,0} parameter(0)
  ROOT %fag = f32[16,32]{1,0} all-gather(%fp), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
}

%branch_a (ap: f32[16,32]) -> f32[16,32] {
  %ap = f32[16,32]{1,0} parameter(0)
  ROOT %acp = f32[16,32]{1,0} collective-permute(%ap), channel_id=3, source_target_pairs={{0,1},{1,0}}
}

%branch_b (bp: f32[16,32]) -> f32[16,32] {
  %bp = f32[16,32]{1,0} parameter(0)
  ROOT %bcp = f32[16,32]{1,0} collective-permute(%bp), channel_id=4, source_target_pairs={{1,0},{0,1}}
}

%never_called (np: f32[16,32]) -> f32[16,32] {
  %np = f32[16,32]{1,0} parameter(0)
  ROOT %nar = f32[16,32]{1,0} all-reduce(%np), channel_id=5, replica_groups=[1,8]<=[8], to_apply=%add
}
"""
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  %c1 = f32[16,32]{1,0} call(%p), to_apply=%callee\n"
        "  %c2 = f32[16,32]{1,0} call(%c1), to_apply=%callee\n"
        "  %f = f32[16,32]{1,0} fusion(%c2), kind=kCustom, calls=%fused\n"
        "  %i = s32[] constant(0)\n"
        "  %cond = f32[16,32]{1,0} conditional(%i, %f, %f), branch_computations={%branch_a, %branch_b}\n"
        "  ROOT %red = f32[] reduce(%cond, %i), dimensions={0,1}, to_apply=%add\n",
        callee,
    )
    collectives = parse_collectives(text)
    runs = {c.computation: (c.kind, c.executions, c.executions_exact) for c in collectives}
    assert runs == {
        "callee": ("all-reduce", 2, True),  # two call sites sum
        "fused": ("all-gather", 1, True),
        "branch_a": ("collective-permute", 1, False),  # every branch counted: an upper bound
        "branch_b": ("collective-permute", 1, False),
    }
    summary = summarize(collectives)
    assert summary["collective-permute"] == CollectiveSummary(count=2, bytes=2 * 16 * 32 * F32)


def test_summarize_totals_and_zero_kinds():
    full = 16 * 32 * F32
    collectives = [
        Collective("all-reduce", "main", (("f32", (16, 32)),), full, 1, 8),
        Collective("all-reduce", "body", (("f32", (16, 32)),), full, 5, 8),
        Collective("all-gather", "main", (("bf16", (8,)),), 16, 3, 4),
    ]
    summary = summarize(collectives)
    assert list(summary) == list(COLLECTIVE_KINDS)
    assert summary["all-reduce"] == CollectiveSummary(count=6, bytes=6 * full)
    assert summary["all-gather"] == CollectiveSummary(count=3, bytes=48)
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert summary[kind] == CollectiveSummary(count=0, bytes=0)
    assert summarize([]) == {kind: CollectiveSummary(0, 0) for kind in COLLECTIVE_KINDS}


def test_text_without_entry_is_rejected():
    with pytest.raises(ValueError, match="ENTRY"):
        parse_collectives(_ADD)


def test_empty_replica_groups_without_channel_span_the_replicas():
    text = _module(
        "  %p = f32[16,32]{1,0} parameter(0)\n"
        "  ROOT %ar = f32[16,32]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add\n",
        header="HloModule m, replica_count=4, num_partitions=2",
    )
    assert _only(parse_collectives(text), "all-reduce").group_size == 4

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from benchmarks import hlo_collectives

# The shapes of a GPU module: asynchronous starts and dones, a reduce-scatter wrapped in an async
# computation, a while loop inside a while loop, the three ways of writing replica groups.
HLO = """\
HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: bf16[8,64]) -> bf16[8,32] {
  %p = bf16[8,64]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = bf16[8,32]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[1,2]<=[2], dimensions={1}, to_apply=%add
}

%inner_body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]{0}) parameter(0)
  %all-reduce-start.2 = f32[4]{0} all-reduce-start(%g), channel_id=4, replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/psum"}
  %all-reduce-done.2 = f32[4]{0} all-reduce-done(%all-reduce-start.2)
}

%outer_body (r: (s32[], f32[4])) -> (s32[], f32[4]) {
  %r = (s32[], f32[4]{0}) parameter(0)
  %while.2 = (s32[], f32[4]{0}) while(%r), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %all-gather-start.1 = (f32[2,16]{1,0}, f32[4,16]{1,0}) all-gather-start(%h), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}
  %all-gather-done.1 = f32[4,16]{1,0} all-gather-done(%all-gather-start.1)
  %all-reduce.9 = f32[4]{0} all-reduce(%k), channel_id=6, replica_groups={{0},{1}}, to_apply=%add
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
}

ENTRY %main (a: f32[8,64]) -> f32[8,32] {
  %a = f32[8,64]{1,0} parameter(0)
  %all-reduce.1 = (f32[8,64]{1,0}, bf16[10]{0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %while.1 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"24"}}
  %while.3 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%outer_body
  %reduce-scatter-start = ((bf16[8,64]{1,0}), bf16[8,32]{1,0}) async-start(%c), calls=%wrapped_reduce_scatter
  ROOT %reduce-scatter-done = bf16[8,32]{1,0} async-done(%reduce-scatter-start)
}
"""


def test_collectives_are_counted_once_each_with_their_loops_trip_counts():
    found = {c.name: c for c in hlo_collectives.collectives(HLO)}
    assert sorted(found) == ["all-gather-start.1", "all-reduce-start.2", "all-reduce.1", "reduce-scatter.1"]
    pair = found["all-reduce.1"]
    assert (pair.kind, pair.shapes, pair.group_size, pair.executions) == (
        "all-reduce", (("f32", (8, 64)), ("bf16", (10,))), 2, 1)
    assert pair.nbytes == 8 * 64 * 4 + 10 * 2
    gather = found["all-gather-start.1"]  # the outputs of the start only; a loop of unknown length around it
    assert (gather.kind, gather.shapes, gather.dimensions, gather.group_size, gather.executions) == (
        "all-gather", (("f32", (4, 16)),), (0,), 2, None)
    inner = found["all-reduce-start.2"]
    assert inner.in_backward and inner.executions is None  # 24 x 3 through while.1, unknown through while.3
    scatter = found["reduce-scatter.1"]
    assert (scatter.group_size, scatter.executions, scatter.nbytes) == (2, 1, 8 * 32 * 2)
    assert [c.name for c in hlo_collectives.collectives(HLO, keep_trivial=True)
            if c.group_size == 1] == ["all-reduce.9"]


def test_totals_and_extents():
    known = HLO.replace("%while.3 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%outer_body\n", "")
    found = hlo_collectives.collectives(known)
    totals = hlo_collectives.totals(found)
    assert totals["all-reduce"] == {"instructions": 2, "executions": 1 + 24 * 3,
                                    "bytes": 8 * 64 * 4 + 10 * 2 + 24 * 3 * 16}
    assert totals["all-gather"] == {"instructions": 1, "executions": 24, "bytes": 24 * 4 * 16 * 4}
    assert totals["reduce-scatter"]["executions"] == 1
    assert hlo_collectives.totals(hlo_collectives.collectives(HLO))["all-gather"]["bytes"] is None
    assert [c.name for c in hlo_collectives.with_extent(found, 64, kind="all-gather")] == ["all-gather-start.1"]
    assert [c.name for c in hlo_collectives.with_extent(found, 512)] == ["all-reduce.1"]  # 8 x 64
    assert hlo_collectives.with_extent(found, 7) == []
    assert "x72 over 2 devices (backward)" in next(c for c in found if c.name == "all-reduce-start.2").describe()


def test_a_compiled_program_on_two_devices():
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])

    def per_device(a):  # a: (3, 5) of one device's (6, 5)
        def body(carry, _):
            return lax.psum(carry, "x") * 0.5, None
        carry, _ = lax.scan(body, a, None, length=4)
        return lax.all_gather(carry, "x", axis=0, tiled=True)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
    found = hlo_collectives.collectives(jax.jit(f).lower(jnp.ones((6, 5))).compile().as_text())
    totals = hlo_collectives.totals(found)
    assert totals["all-reduce"]["executions"] == 4 and totals["all-reduce"]["bytes"] == 4 * 3 * 5 * 4
    (gather,) = [c for c in found if c.kind == "all-gather"]
    assert (gather.shapes, gather.executions, gather.group_size) == ((("f32", (6, 5)),), 1, 2)
    assert hlo_collectives.with_extent(found, 6, kind="all-gather") == [gather]

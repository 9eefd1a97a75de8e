"""Fusion planning (Horovod's rules): threshold, look-ahead, dtype/op mixing, allgather per-rank
bytes, barrier/join stops, never-fused types, group fusion, purity."""
from __future__ import annotations

import pytest

from collective.fusion import plan_fusion, response_bytes
from collective.types import DataType, ReduceOp, Response, ResponseType

pytestmark = pytest.mark.timeout(30)

AR, AG, BC, A2A, RS = (ResponseType.ALLREDUCE, ResponseType.ALLGATHER, ResponseType.BROADCAST,
                       ResponseType.ALLTOALL, ResponseType.REDUCESCATTER)
F32, F16 = DataType.FLOAT32, DataType.FLOAT16


def ar(name, n=10, dtype=F32, **kw):
    return Response(type=kw.pop("type", AR), names=[name], dtype=dtype, sizes=[n],
                    shapes=[(n,)], **kw)


def ag(name, rows, row=1, dtype=F32):
    return Response(type=AG, names=[name], dtype=dtype, sizes=list(rows),
                    shapes=[(rows[0], row)])


def names(plan):
    return [r.names for r in plan]


def test_everything_fuses_under_the_threshold():
    plan = plan_fusion([ar(f"t{i}") for i in range(5)], threshold=1000, group_size=2)
    assert names(plan) == [[f"t{i}" for i in range(5)]]
    assert plan[0].sizes == [10] * 5 and plan[0].shapes == [(10,)] * 5


def test_threshold_is_inclusive_and_splits_batches():
    # 10 float32 = 40 bytes each; 80 fits exactly two.
    plan = plan_fusion([ar(f"t{i}") for i in range(5)], threshold=80, group_size=2)
    assert names(plan) == [["t0", "t1"], ["t2", "t3"], ["t4"]]


def test_threshold_zero_disables_fusion():
    plan = plan_fusion([ar(f"t{i}") for i in range(3)], threshold=0, group_size=2)
    assert names(plan) == [["t0"], ["t1"], ["t2"]]


def test_oversized_tensor_goes_alone():
    plan = plan_fusion([ar("big", n=1000), ar("a"), ar("b")], threshold=100, group_size=2)
    assert names(plan) == [["big"], ["a", "b"]]


def test_look_ahead_skips_mismatched_dtype_while_it_fits():
    seq = [ar("f32a"), ar("f16a", dtype=F16), ar("f32b"), ar("f16b", dtype=F16)]
    plan = plan_fusion(seq, threshold=1000, group_size=2)
    assert names(plan) == [["f32a", "f32b"], ["f16a", "f16b"]]


def test_look_ahead_stops_when_skipped_bytes_no_longer_fit():
    # head 40 B; the float16 tensor (400 B) cannot be skipped under a 300 B threshold, so the
    # scan stops and f32b is not pulled forward.
    seq = [ar("f32a"), ar("f16big", n=200, dtype=F16), ar("f32b")]
    plan = plan_fusion(seq, threshold=300, group_size=2)
    assert names(plan) == [["f32a"], ["f16big"], ["f32b"]]


def test_skipped_responses_keep_their_order():
    seq = [ar("a"), ar("x1", dtype=F16), ar("x2", dtype=F16), ar("b"), ar("x3", dtype=F16)]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [["a", "b"], ["x1", "x2", "x3"]]


@pytest.mark.parametrize("field,a,b", [("reduce_op", ReduceOp.SUM, ReduceOp.MAX),
                                       ("prescale", 1.0, 2.0), ("postscale", 1.0, 0.5),
                                       ("device", -1, 0)])
def test_different_op_scale_or_device_do_not_fuse(field, a, b):
    seq = [ar("a", **{field: a}), ar("b", **{field: b}), ar("c", **{field: a})]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [["a", "c"], ["b"]]


def test_different_types_do_not_fuse():
    seq = [ar("a"), ar("r", type=RS), ar("b"), ar("s", type=RS)]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [["a", "b"], ["r", "s"]]


@pytest.mark.parametrize("stop", [ResponseType.JOIN, ResponseType.BARRIER, ResponseType.ERROR])
def test_barrier_join_error_stop_the_scan(stop):
    seq = [ar("a"), Response(type=stop, names=["stop"]), ar("b")]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [["a"], ["stop"], ["b"]]


@pytest.mark.parametrize("kind", [BC, A2A])
def test_broadcast_and_alltoall_never_fuse(kind):
    seq = [Response(type=kind, names=[f"{kind.name}{i}"], sizes=[4], shapes=[(4,)])
           for i in range(3)]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [[r.names[0]] for r in seq]


def test_never_fused_types_are_skipped_by_look_ahead():
    seq = [ar("a"), Response(type=BC, names=["bc"], sizes=[1], shapes=[(1,)]), ar("b")]
    plan = plan_fusion(seq, threshold=10_000, group_size=2)
    assert names(plan) == [["a", "b"], ["bc"]]


def test_allgather_uses_largest_per_rank_share():
    # One tensor: rank0 sends 4 B, rank1 20 B -> 20 B. Both: rank0 8 B, rank1 40 B -> 40 B.
    g = [ag("g0", [1, 5]), ag("g1", [1, 5])]
    assert response_bytes(g[0], 2) == 20
    assert names(plan_fusion(g, threshold=40, group_size=2)) == [["g0", "g1"]]
    assert names(plan_fusion(g, threshold=39, group_size=2)) == [["g0"], ["g1"]]


def test_allgather_threshold_sums_per_rank_before_taking_the_max():
    # rank0: 20 + 4 = 24 B, rank1: 4 + 20 = 24 B -> 24 B fits under 30 B.
    g = [ag("g0", [5, 1]), ag("g1", [1, 5])]
    assert names(plan_fusion(g, threshold=30, group_size=2)) == [["g0", "g1"]]


def test_allgather_fused_sizes_concatenate_per_tensor():
    plan = plan_fusion([ag("g0", [1, 2], row=3), ag("g1", [4, 0], row=3)], threshold=10_000,
                       group_size=2)
    assert plan[0].names == ["g0", "g1"] and plan[0].sizes == [1, 2, 4, 0]


def test_allgather_needs_same_dtype():
    plan = plan_fusion([ag("a", [1, 1]), ag("b", [1, 1], dtype=F16), ag("c", [1, 1])],
                       threshold=10_000, group_size=2)
    assert names(plan) == [["a", "c"], ["b"]]


def test_response_bytes_alignment_except_reducescatter():
    assert response_bytes(ar("a", n=3), 2) == 12
    assert response_bytes(ar("a", n=3), 2, align=16) == 16
    assert response_bytes(ar("r", n=3, type=RS), 2, align=16) == 12


def test_group_fusion_disabled_keeps_groups_apart():
    # Group membership is read from Horovod's member names, which match across ranks.
    seq = [ar(f"grouped_allreduce.g{g}_{i}of2") for g in (1, 2) for i in (1, 2)]
    seq.append(ar("allreduce.lone"))
    g = [r.names[0] for r in seq]
    assert names(plan_fusion(seq, 10_000, 2)) == [g]
    assert names(plan_fusion(seq, 10_000, 2, disable_group_fusion=True)) == [
        g[0:2], g[2:4], g[4:5]]


def test_planning_is_pure():
    seq = [ar("a"), ar("b")]
    plan_fusion(seq, 10_000, 2)
    assert seq[0].names == ["a"] and seq[0].sizes == [10]


def test_empty_and_single():
    assert plan_fusion([], 100, 2) == []
    assert names(plan_fusion([ar("x")], 100, 2)) == [["x"]]


def test_large_device_allreduces_fuse_like_host_ones():
    # The NCCL engine reduces large members of a fused op where they lie (no copies), so the
    # plan treats device and host allreduces alike: only the threshold cuts.
    big = (64 << 20) // 4  # float32 elements: 64 MiB
    for dev in (0, -1):
        seq = [ar("s0", device=dev), ar("b1", big, device=dev), ar("s2", device=dev),
               ar("b3", big, device=dev)]
        assert names(plan_fusion(seq, threshold=1 << 30, group_size=2)) == [
            ["s0", "b1", "s2", "b3"]]
        assert names(plan_fusion(seq, threshold=(64 << 20) + 100, group_size=2)) == [
            ["s0", "b1", "s2"], ["b3"]]

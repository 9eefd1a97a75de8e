"""MessageTable (rank 0's negotiation): readiness with joins, ordering, every validation text
(Horovod's), response contents, and the wire encoding."""
from __future__ import annotations

import pytest

from collective.negotiation import (MessageTable, decode_requests, decode_responses,
                                    encode_requests, encode_responses)
from collective.types import DataType, ReduceOp, Request, RequestType, Response, ResponseType

pytestmark = pytest.mark.timeout(30)

AR, AG, BC, A2A, RS, JOIN, BAR = (RequestType.ALLREDUCE, RequestType.ALLGATHER,
                                  RequestType.BROADCAST, RequestType.ALLTOALL,
                                  RequestType.REDUCESCATTER, RequestType.JOIN,
                                  RequestType.BARRIER)


def req(rank, name, type=AR, **kw):
    kw.setdefault("shape", (4,))
    return Request(rank=rank, type=type, name=name, **kw)


def table(size=2, ranks=None):
    return MessageTable(size, ranks if ranks is not None else list(range(size)))


def process_all(t, per_rank):
    """per_rank: list (by rank) of request lists."""
    return t.process(per_rank)


# -- readiness and ordering -----------------------------------------------------------------------
def test_name_ready_only_when_every_rank_asked():
    t = table(3)
    assert t.process([[req(0, "a")], [], []]) == []
    assert t.process([[], [req(1, "a")], []]) == []
    assert "a" in t.pending() and t.pending()["a"][0] == {0, 1}
    out = t.process([[], [], [req(2, "a")]])
    assert [r.names for r in out] == [["a"]] and out[0].type == ResponseType.ALLREDUCE
    assert t.pending() == {}


def test_ready_order_is_the_order_names_become_ready():
    t = table(2)
    t.process([[req(0, "a"), req(0, "b"), req(0, "c")], [req(1, "c")]])  # c ready first
    out = t.process([[], [req(1, "b"), req(1, "a")]])
    assert [r.names[0] for r in out] == ["b", "a"]
    t2 = table(2)
    out = t2.process([[req(0, "x"), req(0, "y")], [req(1, "y"), req(1, "x")]])
    # Rank 0's requests come first; a name is ready when the last rank's request arrives, and
    # rank 1 sends y before x.
    assert [r.names[0] for r in out] == ["y", "x"]


def test_join_counts_as_ready_and_rechecks_waiting_names():
    t = table(3, [0, 1, 2])
    t.process([[req(0, "a")], [req(1, "a")], []])
    out = t.process([[], [], [req(2, "join.noname", JOIN)]])
    assert [r.names for r in out] == [["a"]]  # waited only for rank 2, which joined
    assert t.join_active and t.joined == {2} and t.last_joined == 2
    out = t.process([[req(0, "b")], [req(1, "b")], []])
    assert [r.names for r in out] == [["b"]]


def test_all_joined_emits_join_response_with_last_joined_rank_and_resets():
    t = table(3, [4, 5, 6])  # a process set: last_joined is a GLOBAL rank
    t.process([[req(0, "join.noname", JOIN)], [], []])
    t.process([[], [], [req(2, "join.noname", JOIN)]])
    out = t.process([[], [req(1, "join.noname", JOIN)], []])
    assert out[-1].type == ResponseType.JOIN and out[-1].names == ["join.noname"]
    assert out[-1].last_joined_rank == 5
    assert not t.join_active and t.last_joined == -1
    # A second round works the same way.
    out = t.process([[req(0, "join.noname", JOIN)], [req(1, "join.noname", JOIN)],
                     [req(2, "join.noname", JOIN)]])
    assert out[-1].type == ResponseType.JOIN and out[-1].last_joined_rank == 6


def test_join_response_follows_the_tensors_it_released():
    t = table(2)
    t.process([[req(0, "a")], []])
    out = t.process([[req(0, "join.noname", JOIN)], [req(1, "join.noname", JOIN)]])
    # 'a' was waiting for rank 1; rank 1 joined, so 'a' is ready (with zeros), then the JOIN.
    assert [r.type for r in out] == [ResponseType.ALLREDUCE, ResponseType.JOIN]


def test_ops_waiting_for_globally_joined_members_fail_with_the_fix_named():
    # Process set 3 = global ranks [4, 6, 7]; its rank 1 (global 6) waits in the global join().
    t = table(3, [4, 6, 7])
    t.process([[req(0, "a")], [], [req(2, "a")]])  # waits for set rank 1 only
    t.process([[req(0, "b")], [req(1, "b")], []])  # global 6 submitted it: waits for rank 2
    t.process([[req(0, "c", BC, root=4)], [], []])
    assert t.waits_for({1}) and t.waits_for({0, 1}) and not t.waits_for(set())
    out = t.fail_waiting_for({1}, 3)
    assert [r.names for r in out] == [["a"], ["c"]]
    assert all(r.type == ResponseType.ERROR for r in out)
    assert out[0].error == (
        "The ALLREDUCE of tensor 'a' on process set 3 (ranks [4, 6, 7]) cannot complete: "
        "rank(s) 6 called hvd.join() and wait there without submitting it (rank(s) 4, 7 "
        "submitted it). join() covers the global process set only: joined ranks contribute "
        "zeros to allreduces of the global process set and take no part in ops of other "
        "process sets. Finish the ops on process set 3 on every member before calling "
        "hvd.join(), or run this op on the global process set (for an allreduce).")
    assert out[1].error.startswith("The BROADCAST of tensor 'c' on process set 3 (ranks "
                                   "[4, 6, 7]) cannot complete: rank(s) 6 called hvd.join()")
    assert "(rank(s) 4 submitted it)" in out[1].error
    assert list(t.pending()) == ["b"] and not t.waits_for({1})
    assert t.fail_waiting_for({1}, 3) == []
    # A later request of a failed name starts a new entry.
    assert t.process([[], [], [req(2, "a")]]) == [] and t.pending()["a"][0] == {2}
    assert [r.names for r in t.fail_waiting_for({1, 2}, 3)] == [["b"], ["a"]]


def test_barrier_is_a_normal_name():
    t = table(2)
    out = t.process([[req(0, "barrier.noname", BAR, shape=())],
                     [req(1, "barrier.noname", BAR, shape=())]])
    assert out[0].type == ResponseType.BARRIER


def test_timeline_callbacks():
    firsts, ranks = [], []
    t = MessageTable(2, [0, 1])
    t.process([[req(0, "a")], [req(1, "a")]], on_first=lambda n, ty: firsts.append((n, ty)),
              on_rank=lambda n, r: ranks.append((n, r)))
    assert firsts == [("a", AR)] and ranks == [("a", 0), ("a", 1)]


# -- responses ------------------------------------------------------------------------------------
def test_allreduce_response_fields():
    t = table(2)
    kw = dict(shape=(2, 3), dtype=DataType.FLOAT16, reduce_op=ReduceOp.MAX, prescale=2.0,
              postscale=0.5)
    r = t.process([[req(0, "a", **kw)], [req(1, "a", **kw)]])[0]
    assert (r.type, r.dtype, r.reduce_op, r.prescale, r.postscale) == (
        ResponseType.ALLREDUCE, DataType.FLOAT16, ReduceOp.MAX, 2.0, 0.5)
    assert r.sizes == [6] and r.shapes == [(2, 3)] and r.device == -1


def test_allgather_sizes_are_every_ranks_dim0():
    t = table(3)
    r = t.process([[req(0, "g", AG, shape=(1, 2))], [req(1, "g", AG, shape=(0, 2))],
                   [req(2, "g", AG, shape=(5, 2))]])[0]
    assert r.type == ResponseType.ALLGATHER and r.sizes == [1, 0, 5]


def test_broadcast_root_travels():
    t = table(2)
    r = t.process([[req(0, "b", BC, root=1)], [req(1, "b", BC, root=1)]])[0]
    assert r.type == ResponseType.BROADCAST and r.root == 1


# -- validation texts (Horovod's), checked in Horovod's order ----------------------------------
def mismatch(reqs0, reqs1, size=2, joined=None):
    t = table(size)
    if joined is not None:
        t.process([[req(r, "join.noname", JOIN)] if r == joined else []
                   for r in range(size)])
    lists = [[reqs0], [reqs1]] + [[] for _ in range(size - 2)]
    if joined is not None:
        lists[joined] = []
    out = t.process(lists)
    assert len(out) == 1 and out[0].type == ResponseType.ERROR, out
    assert out[0].names == [reqs0.name]
    return out[0].error


def test_group_size_mismatch_fails_every_member_at_once():
    t = table(3)
    g = "grouped_allreduce.g"
    assert t.process([[req(0, f"{g}_1of2"), req(0, f"{g}_2of2")], [], []]) == []
    out = t.process([[], [req(1, f"{g}_1of1")], [req(2, f"{g}_1of2")]])
    assert len(out) == 1 and out[0].type == ResponseType.ERROR, out
    assert out[0].names == [f"{g}_1of1", f"{g}_1of2", f"{g}_2of2"]
    assert out[0].error.startswith("Mismatched grouped allreduce sizes: rank(s) 1 passed 1 "
                                   "tensor; rank(s) 0, 2 passed 2 tensors (group "
                                   "'grouped_allreduce.g').")
    assert t.pending() == {}
    # The rest of the group, arriving later, starts afresh (and waits for the others).
    assert t.process([[], [], [req(2, f"{g}_2of2")]]) == []


def test_group_size_mismatch_waits_for_every_rank():
    # The error goes out only once every rank has submitted part of the group, so that every
    # rank gets it in the same response (a rank arriving later would wait for ever).
    t = table(3)
    g = "grouped_allreduce.g"
    assert t.process([[req(0, f"{g}_1of1")], [req(1, f"{g}_1of2"), req(1, f"{g}_2of2")],
                      []]) == []
    out = t.process([[], [], [req(2, f"{g}_1of1")]])
    assert [r.type for r in out] == [ResponseType.ERROR]
    assert out[0].names == [f"{g}_1of1", f"{g}_1of2", f"{g}_2of2"]
    assert "rank(s) 0, 2 passed 1 tensor; rank(s) 1 passed 2 tensors" in out[0].error
    # A rank that joined counts as having submitted.
    t = table(3)
    t.process([[], [], [req(2, "join.noname", JOIN)]])
    out = t.process([[req(0, f"{g}_1of1")], [req(1, f"{g}_1of2"), req(1, f"{g}_2of2")], []])
    assert [r.type for r in out] == [ResponseType.ERROR]


def test_group_size_mismatch_found_when_a_rank_joins_an_existing_name():
    # Rank 0 is ahead (a two-tensor group, then a one-tensor group of the same name); rank 1
    # passed one tensor and rank 2 two: the last request lands in existing names.
    t = table(3)
    g = "grouped_allreduce.g"
    assert t.process([[req(0, f"{g}_1of2"), req(0, f"{g}_2of2"), req(0, f"{g}_1of1")], [],
                      []]) == []
    assert t.process([[], [req(1, f"{g}_1of1")], []]) == []
    out = t.process([[], [], [req(2, f"{g}_1of2"), req(2, f"{g}_2of2")]])
    assert [r.type for r in out] == [ResponseType.ERROR]
    assert out[0].names == [f"{g}_1of1", f"{g}_1of2", f"{g}_2of2"]
    # Rank 0, a step ahead, is named apart, not among those that passed either size.
    assert out[0].error.startswith(
        "Mismatched grouped allreduce sizes: rank(s) 1 passed 1 tensor; rank(s) 2 passed 2 "
        "tensors; rank(s) 0 submitted it with 1 and 2 tensors (a later step's op under the "
        "same name too) (group 'grouped_allreduce.g')."), out[0].error


def test_a_rank_ahead_with_another_group_size_is_no_mismatch():
    # Rank 0 is a step ahead: it submitted this step's two-tensor group and the next step's
    # one-tensor group of the same name; rank 1 is at the two-tensor group. Both complete.
    t = table(2, [4, 5])
    g = "grouped_allreduce.g"
    assert t.process([[req(0, f"{g}_1of2"), req(0, f"{g}_2of2"), req(0, f"{g}_1of1")],
                      []]) == []
    out = t.process([[], [req(1, f"{g}_1of2"), req(1, f"{g}_2of2")]])
    assert [r.names for r in out] == [[f"{g}_1of2"], [f"{g}_2of2"]]
    out = t.process([[], [req(1, f"{g}_1of1")]])
    assert [r.names for r in out] == [[f"{g}_1of1"]] and out[0].type == ResponseType.ALLREDUCE
    # Names that only look grouped (no grouped_ prefix) are ordinary tensors.
    out = t.process([[req(0, "allreduce.x_1of2")], [req(1, "allreduce.x_1of3")]])
    assert [r.type for r in out] == []


def test_dtype_mismatch_text():
    err = mismatch(req(0, "t", dtype=DataType.FLOAT32), req(1, "t", dtype=DataType.INT64))
    assert err.startswith("Mismatched data types: One rank had type float32, but another rank "
                          "had type int64.")
    assert "'t'" in err and "rank(s) 0" in err and "rank(s) 1" in err


def test_mismatch_text_of_a_name_at_the_wire_limit():
    # The name is quoted by its start and length: the text stays small, so the response can
    # be sent to every rank (a name near 1 MiB quoted whole made a text over the wire's limit).
    name = "n" * (1 << 20)
    err = mismatch(req(0, name, shape=(1,)), req(1, name, shape=(2,)))
    assert f"(tensor {'n' * 200!r}... (1048576 bytes): rank(s) 0 sent [1]; rank(s) 1 " in err
    assert len(err) < 1000
    err = mismatch(req(0, name, AG, shape=()), req(1, name, AG, shape=()))
    assert f"(tensor {'n' * 200!r}... (1048576 bytes); use a tensor" in err


def test_operation_mismatch_text():
    err = mismatch(req(0, "t", AR), req(1, "t", AG))
    assert err.startswith("Mismatched operations: One rank did an ALLREDUCE, but another rank "
                          "did an ALLGATHER.")


@pytest.mark.parametrize("type,label", [(AR, "ALLREDUCE"), (BC, "BROADCAST"),
                                        (RS, "REDUCESCATTER")])
def test_shape_mismatch_text(type, label):
    err = mismatch(req(0, "t", type, shape=(2, 3)), req(1, "t", type, shape=(3, 2)))
    assert err.startswith(f"Mismatched {label} tensor shapes: One rank sent a tensor of shape "
                          "[2, 3], but another rank sent a tensor of shape [3, 2].")


def test_layout_mismatch_text():
    # Same shape, different layout digests (a gradient bucket packing differently shaped
    # parameters on one rank); after the shape check, and a layout of 0 on both passes.
    err = mismatch(req(0, "t", layout=0xab), req(1, "t", layout=0xcd))
    assert err.startswith("Mismatched ALLREDUCE tensor layouts: the tensor packs tensors whose "
                          "shapes differ across ranks")
    assert "rank(s) 0 sent layout 0xab; rank(s) 1 sent layout 0xcd" in err
    assert mismatch(req(0, "t", shape=(2,), layout=1), req(1, "t", layout=2)).startswith(
        "Mismatched ALLREDUCE tensor shapes")
    t = table()
    [resp] = t.process([[req(0, "t", layout=7)], [req(1, "t", layout=7)]])
    assert resp.type == ResponseType.ALLREDUCE


def test_scale_factor_mismatch_text():
    err = mismatch(req(0, "t", prescale=1.0, postscale=2.0), req(1, "t", prescale=1.0,
                                                                   postscale=0.5))
    assert err.startswith("Mismatched prescale and/or postscale factors: One rank sent factors "
                          "(1.0, 2.0), but another rank sent factors (1.0, 0.5).")


def test_reduce_op_mismatch_text():
    err = mismatch(req(0, "t", reduce_op=ReduceOp.SUM), req(1, "t", reduce_op=ReduceOp.MIN))
    assert err.startswith("Mismatched reduction operation: One rank sent reduction op 1, but "
                          "another rank sent reduction op 3.")


def test_allgather_alltoall_with_join_texts():
    err = mismatch(req(0, "t", AG, shape=(1,)), req(1, "t", AG, shape=(1,)), size=3, joined=2)
    assert err.startswith("Allgather is not supported with Join at this time. Specify "
                          "sparse_to_dense=True if using DistributedOptimizer")
    err = mismatch(req(0, "t", A2A, shape=(3,)), req(1, "t", A2A, shape=(3,)), size=3, joined=2)
    assert err.startswith("Alltoall is not supported with Join at this time.")


@pytest.mark.parametrize("type,label", [(AG, "ALLGATHER"), (A2A, "ALLTOALL"),
                                        (RS, "REDUCESCATTER")])
def test_rank_zero_tensor_texts(type, label):
    err = mismatch(req(0, "t", type, shape=()), req(1, "t", type, shape=()))
    assert err.startswith(f"Process-set rank zero tried to {label} a rank-zero tensor.")


@pytest.mark.parametrize("type,label", [(AG, "ALLGATHER"), (A2A, "ALLTOALL")])
def test_gather_ndim_and_dim_texts(type, label):
    err = mismatch(req(0, "t", type, shape=(2, 3)), req(1, "t", type, shape=(2,)))
    assert err.startswith(f"Mismatched {label} tensor shapes: One rank sent a tensor of rank 2, "
                          "but another rank sent a tensor of rank 1.")
    err = mismatch(req(0, "t", type, shape=(2, 3, 4)), req(1, "t", type, shape=(7, 3, 5)))
    assert err.startswith(f"Mismatched {label} tensor shapes: One rank sent a tensor with "
                          "dimension 2 equal to 4, but another rank sent a tensor with "
                          "dimension 2 equal to 5.")


def test_gather_dim0_may_differ():
    t = table(2)
    out = t.process([[req(0, "t", AG, shape=(2, 3))], [req(1, "t", AG, shape=(9, 3))]])
    assert out[0].type == ResponseType.ALLGATHER


def test_reducescatter_and_broadcast_with_join_texts():
    err = mismatch(req(0, "t", RS, shape=(4,)), req(1, "t", RS, shape=(4,)), size=3, joined=2)
    assert err.startswith("Reducescatter is not supported with Join at this time.")
    err = mismatch(req(0, "t", BC, root=0), req(1, "t", BC, root=0), size=3, joined=2)
    assert err.startswith("Broadcast is not supported with Join at this time.")


def test_broadcast_root_mismatch_text_uses_global_ranks():
    t = MessageTable(2, [3, 7])
    out = t.process([[req(0, "t", BC, root=3)], [req(1, "t", BC, root=7)]])
    assert out[0].error.startswith("Mismatched BROADCAST root ranks: One rank specified root "
                                   "rank 3, but another rank specified root rank 7.")
    assert "rank(s) 3" in out[0].error and "rank(s) 7" in out[0].error


def test_device_mismatch_text():
    err = mismatch(req(0, "t", device=-1), req(1, "t", device=0))
    assert err.startswith("Mismatched ALLREDUCE CPU/GPU device selection: One rank specified "
                          "device CPU, but another rank specified device GPU.")


def test_checks_run_in_horovod_order():
    # dtype before shape before op: only the first failing check is reported.
    err = mismatch(req(0, "t", dtype=DataType.FLOAT32, shape=(1,), reduce_op=ReduceOp.SUM),
                   req(1, "t", dtype=DataType.FLOAT64, shape=(2,), reduce_op=ReduceOp.MAX))
    assert err.startswith("Mismatched data types")
    err = mismatch(req(0, "t", shape=(1,), prescale=2.0, reduce_op=ReduceOp.SUM),
                   req(1, "t", shape=(2,), prescale=1.0, reduce_op=ReduceOp.MAX))
    assert err.startswith("Mismatched ALLREDUCE tensor shapes")
    err = mismatch(req(0, "t", prescale=2.0, reduce_op=ReduceOp.SUM),
                   req(1, "t", prescale=1.0, reduce_op=ReduceOp.MAX))
    assert err.startswith("Mismatched prescale")


def test_error_names_every_group_of_ranks():
    t = table(4)
    out = t.process([[req(r, "t", shape=(1,) if r % 2 == 0 else (2,))] for r in range(4)])
    err = out[0].error
    assert "rank(s) 0, 2 sent [1]" in err and "rank(s) 1, 3 sent [2]" in err


def test_error_does_not_poison_the_table():
    t = table(2)
    t.process([[req(0, "t", shape=(1,))], [req(1, "t", shape=(2,))]])
    out = t.process([[req(0, "t", shape=(1,))], [req(1, "t", shape=(1,))]])
    assert out[0].type == ResponseType.ALLREDUCE


# -- wire encoding --------------------------------------------------------------------------------
def test_request_round_trip():
    reqs = [Request(rank=1, type=BC, name="b", dtype=DataType.BOOL, shape=(2, 0), device=3,
                    root=5, reduce_op=ReduceOp.PRODUCT, prescale=0.5, postscale=4.0)]
    back, shutdown = decode_requests(encode_requests(reqs, True))
    assert shutdown is True
    r = back[0]
    assert (r.rank, r.type, r.name, r.dtype, r.shape, r.device, r.root, r.reduce_op,
            r.prescale, r.postscale) == (1, BC, "b", DataType.BOOL, (2, 0), 3, 5,
                                         ReduceOp.PRODUCT, 0.5, 4.0)


def test_response_round_trip():
    resp = [Response(type=ResponseType.ALLGATHER, names=["x", "y"], dtype=DataType.INT8,
                     sizes=[1, 2, 3, 4], shapes=[(1, 2), (3, 2)], last_joined_rank=2,
                     error="", root=-1, prescale=1.0, postscale=1.0),
            Response(type=ResponseType.ERROR, names=["e"], error="Mismatched data types")]
    back, shutdown, join_active, joined = decode_responses(
        encode_responses(resp, False, True, [2, 0]))
    assert (shutdown, join_active, joined) == (False, True, (2, 0))
    assert back[0].names == ["x", "y"] and back[0].sizes == [1, 2, 3, 4]
    assert back[0].shapes == [(1, 2), (3, 2)] and back[0].last_joined_rank == 2
    assert back[1].type == ResponseType.ERROR and back[1].error == "Mismatched data types"

"""Host parsing and slot assignment (launcher/hosts.py): pure functions, no processes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.hosts import (HostInfo, SlotInfo, get_host_assignments, hosts_arg, parse_hostfile,
                            parse_hostfile_text, parse_hosts)


def test_parse_hosts_basic():
    assert parse_hosts("worker-0:2,worker-1:4") == [HostInfo("worker-0", 2),
                                                    HostInfo("worker-1", 4)]
    assert parse_hosts("10.0.0.1:1") == [HostInfo("10.0.0.1", 1)]
    assert parse_hosts("a_b.c-d:3, e:1") == [HostInfo("a_b.c-d", 3), HostInfo("e", 1)]


@pytest.mark.parametrize("bad", ["host", "host:", ":2", "host:two", "ho st:2", "h:2,", "h:-1",
                                 "h:2:3", "[::1]:2"])
def test_parse_hosts_rejects_bad_entries(bad):
    with pytest.raises(ValueError, match="format as : worker-0:2,worker-1:2"):
        parse_hosts(bad)


def test_parse_hosts_rejects_zero_slots_and_duplicates():
    with pytest.raises(ValueError, match="0 slots"):
        parse_hosts("a:0")
    with pytest.raises(ValueError, match="more than once"):
        parse_hosts("a:1,b:1,a:2")


def test_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4\n\nnode2   slots = 2   # comment\nnode3\n")
    assert parse_hostfile(str(f)) == [HostInfo("node1", 4), HostInfo("node2", 2),
                                      HostInfo("node3", 1)]


@pytest.mark.parametrize("text,match", [("node1 slots=x\n", "cannot parse"),
                                        ("node1 cpus=2\n", "cannot parse"),
                                        ("# nothing\n\n", "lists no hosts"),
                                        ("a slots=0\n", "0 slots"),
                                        ("a slots=1\na slots=2\n", "more than once")])
def test_hostfile_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_hostfile_text(text, "hf")


def test_assignment_two_hosts_full():
    got = get_host_assignments(parse_hosts("h1:2,h2:2"), 4)
    assert got == [
        SlotInfo("h1", 0, 0, 0, 4, 2, 2), SlotInfo("h1", 1, 1, 0, 4, 2, 2),
        SlotInfo("h2", 2, 0, 1, 4, 2, 2), SlotInfo("h2", 3, 1, 1, 4, 2, 2)]


def test_assignment_uneven_hosts():
    # h1 has 3 slots, h2 1: local_rank 0 exists on both hosts, local ranks 1-2 only on h1.
    got = get_host_assignments(parse_hosts("h1:3,h2:1"), 4)
    assert [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in got] == [("h1", 0, 0, 3, 0, 2), ("h1", 1, 1, 3, 0, 1),
                              ("h1", 2, 2, 3, 0, 1), ("h2", 3, 0, 1, 1, 2)]


def test_assignment_partial_fill_and_unused_hosts():
    got = get_host_assignments(parse_hosts("a:4,b:4,c:4"), 5)
    assert [s.hostname for s in got] == ["a"] * 4 + ["b"]
    assert [s.local_size for s in got] == [4, 4, 4, 4, 1]
    assert [s.cross_size for s in got] == [2, 1, 1, 1, 2]
    assert got[4].cross_rank == 1
    assert all(s.size == 5 for s in got)


def test_assignment_single_slot_hosts():
    got = get_host_assignments(parse_hosts("a:1,b:1,c:1"), 3)
    assert [(s.rank, s.local_rank, s.cross_rank, s.cross_size) for s in got] == [
        (0, 0, 0, 3), (1, 0, 1, 3), (2, 0, 2, 3)]


def test_assignment_too_many_processes():
    with pytest.raises(ValueError, match=r"Requested more processes \(5\) than there are "
                                         r"available slots \(4\)"):
        get_host_assignments(parse_hosts("a:2,b:2"), 5)
    with pytest.raises(ValueError, match="at least 1"):
        get_host_assignments(parse_hosts("a:2"), 0)


def test_hosts_arg_round_trip():
    hosts = parse_hosts("a:2,b:3")
    assert parse_hosts(hosts_arg(hosts)) == hosts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.data())
def test_assignment_invariants(slot_counts, data):
    hosts = [HostInfo(f"h{i}", n) for i, n in enumerate(slot_counts)]
    np_ = data.draw(st.integers(1, sum(slot_counts)))
    got = get_host_assignments(hosts, np_)
    assert [s.rank for s in got] == list(range(np_))
    by_host: dict[str, list[SlotInfo]] = {}
    for s in got:
        by_host.setdefault(s.hostname, []).append(s)
    host_order = [h.hostname for h in hosts if h.hostname in by_host]
    for name, slots in by_host.items():
        assert [s.local_rank for s in slots] == list(range(len(slots)))
        assert all(s.local_size == len(slots) for s in slots)
    for s in got:
        peers = [h for h in host_order if len(by_host[h]) > s.local_rank]
        assert s.cross_size == len(peers)
        assert s.cross_rank == peers.index(s.hostname)
    # Hosts are filled in order: only the last used host may be partly filled.
    used = [h for h in hosts if h.hostname in by_host]
    assert all(len(by_host[h.hostname]) == h.slots for h in used[:-1])

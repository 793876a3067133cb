"""Topology: node ids, local ranks and the node-local / cross-node communicators, for the real
layout, the HEATLIKE_RANKS_PER_NODE emulation, non-block placement and unequal nodes."""

import os

import pytest
import torch
from mpi4py import MPI

import heatlike as hl
from heatlike.core import topology as topo_mod
from heatlike.core.topology import Topology, get_topology

pytestmark = pytest.mark.mpi


def _check_consistent(t: Topology, node_ids):
    """Everything a Topology reports follows from ``node_ids``, on every rank."""
    comm = t.comm
    size, rank = comm.size, comm.rank
    labels = list(dict.fromkeys(node_ids))
    ids = [labels.index(n) for n in node_ids]
    assert list(t.node_ids) == ids
    assert t.node == ids[rank]
    assert t.num_nodes == len(labels)
    mine = [r for r in range(size) if ids[r] == ids[rank]]
    assert t.local_rank == mine.index(rank) and t.local_size == len(mine)
    assert t.local_sizes == tuple(ids.count(n) for n in range(len(labels)))
    # node_comm holds exactly my node's ranks in rank order
    members = t.node_comm.handle.allgather(rank)
    assert members == mine
    # cross_comm: my local rank on every node that has it, in node order
    cross = t.cross_comm.handle.allgather(rank)
    assert cross == list(t.cross_ranks(t.local_rank))
    assert all(t.local_ranks[r] == t.local_rank for r in cross)
    assert [ids[r] for r in cross] == sorted(ids[r] for r in cross)
    assert len({ids[r] for r in cross}) == len(cross)  # one rank per node
    # a node-local then cross-node sum equals the global sum
    x = torch.tensor([float(rank + 1)])
    t.node_comm.Allreduce(hl.IN_PLACE, x)
    if t.is_leader:
        t.cross_comm.Allreduce(hl.IN_PLACE, x)
    t.node_comm.Bcast(x, root=0)
    assert x.item() == size * (size + 1) / 2


@pytest.mark.parametrize("method", ["split", "group"])
def test_detected_or_environment_topology(comm, method):
    """The layout this run was started with (real nodes, or the emulated two-node run of the
    test matrix via HEATLIKE_RANKS_PER_NODE)."""
    t = Topology(comm, cross_method=method)
    try:
        per_node = os.environ.get("HEATLIKE_RANKS_PER_NODE")
        if per_node:
            expected = [r // int(per_node) for r in range(comm.size)]
            assert list(t.node_ids) == expected
        _check_consistent(t, list(t.node_ids))
    finally:
        t.free()


def _layouts(size):
    yield "one node", [0] * size
    yield "one rank per node", list(range(size))
    yield "round robin over two nodes", [r % 2 for r in range(size)]
    yield "unequal blocks", [0 if r < (size + 1) // 2 else 1 for r in range(size)]
    yield "labels out of order", [(size - r) % 3 for r in range(size)]


@pytest.mark.parametrize("method", ["split", "group"])
def test_explicit_layouts(comm, method):
    for name, ids in _layouts(comm.size):
        t = Topology(comm, node_ids=tuple(ids), cross_method=method)
        try:
            _check_consistent(t, ids)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
        finally:
            t.free()


def test_environment_overrides(comm, monkeypatch):
    monkeypatch.delenv("HEATLIKE_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("HEATLIKE_NODE_IDS", ",".join(str(r % 2) for r in range(comm.size)))
    assert topo_mod.detect_node_ids(comm) == [r % 2 for r in range(comm.size)]
    monkeypatch.delenv("HEATLIKE_NODE_IDS")
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "2")
    assert topo_mod.detect_node_ids(comm) == [r // 2 for r in range(comm.size)]
    monkeypatch.setenv("HEATLIKE_RANKS_PER_NODE", "0")
    with pytest.raises(ValueError, match="HEATLIKE_RANKS_PER_NODE"):
        topo_mod.detect_node_ids(comm)
    monkeypatch.delenv("HEATLIKE_RANKS_PER_NODE")
    monkeypatch.setenv("HEATLIKE_NODE_IDS", "0," * comm.size + "0")
    with pytest.raises(ValueError, match="HEATLIKE_NODE_IDS"):
        topo_mod.detect_node_ids(comm)
    monkeypatch.delenv("HEATLIKE_NODE_IDS")
    # without overrides, the ranks of one machine form one node (one per host on the virtual
    # cluster of the matrix's --real-nodes run, where every node has its own hostname)
    hosts = comm.handle.allgather(MPI.Get_processor_name())
    assert topo_mod.detect_node_ids(comm) == [list(dict.fromkeys(hosts)).index(h) for h in hosts]


def test_bad_layouts_raise_on_every_rank(comm):
    with pytest.raises(ValueError, match="node_ids"):
        Topology(comm, node_ids=tuple(range(comm.size + 1)))
    with pytest.raises(ValueError, match="cross_method"):
        Topology(comm, cross_method="ring")
    if comm.size > 1:  # ranks that disagree are told so, all of them
        with pytest.raises(ValueError, match="disagree"):
            ids = [0] * comm.size if comm.rank == 0 else list(range(comm.size))
            Topology(comm, node_ids=tuple(ids))


def test_get_topology_is_cached(comm):
    t = get_topology(comm)
    assert get_topology(comm) is t
    assert t.num_cross_groups == max(t.local_sizes)

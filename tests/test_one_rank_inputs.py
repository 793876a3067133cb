"""Input that is bad on one rank only, where the others have nothing wrong to see: each rank's
own piece of an array, its own local tensor, its own node list, its own data set. The error is
raised on every rank with the failing rank named, and the ranks stay in step (before: that rank
raised alone and the others waited for it in the next collective forever)."""

import pickle

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, raises_everywhere, still_in_step

import heatlike as hl
from heatlike.core.topology import Topology
from heatlike.optim import SignSGD
from heatlike.utils.data import DataLoader

MULTI = pytest.mark.skipif(COMM.size == 1, reason="input can differ only between ranks")
LAST = COMM.rank == COMM.size - 1


@MULTI
def test_a_piece_of_an_unsupported_dtype():
    piece = torch.ones(2, 3, dtype=torch.uint16 if LAST else torch.float32)
    raises_everywhere(TypeError, lambda: hl.array(piece, is_split=0),
                      f"on rank {COMM.size - 1}: data type")


@MULTI
def test_a_piece_that_is_not_an_array():
    piece = "abc" if LAST else torch.ones(2, 3)
    raises_everywhere(TypeError, lambda: hl.array(piece, is_split=0),
                      f"on rank {COMM.size - 1}: cannot build a DNDarray")


@MULTI
def test_a_dlpack_piece_of_an_unsupported_dtype():
    piece = np.ones((2, 3), dtype=np.uint16 if LAST else np.float32)
    raises_everywhere(TypeError, lambda: hl.from_dlpack(piece, is_split=0), "data type")


@MULTI
def test_a_local_tensor_of_an_unsupported_dtype():
    local = torch.ones(2, 3, dtype=torch.uint16 if LAST else torch.float32)
    raises_everywhere(TypeError, lambda: hl.DNDarray(local, split=0), "data type")


@MULTI
def test_a_local_tensor_whose_split_axis_does_not_exist():
    local = torch.ones(2) if LAST else torch.ones(2, 3)
    raises_everywhere(ValueError, lambda: hl.DNDarray(local, split=1), "on rank")


def _partition_dict(rows: int, dtype: torch.dtype) -> dict:
    data = torch.zeros(rows, 2, dtype=dtype)
    parts = {(r,): {"start": (2 * r, 0), "shape": (2, 2), "data": r if r == COMM.rank else None,
                    "location": [r]} for r in range(COMM.size)}
    return {"shape": (2 * COMM.size, 2), "partition_tiling": (COMM.size, 1),
            "partitions": parts, "locals": [(COMM.rank,)], "get": lambda handle: data}


@MULTI
def test_partition_data_that_contradicts_the_layout():
    parted = _partition_dict(3 if LAST else 2, torch.float32)
    raises_everywhere(RuntimeError, lambda: hl.from_partition_dict(parted),
                      f"rank {COMM.size - 1} holds data of shape (3, 2)")


@MULTI
def test_partitions_of_different_dtypes():
    parted = _partition_dict(2, torch.float64 if LAST else torch.float32)
    raises_everywhere(RuntimeError, lambda: hl.from_partition_dict(parted), "different dtypes")


@MULTI
def test_a_node_list_of_the_wrong_length():
    ids = (0,) if LAST else tuple(range(COMM.size))
    raises_everywhere(ValueError, lambda: Topology(COMM, node_ids=ids), "node_ids lists 1 ranks")


@MULTI
def test_a_data_set_split_along_another_axis():
    x = hl.zeros((COMM.size * 2, 4), split=0)
    data = hl.zeros((4, COMM.size * 2), split=1) if LAST else x
    raises_everywhere(ValueError, lambda: DataLoader(data, batch_size=1),
                      "must be split along axis 0")


@MULTI
def test_an_optimizer_with_no_parameters():
    params = [] if LAST else [torch.nn.Parameter(torch.ones(2))]
    raises_everywhere(ValueError, lambda: SignSGD(params, lr=0.1, comm=COMM),
                      "empty parameter list")


@MULTI
def test_a_different_collective_object_call_raises_on_every_rank():
    """Ranks that meet in an exchange of objects from different calls (an agreement on settings
    against another rank's broadcast) raise together instead of mixing their objects."""
    def mismatched():
        if LAST:
            return COMM.bcast("x", root=0)
        return hl.core.agreement.agree_on({"setting": 1}, COMM, "a test")
    raises_everywhere(RuntimeError, mismatched, "met in different collective calls")


def test_object_collectives_follow_mpi4py():
    """allgather, bcast, gather and allreduce of Python objects give mpi4py's results (objects
    are combined in rank order)."""
    from mpi4py import MPI
    r, p = COMM.rank, COMM.size
    assert COMM.allgather(("r", r)) == [("r", q) for q in range(p)]
    assert COMM.bcast({"k": r}, root=p - 1) == {"k": p - 1}
    assert COMM.allreduce(r) == sum(range(p))
    assert COMM.allreduce(float(r), op=MPI.MAX) == float(p - 1)
    assert COMM.allreduce(r == 0, op=MPI.LAND) is (p == 1)
    assert COMM.allreduce(1 << 70) == p << 70
    np.testing.assert_array_equal(COMM.allreduce(np.arange(3) * (r + 1)),
                                  np.arange(3) * sum(range(1, p + 1)))
    assert COMM.allreduce([r], op=MPI.SUM) == list(range(p))  # list concatenation, as mpi4py
    # any mix of types the ranks pass, Python's arithmetic (as mpi4py)
    assert COMM.allreduce(0 if r == 0 else 0.25) == 0.25 * (p - 1)
    assert COMM.allreduce(True) == p and type(COMM.allreduce(True)) is (int if p > 1 else bool)
    assert COMM.allreduce(1 << 62) == p << 62
    assert COMM.any_rank(r == p - 1) is True and COMM.any_rank(False) is False
    for root in range(p):  # only the root holds everyone's objects, sizes differing by rank
        got = COMM.gather({"r": r, "pad": "x" * (100 * r)}, root=root)
        assert got == ([{"r": q, "pad": "x" * (100 * q)} for q in range(p)] if r == root
                       else None)
    assert COMM.bcast(r, root=np.int64(p - 1)) == p - 1  # numpy integers are ranks too
    assert COMM.gather(r, root=np.int32(0)) == (list(range(p)) if r == 0 else None)
    for bad in (p, -1, 0.0, True):  # a root that is no rank (-1 is no "last rank")
        with pytest.raises(ValueError, match="root must be a rank"):
            COMM.gather(r, root=bad)
        with pytest.raises(ValueError, match="root must be a rank"):
            COMM.bcast(r, root=bad)
    mine = {"lr": 0.1}  # a copy comes back, at one rank too
    got = COMM.bcast(mine, root=0)
    got["lr"] = 1.0
    assert mine == {"lr": 0.1}


def test_a_gather_whose_root_differs_between_ranks_raises_everywhere():
    """Ranks that gather (or broadcast) from different roots raise on every rank, naming each
    rank's call."""
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(RuntimeError, match=r"rank 0: gather\(root=0\); rank 1: gather\(root=1\)"):
        COMM.gather("x", root=min(COMM.rank, 1))
    # a root that is no rank, on one rank only: every rank raises (before: that rank alone)
    with pytest.raises(RuntimeError, match=rf"rank 0: gather\(root={COMM.size}\); rank 1: "):
        COMM.gather("x", root=COMM.size if COMM.rank == 0 else 0)
    with pytest.raises(RuntimeError, match=rf"rank 0: bcast\(root={COMM.size}\); rank 1: "):
        COMM.bcast("x", root=COMM.size if COMM.rank == 0 else 0)


def test_a_distributed_dndarray_has_no_single_dlpack_buffer():
    """BufferError on every rank, also through is_split (the others' check says so)."""
    x = hl.zeros((COMM.size * 2, 3), split=0)
    if COMM.size > 1:
        with pytest.raises(BufferError):
            hl.from_dlpack(x, is_split=0)
    still_in_step()


@pytest.mark.parametrize("watched", [False, True], ids=["plain", "with-a-deadline"])
def test_an_object_one_rank_cannot_pickle_raises_on_every_rank(watched):
    """allgather, bcast and gather of Python objects: pickle refusing one rank's object (a
    lambda) raises TypeError on every rank, naming that rank (before: that rank raised alone and
    the others waited), with mpi4py's calls and with heatlike's watched ones alike."""
    last = COMM.size - 1
    mine = (lambda: 0) if COMM.rank == last else "fine"
    hl.core.checks.set_timeout(60 if watched else None)
    try:
        for call in (lambda: COMM.allgather(mine), lambda: COMM.bcast(mine, root=last),
                     lambda: COMM.gather(mine, root=0), lambda: COMM.allreduce(mine)):
            if COMM.size == 1:
                with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
                    call()
                continue
            with pytest.raises(TypeError, match=f"rank {last} could not pickle"):
                call()
        assert COMM.allgather(COMM.rank) == list(range(COMM.size))  # still in step
    finally:
        hl.core.checks.set_timeout(None)

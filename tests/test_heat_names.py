"""Heat's names in heatlike: dtype classes and aliases, devices, ``core.MPI``, ``meshgrid``,
``logspace``, ``eye`` with a shape, DLPack and the ``__partitioned__`` protocol; each against
numpy (or the protocol's definition) on every rank, with bad input raising on every rank."""

import numpy as np
import pytest
import torch
from _dndarray_helpers import COMM, assert_matches, global_array, layouts, raises_everywhere
from mpi4py import MPI

import heatlike as ht

pytestmark = pytest.mark.mpi

# heat.core.types.__all__ of Heat 1.9 (its dtype names), and the torch dtype each one means
HEAT_TYPES = {
    "bool": torch.bool, "bool_": torch.bool, "int8": torch.int8, "byte": torch.int8,
    "int16": torch.int16, "short": torch.int16, "int32": torch.int32, "int": torch.int32,
    "int64": torch.int64, "long": torch.int64, "uint8": torch.uint8, "ubyte": torch.uint8,
    "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
    "float": torch.float32, "float_": torch.float32, "float64": torch.float64,
    "double": torch.float64, "complex64": torch.complex64, "cfloat": torch.complex64,
    "csingle": torch.complex64, "complex128": torch.complex128, "cdouble": torch.complex128,
}
HEAT_ABSTRACT = ["datatype", "number", "integer", "signedinteger", "unsignedinteger", "floating",
                 "flexible"]
HEAT_TYPE_FUNCTIONS = ["astype", "can_cast", "canonical_heat_type", "heat_type_is_exact",
                       "heat_type_is_inexact", "heat_type_is_realfloating",
                       "heat_type_is_complexfloating", "iscomplex", "isdtype", "isreal",
                       "issubdtype", "heat_type_of", "promote_types", "result_type"]


def test_every_heat_dtype_name_exists_and_means_its_torch_type():
    for name, tdt in HEAT_TYPES.items():
        cls = getattr(ht, name)
        assert getattr(ht.types, name) is cls
        assert cls == tdt and tdt == cls and hash(cls) == hash(tdt), name
        assert cls.torch_type() is tdt
        assert ht.core.types.canonical_dtype(cls) is tdt
        assert ht.zeros(2, dtype=cls).dtype is tdt
        assert ht.canonical_heat_type(tdt) is ht.canonical_heat_type(cls)
    for name in HEAT_ABSTRACT:
        cls = getattr(ht, name)
        assert cls.torch_type() is NotImplemented
        raises_everywhere(TypeError, lambda cls=cls: ht.zeros(2, dtype=cls), "abstract")
        raises_everywhere(TypeError, lambda cls=cls: cls(3), "abstract")
    for name in HEAT_TYPE_FUNCTIONS:
        assert callable(getattr(ht, name)), name
    assert ht.bfloat16 == torch.bfloat16
    assert ht.float32.char() == "f" and ht.int64.char() == "l"
    assert ht.float32 != torch.float64 and ht.float32 != ht.float64
    assert ht.issubdtype(ht.float32, ht.floating) and not ht.issubdtype(ht.int8, ht.floating)
    assert ht.issubdtype(torch.int16, ht.signedinteger)
    assert ht.isdtype(ht.uint8, "unsigned integer") and ht.isdtype(torch.float64, "real floating")
    assert ht.heat_type_of(ht.ones(3, dtype=ht.int16)) is ht.int16
    assert ht.heat_type_of(np.zeros(2, np.float64)) is ht.float64
    assert ht.heat_type_is_exact(ht.bool) and ht.heat_type_is_inexact(ht.complex64)
    assert ht.can_cast(ht.int32, ht.float64, casting="safe")
    assert not ht.can_cast(ht.float64, ht.float32, casting="safe")
    assert ht.can_cast(ht.float64, ht.float32, casting="same_kind")
    raises_everywhere(ValueError, lambda: ht.can_cast(ht.int8, ht.int16, casting="odd"), "odd")
    raises_everywhere(ValueError, lambda: ht.isdtype(ht.int8, "kinda"), "kinda")


def test_dtype_classes_cast_and_keep_layout():
    g = global_array(3, (7, 4))
    for what, x in layouts(g):
        y = ht.int32(x)
        assert y.dtype is torch.int32 and y.split == x.split and y.counts == x.counts, what
        assert_matches(y, g.astype(np.int32), what)
        assert_matches(ht.float(x), g.astype(np.float32), what)
        assert x.dtype == ht.float64
    s = ht.float32(3)
    assert s.shape == () and s.dtype is torch.float32 and s.item() == 3.0
    assert_matches(ht.int8([1, 2, 3]), np.array([1, 2, 3], np.int8), dtype=np.int8)
    assert ht.float64().item() == 0.0
    raises_everywhere(TypeError, lambda: ht.float32(1, 2), "at most 1")


def test_devices():
    assert isinstance(ht.cpu, ht.devices.Device) and ht.core.Device is ht.devices.Device
    assert ht.cpu == "cpu" and ht.cpu.device_type == "cpu" and ht.cpu.torch_device == "cpu"
    assert ht.cpu.device_id == 0 and repr(ht.cpu) == "device(cpu:0)"
    x = ht.zeros((3, 2), split=0)
    assert x.device == ht.cpu and x.device is ht.cpu and x.device == "cpu"
    assert x.device.torch_device == str(x.larray.device)
    assert ht.get_device() is ht.cpu
    assert ht.devices.sanitize_device("cpu") is ht.cpu
    assert ht.devices.sanitize_device(torch.device("cpu")) is ht.cpu
    assert x.to_device(ht.cpu) is x and x.to_device("cpu") is x
    assert hasattr(ht, "gpu") == torch.cuda.is_available()
    raises_everywhere(ValueError, lambda: x.to_device(ht.cpu, stream=1), "stream")
    raises_everywhere(ValueError, lambda: ht.devices.sanitize_device("tpu"), "tpu")
    raises_everywhere(TypeError, lambda: ht.devices.sanitize_device(3), "cpu")
    if not torch.cuda.is_available():
        raises_everywhere(ValueError, lambda: ht.zeros(2, device="gpu"), "CUDA")
    ht.use_device("cpu")
    assert ht.get_device() is ht.cpu


def test_core_mpi_is_mpi4py():
    assert ht.core.MPI is MPI and ht.MPI is MPI
    assert ht.core.MPI.SUM is MPI.SUM


@pytest.mark.parametrize("indexing", ["xy", "ij"])
def test_meshgrid_every_layout_and_split_position(indexing):
    vecs = [global_array(10 + i, (n,)) for i, n in enumerate((4, 3, 5))]
    for k in range(3):  # which input is split
        for nd in (2, 3):
            ins = [ht.array(v, split=0 if i == k else None) for i, v in enumerate(vecs[:nd])]
            outs = ht.meshgrid(*ins, indexing=indexing)
            exp = np.meshgrid(*vecs[:nd], indexing=indexing)
            if k < nd:
                axis = {0: 1, 1: 0}.get(k, k) if indexing == "xy" else k
            for o, e in zip(outs, exp):
                assert_matches(o, e, f"{indexing} split input {k}")
                assert o.split == (axis if k < nd else None)
            sparse = ht.meshgrid(*ins, indexing=indexing, sparse=True)
            for o, e in zip(sparse, np.meshgrid(*vecs[:nd], indexing=indexing, sparse=True)):
                assert_matches(o, e, "sparse")
    assert ht.meshgrid() == []
    one = ht.meshgrid(ht.arange(3))
    assert len(one) == 1 and ht.equal(one[0], ht.arange(3))
    raises_everywhere(ValueError, lambda: ht.meshgrid(ht.arange(2), indexing="abc"), "indexing")
    raises_everywhere(ValueError, lambda: ht.meshgrid(ht.arange(4, split=0),
                                                       ht.arange(3, split=0)), "one input")


def test_logspace_against_numpy():
    for split in (None, 0):
        for args, kw in [((-3, 5), {}), ((-5, 3), {"num": 7}), ((0, 2), {"num": 5,
                         "base": 2.0}), ((1, 2), {"num": 4, "endpoint": False}),
                         ((0, 1), {"num": 0})]:
            x = ht.logspace(*args, split=split, **kw)
            e = np.logspace(*args, **kw)
            assert x.dtype is torch.float32 and x.split == (split if e.size else split)
            assert_matches(x, e.astype(np.float32), f"{args} {kw}", rtol=1e-5)
    assert_matches(ht.logspace(0, 2, 3, dtype=ht.uint8, split=0),
                   np.array([1, 10, 100], np.uint8), dtype=np.uint8)
    raises_everywhere(ValueError, lambda: ht.logspace(-5, 3, split=1), "split")
    raises_everywhere(ValueError, lambda: ht.logspace(-5, 3, num=-1), "non-negative")
    raises_everywhere(TypeError, lambda: ht.logspace(0, 1, base="10"), "base")


def test_eye_with_a_shape():
    for shape in ((4, 6), (6, 4), (5,), [3, 3], (0, 2)):
        for split in (None, 0, 1):
            for k in (0, 1, -2):
                e = np.eye(shape[0], shape[-1], k=k, dtype=np.int32)
                assert_matches(ht.eye(shape, k=k, dtype=ht.int32, split=split), e,
                               f"{shape} {split} {k}", dtype=np.int32)
    assert_matches(ht.eye(4, 6, split=0), np.eye(4, 6))
    raises_everywhere(TypeError, lambda: ht.eye((4, 6), 3), "not both")
    raises_everywhere(ValueError, lambda: ht.eye((1, 2, 3)), "one or two")
    raises_everywhere(TypeError, lambda: ht.eye(2.5), "integer")
    raises_everywhere(TypeError, lambda: ht.eye("(2, 3)"), "integer")
    raises_everywhere(ValueError, lambda: ht.eye((-1, 2)), "negative")


def test_dlpack_both_ways_shares_memory():
    a = np.arange(12.0).reshape(3, 4)
    x = ht.from_dlpack(a)
    assert x.split is None and x.dtype is torch.float64 and x.device == ht.cpu
    a[0, 0] = 99.0
    assert x.larray[0, 0].item() == 99.0  # shares numpy's memory
    t = torch.arange(6)
    y = ht.from_dlpack(t)
    assert y.larray.data_ptr() == t.data_ptr()
    z = ht.from_dlpack(y)
    assert z.larray.data_ptr() == t.data_ptr()
    back = np.from_dlpack(y)
    np.testing.assert_array_equal(back, t.numpy())
    assert y.__dlpack_device__() == t.__dlpack_device__()
    piece = torch.full((COMM.rank + 1, 2), float(COMM.rank))
    w = ht.from_dlpack(piece, is_split=0)
    assert w.split == 0 and w.counts == tuple(r + 1 for r in range(COMM.size))
    assert w.larray.data_ptr() == piece.data_ptr()
    d = ht.zeros((4, 4), split=0)
    if d.is_distributed():
        raises_everywhere(BufferError, lambda: ht.from_dlpack(d), "distributed")
        raises_everywhere(BufferError, lambda: d.__dlpack__(), "distributed")
    raises_everywhere(TypeError, lambda: ht.from_dlpack([1, 2]), "DLPack")


def _check_partitioned(x: ht.DNDarray) -> None:
    p = x.__partitioned__
    assert p is x.__partitioned__  # cached
    assert set(p) >= {"shape", "partition_tiling", "partitions", "locals", "get"}
    assert p["shape"] == x.gshape
    size, rank = COMM.size, COMM.rank
    if x.split is None:
        assert p["partition_tiling"] == (1,) * x.ndim
        (key,) = p["partitions"]
        part = p["partitions"][key]
        assert part["start"] == (0,) * x.ndim and part["shape"] == x.gshape
        assert part["location"] == list(range(size)) and part["data"] is x.larray
        assert p["locals"] == [key]
        return
    assert p["partition_tiling"] == tuple(size if d == x.split else 1 for d in range(x.ndim))
    assert len(p["partitions"]) == size
    for r in range(size):
        key = tuple(r if d == x.split else 0 for d in range(x.ndim))
        part = p["partitions"][key]
        assert part["location"] == [r]
        assert part["start"][x.split] == x.displs[r]
        assert part["shape"][x.split] == x.counts[r]
        assert (part["data"] is x.larray) == (r == rank)
        assert (part["data"] is None) == (r != rank)
    mine = tuple(rank if d == x.split else 0 for d in range(x.ndim))
    assert p["locals"] == [mine] and p["get"](x.larray) is x.larray


def test_partitioned_protocol_and_zero_copy_roundtrip():
    g = global_array(5, (7, 5))
    for what, x in layouts(g):
        _check_partitioned(x)
        y = ht.from_partitioned(x)
        if COMM.size > 1:
            assert y.split == x.split and y.counts == x.counts
        else:  # one tile on the one rank: a replicated array
            assert y.split is None
        assert y.larray.data_ptr() == x.larray.data_ptr(), what  # no copy
        assert_matches(y, g, what)
        z = ht.from_partition_dict(x.__partitioned__)
        assert_matches(z, g, what)
        x.resplit_(None if x.split is not None else 0)
        assert x.__partitioned__["shape"] == g.shape
        _check_partitioned(x)


def test_from_partition_dict_of_foreign_data():
    # another library's layout: rank r holds rows [2r, 2r + 2) as numpy arrays
    size, rank = COMM.size, COMM.rank
    g = np.arange(2 * size * 3, dtype=np.float32).reshape(2 * size, 3)
    parts = {(r, 0): {"start": (2 * r, 0), "shape": (2, 3), "location": [r],
                      "data": g[2 * r:2 * r + 2].copy() if r == rank else None}
             for r in range(size)}
    d = {"shape": g.shape, "partition_tiling": (size, 1), "partitions": parts,
         "locals": [(rank, 0)], "get": lambda h: h}
    x = ht.from_partition_dict(d)
    assert (x.split, x.counts) == ((0, (2,) * size) if size > 1 else (None, None))
    assert_matches(x, g)
    for key in ("shape", "locals", "partitions", "get", "partition_tiling"):
        bad = dict(d)
        del bad[key]
        raises_everywhere(RuntimeError, lambda bad=bad: ht.from_partition_dict(bad), key)
    two = dict(d, partition_tiling=(size, 2))
    if size > 1:
        raises_everywhere(RuntimeError, lambda: ht.from_partition_dict(two), "several axes")
        rev = {(r, 0): dict(parts[(r, 0)], location=[size - 1 - r]) for r in range(size)}
        raises_everywhere(RuntimeError,
                          lambda: ht.from_partition_dict(dict(d, partitions=rev)), "rank order")
    raises_everywhere(TypeError, lambda: ht.from_partitioned(g), "__partitioned__")
    raises_everywhere(TypeError, lambda: ht.from_partition_dict([1]), "dict")


def test_deliberate_differences_from_heat():
    """Where heatlike keeps numpy's meaning and Heat differs (docs/ports.md, "Deliberate
    differences"); each line pins one row of that table."""
    assert ht.zeros(2, dtype=int).dtype is torch.int64            # Heat: int32
    assert ht.arange(4).dtype is torch.int64                      # Heat: int32
    assert ht.full((2, 2), 4).dtype is torch.int64                # Heat: float32
    assert ht.empty_like(3).shape == ()                           # Heat: (1,)
    raises_everywhere(TypeError, lambda: ht.empty_like("abc"), "str")  # Heat: a 3-vector
    x = ht.arange(6, split=0).reshape((2, 3))
    assert ht.argmax(x).shape == ()                               # Heat: (1,)
    assert np.asarray(x).shape == (2, 3)                          # Heat: the local part
    f = ht.ones(3, dtype=ht.float32)
    g = f.astype(ht.float64, copy=False)
    assert g is not f and f.dtype is torch.float32                # Heat converts f in place
    f += ht.ones(3, dtype=ht.float64)                             # Heat: TypeError
    assert f.dtype is torch.float32 and ht.equal(f, 2.0)
    assert ht.var(ht.arange(5.0), ddof=2).item() == pytest.approx(10 / 3)  # Heat: NotImpl.Error
    assert ht.hypot(ht.arange(3), ht.arange(3)).dtype is torch.float64  # Heat: TypeError
    assert ht.maximum(ht.ones(2), torch.zeros(2)).shape == (2,)   # Heat: TypeError for tensors
    d = ht.diff(ht.arange(4.0), append=ht.arange(4.0))            # Heat: ValueError
    assert d.shape == (7,)
    u = ht.unfold(ht.arange(5), 0, 1)                              # Heat: ValueError for size 1
    assert u.shape == (5, 1)
    xs = ht.arange(10, split=0)
    y = ht.zeros(10)
    y += xs                                                        # Heat: ValueError (resplit)
    assert ht.equal(y, ht.arange(10))
    assert ht.equal(ht.cumsum(xs, 0, out=ht.empty(10, dtype=ht.int64, split=None)),
                    np.cumsum(np.arange(10)))                      # Heat: ValueError (out split)
    m = ht.arange(12, split=0).reshape((4, 3))
    raises_everywhere(IndexError, lambda: m[[0, 3], [1, 2]], "one integer or boolean array")
    raises_everywhere(IndexError, lambda: m[ht.array([[0, 1], [2, 3]])], "one-dimensional")
    v = ht.array([3.0, 1.0, 2.0, 1.0], split=0)                    # numpy's meaning on DNDarrays
    assert np.sort(v).tolist() == [1.0, 1.0, 2.0, 3.0]             # Heat: (values, indices)
    assert np.cumsum(m).tolist() == np.cumsum(np.arange(12)).tolist()  # Heat: TypeError
    assert np.percentile(v, 30, method="lower").item() == 1.0       # Heat: TypeError
    assert np.unique(v).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(TypeError):
        np.unique(v, return_counts=True)
    assert ht.linspace(-5, 0, 4, dtype=ht.int64).tolist() == [-5, -4, -2, 0]  # Heat: truncates
    b = ht.array([False, True, True, False], split=0)
    assert b.argmax().item() == 1 and b.argmin().item() == 0        # Heat: TypeError
    grid = ht.meshgrid(v)[0]                                       # Heat: shares v's memory
    grid[0] = 55.0
    assert v[0].item() == 3.0

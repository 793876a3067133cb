"""DASO checkpoints loaded at another layout: at another world size (saved by a sub-communicator
and loaded by the whole world, or the other way round) DASO's epoch follows the data loader's,
the epoch's final blocking synchronization happens at the loader's last batch and the replicas
agree after it; at the same world size on other nodes, the synchronizations in flight (shards cut
for the saved nodes) are dropped; without the loader, step() raises on every rank."""

from pathlib import Path

import pytest
import torch
from _helpers import close_daso_objects_built
from mpi4py import MPI
from torch import nn

from heatlike.core.topology import Topology
from heatlike.nn import DataParallelMultiGPU
from heatlike.optim import DASO
from heatlike.optim import daso as daso_module
from heatlike.utils import checkpoint
from heatlike.utils.data import DataLoader

pytestmark = pytest.mark.mpi

SAVE_AT = 5  # batches of the second epoch served when saving: a synchronization is in flight
PER_RANK = 2  # batch size per rank
_g = torch.Generator().manual_seed(3)
DATASET = torch.utils.data.TensorDataset(torch.randn(48, 5, generator=_g),
                                         torch.randint(0, 3, (48,), generator=_g))


@pytest.fixture(autouse=True)
def _closed_when_the_test_ends(monkeypatch):
    yield from close_daso_objects_built(monkeypatch)


def _layout(monkeypatch, node_ids):
    """The DASOs built next emulate nodes ``node_ids`` (one id per rank of their communicator;
    not through the environment, which every communicator would read)."""
    monkeypatch.delenv("HEATLIKE_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("HEATLIKE_NODE_IDS", raising=False)

    def topology(comm, cross_method="split"):
        return Topology(comm, node_ids=tuple(node_ids), cross_method=cross_method)
    monkeypatch.setattr(daso_module, "Topology", topology)


def _build(comm, seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    daso = DASO(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), total_epochs=4,
                comm=comm, warmup_epochs=1, cooldown_epochs=1, max_global_skips=2)
    model = DataParallelMultiGPU(net, daso)
    loader = DataLoader(DATASET, batch_size=PER_RANK, seed=1, comm=comm)
    daso.last_batch = len(loader)
    return net, daso, model, loader


def _step(daso, model, batch):
    x, y = batch
    daso.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    daso.step()


def _save_mid_cycle(comm, path):
    """Train the warmup epoch and SAVE_AT batches of the first cycling one, then save (a global
    synchronization sent at batch SAVE_AT - 1 is merged at batch SAVE_AT)."""
    _, daso, model, loader = _build(comm, seed=0)
    for batch in loader:
        _step(daso, model, batch)
    daso.epoch_loss_logic(1.0, loss_globally_averaged=True)
    for batch in loader:
        _step(daso, model, batch)
        if loader._position == SAVE_AT:
            break
    assert [(s.start, s.receive_at) for s in daso._pending] == [(SAVE_AT - 1, SAVE_AT)]
    checkpoint.save(path, model, daso, loader=loader)
    model.close()


def _finish_epoch(comm, net, daso, model, loader):
    """Serve the rest of the loader's epoch: DASO's batch is the loader's position throughout,
    its epoch ends with the loader's, with the final blocking synchronization at the loader's
    last batch, after which every replica is the same."""
    epoch = daso.epoch
    daso.trace = []
    for batch in loader:
        _step(daso, model, batch)
        if loader._position < len(loader):
            assert (daso.epoch, daso.current_batch) == (epoch, loader._position)
    assert (daso.epoch, daso.current_batch) == (epoch + 1, 0)
    blocking = [t[:2] for t in daso.trace if t[2] == "blocking"]
    assert blocking == [(epoch, len(loader) - 1)]
    mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for r, other in enumerate(comm.handle.allgather(mine)):
        assert torch.equal(other, mine), f"rank {r} differs after the epoch's blocking sync"


def _shared_path(comm, tmp_path):
    return Path(comm.handle.bcast(str(tmp_path / "daso.ckpt"), root=0))


@pytest.mark.parametrize("nodes", [(1, 2), (2, 1)], ids=["alone-then-pairs", "pairs-then-alone"])
@pytest.mark.parametrize("direction", ["grow", "shrink"])
def test_another_world_size_follows_the_data_loader(comm, tmp_path, monkeypatch, direction,
                                                    nodes):
    """Saved mid-cycle at k ranks and loaded at n (one rank fewer or more, nodes of another
    size): no crash, the synchronization in flight is dropped, DASO resumes at the loader's
    position (the first global batch not completely served) and finishes its epoch with the
    loader's; loaded without the loader, step() raises ValueError on every rank until
    resume_at()."""
    if comm.size == 1:
        pytest.skip("needs a second rank for another world size")
    path = _shared_path(comm, tmp_path)
    smaller = comm.Split(0 if comm.rank < comm.size - 1 else MPI.UNDEFINED, comm.rank)
    saving, loading = (smaller, comm) if direction == "grow" else (comm, smaller)
    saved_size = comm.size - 1 if direction == "grow" else comm.size
    try:
        if saving is not None:
            _layout(monkeypatch, [r // nodes[0] for r in range(saving.size)])
            _save_mid_cycle(saving, path)
        comm.Barrier()
        if loading is not None:
            _layout(monkeypatch, [r // nodes[1] for r in range(loading.size)])
            net, daso, model, loader = _build(loading, seed=1)
            checkpoint.load(path, model, daso, loader=loader)
            position = SAVE_AT * saved_size // loading.size
            assert 0 < position < len(loader)
            assert not daso.position_unknown
            assert (daso.epoch, daso.current_batch, loader._position) == (1, position, position)
            assert daso._pending == [] and daso._send_mod == 0
            _finish_epoch(loading, net, daso, model, loader)

            _, other, other_model, _ = _build(loading, seed=2)
            checkpoint.load(path, other_model, other)  # without the loader
            assert other.position_unknown and other.current_batch == 0
            with pytest.raises(ValueError, match=r"checkpoint\.load.*resume_at"):
                other.step()
            other.resume_at(position)
            assert not other.position_unknown and other.current_batch == position
            other.last_batch = position  # fewer batches than already served
            with pytest.raises(ValueError, match=rf"current_batch \({position}\).*"
                                                 rf"last_batch \({position}\)"):
                other.step()
            model.close()
            other_model.close()
        comm.Barrier()
    finally:
        if smaller is not None:
            smaller.Free()


def _node_ids(kind, size):
    return {"pairs": [r // 2 for r in range(size)], "alone": list(range(size)),
            "alternating": [r % 2 for r in range(size)]}[kind]


@pytest.mark.parametrize("layouts", [("pairs", "alone"), ("alone", "pairs"),
                                     ("pairs", "alternating"), ("pairs", "pairs")],
                         ids=lambda pair: "-then-".join(pair))
def test_the_same_world_size_on_other_nodes(comm, tmp_path, monkeypatch, layouts):
    """Saved mid-cycle on one node layout, loaded at the same world size on another (other node
    sizes, or the same sizes with other ranks together): the synchronization in flight, whose
    shards were cut for the saved nodes, is dropped (before: a size mismatch at its merge); the
    position holds (same global batch) and the epoch ends with the loader's. On the same layout
    it is kept. The wrapper's node-local gradient averaging keeps its state as built (at an odd
    size, a rank alone on its node at the save joins another: loading its saved state there
    crashed the next backward)."""
    saved_ids, loaded_ids = (_node_ids(kind, comm.size) for kind in layouts)
    same = saved_ids == loaded_ids
    if same != (layouts[0] == layouts[1]):
        pytest.skip(f"{layouts[0]} and {layouts[1]} are alike at {comm.size} ranks")
    path = _shared_path(comm, tmp_path)
    _layout(monkeypatch, saved_ids)
    _save_mid_cycle(comm, path)
    _layout(monkeypatch, loaded_ids)
    net, daso, model, loader = _build(comm, seed=1)
    checkpoint.load(path, model, daso, loader=loader)
    assert not daso.position_unknown
    assert (daso.epoch, daso.current_batch, loader._position) == (1, SAVE_AT, SAVE_AT)
    assert len(daso._pending) == (1 if same else 0)
    if not same:
        assert daso._send_mod == 0 and not daso._node_agrees
    _finish_epoch(comm, net, daso, model, loader)


def test_states_of_another_or_an_unrecorded_layout(comm):
    """By hand: a state without a recorded layout (an older checkpoint) is taken as this
    layout's; one claiming another world size leaves the position unknown until resume_at
    (validated; last_batch moves to the next epoch), and drops the synchronization in flight."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    daso = DASO(torch.optim.SGD(net.parameters(), lr=0.05), total_epochs=4, comm=comm,
                warmup_epochs=1, cooldown_epochs=1, max_global_skips=2)
    model = DataParallelMultiGPU(net, daso)
    daso.last_batch = 4
    g = torch.Generator().manual_seed(comm.rank)
    batches = [(torch.randn(2, 5, generator=g), torch.randint(0, 3, (2,), generator=g))
               for _ in range(7)]
    for i, batch in enumerate(batches):  # the warmup epoch, then batches 0..2 of the next
        _step(daso, model, batch)
        if i == 3:
            daso.epoch_loss_logic(1.0, loss_globally_averaged=True)
    assert (daso.epoch, daso.current_batch, len(daso._pending)) == (1, 3, 1)
    state = daso.state_dict()
    assert state["daso"]["layout"] == state["engine"]["layout"] == daso._layout()

    old = daso.state_dict()
    del old["daso"]["layout"], old["engine"]["layout"], old["daso"]["lost_position"]
    daso.load_state_dict(old)
    assert (daso.current_batch, len(daso._pending), daso.position_unknown) == (3, 1, False)

    other = {k: v for k, v in state.items()}
    bigger = comm.size + 1
    layout = {"world_size": bigger, "local_sizes": [1] * bigger, "node_ids": list(range(bigger))}
    other["daso"] = {**state["daso"], "layout": layout}
    other["engine"] = {**state["engine"], "layout": layout}
    daso.load_state_dict(other)
    assert daso.position_unknown and daso.current_batch == 0 and daso._pending == []
    assert daso.state_dict()["daso"]["lost_position"] == [bigger, 3]
    with pytest.raises(ValueError, match=rf"saved at {bigger} ranks.*resume_at"):
        daso.step()
    for bad, error in ((True, TypeError), (1.0, TypeError), (-1, ValueError)):
        with pytest.raises(error):
            daso.resume_at(bad)
    assert daso.position_unknown
    daso.resume_at(4)  # the epoch was served completely
    assert not daso.position_unknown and (daso.epoch, daso.current_batch) == (2, 0)
    daso.load_state_dict(other)
    daso.resume_at(3)
    _step(daso, model, batches[0])  # the epoch's last batch: a blocking synchronization
    assert (daso.epoch, daso.current_batch) == (2, 0)
    mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for other_rank in comm.handle.allgather(mine):
        assert torch.equal(other_rank, mine)


def test_the_scheduler_daso_steps_is_saved_with_it(comm, tmp_path):
    """DASO steps its ``scheduler`` after every batch: its state travels in DASO's state dict,
    so a checkpoint of the model and DASO alone resumes the learning-rate schedule (it restarted
    from the first epoch's rate)."""
    path = _shared_path(comm, tmp_path)

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)
        daso = DASO(sgd, total_epochs=4, comm=comm, warmup_epochs=1, cooldown_epochs=1,
                    scheduler=schedule)
        model = DataParallelMultiGPU(net, daso)
        daso.last_batch = 6
        return daso, model, schedule

    daso, model, schedule = build()
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(5):
        _step(daso, model, (torch.randn(2, 5, generator=g), torch.randint(0, 3, (2,),
                                                                        generator=g)))
    checkpoint.save(path, model, daso)
    lr = daso.param_groups[0]["lr"]
    assert lr == pytest.approx(0.05 * 0.5 ** 2)
    resumed, resumed_model, resumed_schedule = build()
    checkpoint.load(path, resumed_model, resumed)
    assert resumed.param_groups[0]["lr"] == lr
    assert resumed_schedule.state_dict() == schedule.state_dict()

"""heatlike.nn.Join: ranks with fewer batches shadow the others' iterations.

Reference: one process replays the run, averaging at each step the gradients of the ranks that
still had a batch (the combined batch of the ranks still training); every rank compares its
parameters and its optimizer state (momentum) with it.
"""

import contextlib
import copy
import sys

import pytest
import torch
from torch import nn

import heatlike as hl
from heatlike.nn import DataParallel, Join
from heatlike.optim import CentralizedSGD, DataParallelOptimizer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-5, atol=1e-6)


def _steps(rank: int) -> int:
    return 2 + 2 * rank  # rank 0 runs out first, the last rank trains longest


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _reference(size: int):
    """(model, optimizer) after the uneven run, replayed in one process."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(max(_steps(r) for r in range(size))):
        active = [r for r in range(size) if step < _steps(r)]
        grads = []
        for r in active:
            net.zero_grad()
            loss_fn(net(_batch(r, step)[0]), _batch(r, step)[1]).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for i, p in enumerate(net.parameters()):
            p.grad = sum(g[i] for g in grads) / len(active)
        opt.step()
    return net, opt


def _check(net, opt, comm):
    ref_net, ref_opt = _reference(comm.size)
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert torch.allclose(p, q, **TOL), "parameters"
    for p, q in zip(net.parameters(), ref_net.parameters()):
        mine = opt.state[p]["momentum_buffer"]
        assert torch.allclose(mine, ref_opt.state[q]["momentum_buffer"], **TOL), "momentum"
    hl.nn.verify_replicas(net, comm)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_data_parallel_with_uneven_batches_matches_the_combined_batch(comm, blocking):
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    loss_fn = nn.CrossEntropyLoss()
    with Join([model]) as join:
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    model.flush()
    assert join.iterations == _steps(comm.rank)
    _check(net, opt.torch_optimizer, comm)
    assert model.grad_sync.reducer.denom == comm.size  # restored after the join


def test_held_buckets_with_uneven_batches_match_the_combined_batch(comm, monkeypatch):
    """Non-blocking with held gradient buckets (forced: from bucket 1 on, every parameter in a
    bucket of its own): the ranks out of batches shadow the held buckets' exchanges in the
    same order, and the model is the single process's."""
    from heatlike.engine import gradsync

    def net() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 3))

    monkeypatch.setattr(gradsync, "hold_from", lambda timing, nbytes: 1)
    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", 64)
    monkeypatch.setattr(sys.modules[__name__], "_net", net)
    monkeypatch.setattr(sys.modules[__name__], "_steps", lambda rank: 5 + 2 * rank)
    held = []
    start_held = gradsync.GradientSync._start_held

    def spy(sync):
        held.append(len(sync._held_back))
        start_held(sync)

    monkeypatch.setattr(gradsync.GradientSync, "_start_held", spy)
    test_data_parallel_with_uneven_batches_matches_the_combined_batch(comm, False)
    assert comm.size == 1 or max(held) > 0, held


def _train_joined(model, opt, comm) -> None:
    """This rank's uneven share of the run, inside ``Join([model, opt])``."""
    loss_fn = nn.CrossEntropyLoss()
    with Join([model, opt]):
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()


def test_data_parallel_with_a_torch_optimizer_joins(comm):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_joined(DataParallel(net, comm), opt, comm)
    _check(net, opt, comm)


def test_centralized_optimizer_joins(comm):
    net = _net()
    opt = CentralizedSGD(model=net, lr=0.1, momentum=0.9, comm=comm)
    loss_fn = nn.CrossEntropyLoss()
    with Join([opt]):
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
    _check(net, opt.optimizer, comm)


def test_a_rank_without_any_batch(comm):
    """Rank 0 has no data at all; buffers (BatchNorm statistics) are broadcast in the shadows
    and the replicas stay equal."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt)
    steps = 0 if comm.rank == 0 else 3
    with Join([model]):
        for step in range(steps):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    hl.nn.verify_replicas(net, comm)
    if comm.size > 1:
        assert int(net[1].num_batches_tracked) == 3


def test_throw_on_early_termination_raises_on_every_rank(comm):
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=True)
    model = DataParallel(net, comm, optimizer=opt)
    if comm.size == 1:
        pytest.skip("needs a second rank")
    with pytest.raises(RuntimeError, match="ran out of inputs"):
        with Join([model], throw_on_early_termination=True):
            for step in range(_steps(comm.rank)):
                x, y = _batch(comm.rank, step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()


def test_disabled_join_is_a_no_op(comm):
    net = _net()
    model = DataParallel(net, comm)
    with Join([model], enable=False) as join:
        model(torch.randn(2, 6)).sum().backward()
    assert join.iterations == 0


def test_bad_joinables_raise_on_every_rank(comm):
    with pytest.raises(TypeError, match="Join supports"):
        Join([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="DataParallel model or a centralized"):
        Join([])
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="through a DataParallel"):
        Join([opt, CentralizedSGD(model=copy.deepcopy(net), lr=0.1, comm=comm)])
    # each announces its own iterations: a rank out of inputs could not follow both (before,
    # the training ranks waited for the second announcement while it stood in for the first)
    with pytest.raises(ValueError, match="DataParallel models or centralized optimizers, not "
                                         "both"):
        Join([DataParallel(net, comm), CentralizedSGD(model=copy.deepcopy(net), lr=0.1,
                                                      comm=comm)])


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi_timeout(60)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "deferred"])
@pytest.mark.parametrize("then", ["step", "backward outside"])
def test_an_exchange_no_forward_announced_raises_on_every_rank(comm, blocking, then):
    """Under Join the ranks out of inputs shadow a gradient exchange only where the iteration's
    forward pass announced it. Gradients accumulated under ``no_sync()`` and averaged by
    ``step()``, or a forward inside ``no_sync()`` whose backward runs outside it, exchange
    without that announcement: a clear RuntimeError on every rank, here rank 0, out of inputs,
    included (before, the training ranks waited forever for it in the exchange, and it for them in
    the next announcement). The documented pattern, the last micro-step outside ``no_sync()``,
    trains the combined batch's model (test_data_parallel_with_uneven_batches...)."""
    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt)
    with pytest.raises(RuntimeError, match="did not announce.*outside no_sync"):
        with Join([model]):
            for step in range(1 if comm.rank == 0 else 3):
                x, y = _batch(comm.rank, step)
                opt.zero_grad()
                if step == 0:  # as documented; then rank 0 has joined
                    nn.functional.cross_entropy(model(x), y).backward()
                elif then == "step":
                    with model.no_sync():
                        nn.functional.cross_entropy(model(x), y).backward()
                else:
                    with model.no_sync():
                        out = model(x)
                    nn.functional.cross_entropy(out, y).backward()
                opt.step()
    model.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi_timeout(60)
@pytest.mark.parametrize("where", ["first", "second"])
def test_non_finite_parameters_under_join_raise_on_every_rank(comm, where):
    """DataParallel(check_finite=True) under Join: the training ranks' parameters become NaN
    (here set by hand, on the training ranks only) after rank 0 ran out of inputs. The
    notification carries the verdict: FloatingPointError on every rank, rank 0 included, in
    the model that runs forward first or in the second (which notifies no more). Before, the
    training ranks raised after the notification while rank 0 waited in its shadow of their
    exchange until they ended."""
    torch.manual_seed(3)
    encoder, head = nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Linear(16, 3)
    enc = DataParallel(encoder, comm, check_finite=True)
    top = DataParallel(head, comm, check_finite=True)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    broken = encoder[0].weight if where == "first" else head.weight
    message = r"non-finite parameters \[.*weight.*\]" if comm.rank else "on the training ranks"
    with pytest.raises(FloatingPointError, match=message):
        with Join([enc, top, opt]):
            for step in range(1 if comm.rank == 0 else 3):
                if step == 2:
                    with torch.no_grad():
                        broken[0, 0] = float("nan")
                x, y = _batch(comm.rank, step)
                opt.zero_grad()
                nn.functional.cross_entropy(top(enc(x)), y).backward()
                opt.step()
    enc.close()
    top.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "deferred"])
@pytest.mark.parametrize("codec", [None, "topk"])
def test_ranks_a_step_apart_are_not_uneven_batches(comm, codec, blocking):
    """Without Join, the step board compares the ranks' training steps at the same position
    only: a rank that is slow (a step behind, or with its exchanges on a private channel, topk)
    and collectives of the program between steps are not taken for different numbers of
    batches."""
    import time

    from heatlike.engine.codecs import TopK

    net = _net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), blocking=blocking)
    model = DataParallel(net, comm, optimizer=opt, codec=TopK(k=8) if codec else None)
    for step in range(4):
        if comm.rank == step % comm.size:
            time.sleep(0.2)
        opt.zero_grad()
        x, y = _batch(0, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % 2:  # a metric, between steps
            metric = torch.tensor([loss.item()])
            comm.Allreduce(hl.IN_PLACE, metric)
    model.eval()
    ranks = torch.tensor([1.0])
    comm.Allreduce(hl.IN_PLACE, ranks)
    assert ranks.item() == comm.size


def test_heatlike_optimizers_join_only_where_join_can_stand_in_for_them(comm):
    """A DataParallelOptimizer joins through its model; heatlike optimizers whose exchanges are
    not gradient averages are refused on every rank instead of being stepped as local ones."""
    from heatlike.nn import DataParallel, Join
    from heatlike.optim import DataParallelOptimizer, DecentralizedSGD

    net = torch.nn.Linear(4, 2)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    model = DataParallel(net, comm, optimizer=opt)
    with Join([model, opt]):
        pass
    with pytest.raises(ValueError, match="joins through its DataParallel model"):
        Join([opt])
    gossip = DecentralizedSGD(model=torch.nn.Linear(4, 2), lr=0.1, comm=comm)
    with pytest.raises(TypeError, match="cannot stand in for DecentralizedSGD"):
        Join([model, gossip])


def test_zero_redundancy_optimizer_joins_with_its_model(comm):
    """The rank out of inputs steps its shard in the others' steps: the combined-batch model,
    and the consolidated momentum equals the one-process optimizer's. Left out of the
    joinables, the ZeRO optimizer makes Join refuse to start, on every rank."""
    from heatlike.optim import ZeroRedundancyOptimizer

    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=comm,
                                  lr=0.1, momentum=0.9)
    model = DataParallel(net, comm)
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer .* not among the joinables"):
        Join([model])
    _train_joined(model, opt, comm)
    opt.consolidate_state_dict(to=None)
    full = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    full.load_state_dict(opt.state_dict())
    _check(net, full, comm)


@pytest.mark.parametrize("between", ["clip", "schedule"])
def test_zero_shards_of_ranks_out_of_inputs_follow_the_training_loop(comm, between):
    """What the loop does between backward and step (clip_grad_norm_, a per-iteration
    scheduler) reaches the shards of the ranks standing in: they step with the gradients and
    learning rate of the highest rank still training, and the model is the one-process run's
    (before: those shards stepped with the unclipped averages and the old learning rate, 0.03
    off after the uneven tail)."""
    from heatlike.optim import ZeroRedundancyOptimizer

    def train(net, opt, sched, batches):
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            if between == "clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
            if between == "schedule":
                sched.step()

    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=comm,
                                  lr=0.1, momentum=0.9)
    model = DataParallel(net, comm)
    with Join([model, opt]):
        train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
              [_batch(comm.rank, step) for step in range(_steps(comm.rank))])
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    combined = []
    for step in range(max(_steps(r) for r in range(comm.size))):
        active = [r for r in range(comm.size) if step < _steps(r)]
        combined.append((torch.cat([_batch(r, step)[0] for r in active]),
                         torch.cat([_batch(r, step)[1] for r in active])))
    train(ref, ref_opt, torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5), combined)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, **TOL), f"parameters off by {(p - q).abs().max():.3g}"
    hl.nn.verify_replicas(net, comm)


def test_two_models_trained_together_join_once_per_iteration(comm):
    """An encoder and a head wrapped separately under one torch optimizer: one notification
    per iteration (the first model's forward), the buffers of both synchronized at its start,
    the shadows exchanging the head's gradients before the encoder's, as backward does, and
    the optimizer stepped once (before: every forward notified, the rank out of inputs shadowed
    both models twice per iteration and the job hung)."""
    encoder, head, ref_params, ref_opt = _encoder_and_head(comm)
    enc, top = DataParallel(encoder, comm), DataParallel(head, comm)
    params = [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    with Join([top, enc, opt]) as join:  # listed in another order than they run
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(top(enc(x)), y).backward()
            opt.step()
    assert join.iterations == _steps(comm.rank)
    for p, q in zip(params, ref_params):
        assert torch.allclose(p, q, **TOL), "parameters"
        assert torch.allclose(opt.state[p]["momentum_buffer"],
                              ref_opt.state[q]["momentum_buffer"], **TOL), "momentum"
    hl.nn.verify_replicas(encoder, comm)
    hl.nn.verify_replicas(head, comm)


def _encoder_and_head(comm):
    """An encoder (with BatchNorm, kept in eval mode) and a head, and the reference: their
    parameters and SGD optimizer (momentum 0.9) after the uneven run, replayed in one process
    with the combined batch of the ranks still training at each step."""
    torch.manual_seed(3)
    encoder = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh())
    head = nn.Linear(16, 3)
    ref_encoder, ref_head = copy.deepcopy(encoder), copy.deepcopy(head)
    ref_params = [*ref_encoder.parameters(), *ref_head.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
    for step in range(max(_steps(r) for r in range(comm.size))):
        active = [r for r in range(comm.size) if step < _steps(r)]
        x = torch.cat([_batch(r, step)[0] for r in active])
        y = torch.cat([_batch(r, step)[1] for r in active])
        ref_opt.zero_grad()
        # one process with the combined batch: per-rank BatchNorm statistics differ from the
        # combined batch's, so the reference keeps the layer in eval mode (no batch statistics)
        ref_encoder[1].eval()
        nn.functional.cross_entropy(ref_head(ref_encoder(x)), y).backward()
        ref_opt.step()
    encoder[1].eval()
    return encoder, head, ref_params, ref_opt


@pytest.mark.parametrize("check_finite", [False, True], ids=["", "check_finite"])
def test_two_models_with_held_buckets_and_their_own_optimizers_join(comm, monkeypatch,
                                                                     check_finite):
    """Two models, each with its own non-blocking DataParallelOptimizer, buckets held to the end
    of the backward pass (forced), optionally checking finiteness: the training ranks start
    both models' buckets during the backward pass and each model's held buckets and flags in
    its end-of-backward callback, all on one communicator; a rank out of inputs shadows them in
    that order (before: one model whole, then the other, so the collectives were matched with
    the wrong ones: an MPI error or wrong sums). The model is the single process's."""
    from heatlike.engine import gradsync

    monkeypatch.setattr(gradsync, "hold_from", lambda timing, nbytes: 1)
    monkeypatch.setattr(gradsync, "INPLACE_MIN_BYTES", 64)
    monkeypatch.setattr(sys.modules[__name__], "_steps", lambda rank: 5 + 2 * rank)
    encoder, head, ref_params, ref_opt = _encoder_and_head(comm)
    opts = [DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                  blocking=False) for m in (encoder, head)]
    enc = DataParallel(encoder, comm, opts[0], check_finite=check_finite)
    top = DataParallel(head, comm, opts[1], check_finite=check_finite)
    pending = []  # the head's deferred update, when the encoder's forward has run
    encoder.register_forward_hook(lambda *_: pending.append(len(opts[1]._pending)))
    _train_two_and_compare([enc, top], enc, top, opts, ref_params, comm)
    # check_finite reads the parameters of every model at the first forward past the deferred
    # updates' guards (before, it applied the head's update there, early, serializing it)
    assert comm.size == 1 or max(pending) > 0, pending


def _no_batch_on_rank_0(rank: int) -> int:
    return 0 if rank == 0 else 2 + rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizers", ["torch", "deferred"])
def test_a_rank_without_batches_follows_two_models_listed_out_of_forward_order(
        comm, monkeypatch, optimizers):
    """Rank 0 has no batch at all, so it never sees the order the models run forward in; they
    are listed the other way round. The notification tells it the model that runs first, and
    its shadows exchange their gradients in the training ranks' order: the single process's
    model (before: the two models' exchanges met the wrong ones, and the model diverged)."""
    monkeypatch.setattr(sys.modules[__name__], "_steps", _no_batch_on_rank_0)
    encoder, head, ref_params, _ = _encoder_and_head(comm)
    if optimizers == "torch":
        opts = [torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1,
                                momentum=0.9)]
        enc, top = DataParallel(encoder, comm), DataParallel(head, comm)
        joinables = [top, enc, *opts]
    else:
        opts = [DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                      blocking=False) for m in (encoder, head)]
        enc = DataParallel(encoder, comm, opts[0])
        top = DataParallel(head, comm, opts[1])
        joinables = [top, enc]
    _train_two_and_compare(joinables, enc, top, opts, ref_params, comm)


def _train_two_and_compare(joinables, enc, top, opts, ref_params, comm) -> None:
    """Train ``top(enc(x))`` under ``Join(joinables)`` for this rank's steps, stepping every
    optimizer of ``opts``; compare the models with ``ref_params`` (:func:`_encoder_and_head`)
    and close them."""
    with Join(joinables):
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            for opt in opts:
                opt.zero_grad()
            nn.functional.cross_entropy(top(enc(x)), y).backward()
            for opt in opts:
                opt.step()
    for opt in opts:
        if isinstance(opt, DataParallelOptimizer):
            opt.flush()
    for p, q in zip([*enc.module.parameters(), *top.module.parameters()], ref_params):
        assert torch.allclose(p, q, **TOL), "parameters"
    hl.nn.verify_replicas(enc.module, comm)
    hl.nn.verify_replicas(top.module, comm)
    enc.close()
    top.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi_timeout(60)
@pytest.mark.parametrize("listed", ["in forward order", "otherwise"])
@pytest.mark.parametrize("run", ["steps", "one step", "accumulating"])
def test_three_models_and_a_rank_without_batches(comm, monkeypatch, listed, run):
    """Three models of equal shapes (so that mismatched exchanges would sum the wrong model's
    gradients without an MPI error) and rank 0 without any batch. Listed in forward order: the
    single process's models. Listed otherwise: rank 0 shadows the exchanges before it hears
    the order in a wrong one, and the notification that first carries the order (the next
    iteration's, or the last one's, where the others train one step and join knowing it)
    raises RuntimeError on every rank (before: wrong models, silently). Where nothing was
    exchanged before the order was heard (the first iteration's gradients accumulated under
    ``no_sync()``), the single process's models again."""
    steps = {"steps": 3, "one step": 1, "accumulating": 4}[run]
    monkeypatch.setattr(sys.modules[__name__], "_steps", lambda r: 0 if r == 0 else steps)
    sync_every = 2 if run == "accumulating" else 1
    torch.manual_seed(5)
    nets = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)]
    refs = copy.deepcopy(nets)
    ref_opt = torch.optim.SGD([p for r in refs for p in r.parameters()], lr=0.1)
    for step in range(steps):  # the combined batch of ranks 1.. at each micro-step
        x = torch.cat([_batch(r, step)[0] for r in range(1, comm.size)])
        y = torch.cat([_batch(r, step)[1] for r in range(1, comm.size)])
        nn.functional.cross_entropy(refs[2](refs[1](refs[0](x)))[:, :3], y).backward()
        if (step + 1) % sync_every == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    models = [DataParallel(net, comm) for net in nets]
    opt = torch.optim.SGD([p for net in nets for p in net.parameters()], lr=0.1)
    joinables = [*models, opt] if listed == "in forward order" else [models[2], models[0],
                                                                       models[1], opt]

    def train():
        with Join(joinables):
            for step in range(_steps(comm.rank)):
                x, y = _batch(comm.rank, step)
                synced = (step + 1) % sync_every == 0
                with contextlib.ExitStack() as stack:
                    if not synced:
                        for model in models:
                            stack.enter_context(model.no_sync())
                    out = models[2](models[1](models[0](x)))
                    nn.functional.cross_entropy(out[:, :3], y).backward()
                if synced:
                    opt.step()
                    opt.zero_grad()

    if listed == "otherwise" and run != "accumulating":
        with pytest.raises(RuntimeError, match="in the order they run forward"):
            train()
    else:
        train()
        for net, ref in zip(nets, refs):
            for p, q in zip(net.parameters(), ref.parameters()):
                assert torch.allclose(p, q, **TOL), "parameters"
    for model in models:
        model.close()


def test_clipping_between_backward_and_step_ends_in_equal_optimizer_states(comm):
    """What the loop does between backward and step (here clip_grad_norm_) the shadows cannot
    repeat; when every rank has joined, the last rank's parameters and optimizer state are
    given to every rank: the same state as the one-process run, and replicas that stay equal
    (before: the momentum of the ranks out of inputs differed, and the replicas drifted apart
    at the next step)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = DataParallel(net, comm)
    with Join([model, opt]):
        for step in range(_steps(comm.rank)):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(max(_steps(r) for r in range(comm.size))):
        active = [r for r in range(comm.size) if step < _steps(r)]
        ref_opt.zero_grad()
        x = torch.cat([_batch(r, step)[0] for r in active])
        y = torch.cat([_batch(r, step)[1] for r in active])
        nn.functional.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, **TOL), "parameters"
        assert torch.allclose(opt.state[p]["momentum_buffer"],
                              ref_opt.state[q]["momentum_buffer"], **TOL), "momentum"
    x, y = _batch(comm.rank, 99)  # one more even step: the replicas stay equal
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    hl.nn.verify_replicas(net, comm)


def test_zero_under_a_grad_scaler_with_a_joined_rank_raises_on_every_rank(comm):
    """A rank out of inputs would step its ZeRO shard with still-scaled gradients and could not
    follow the scaler's skipped steps (before: a model 16.8 off, or a hang): RuntimeError on
    every rank at the first step after a rank joined."""
    from heatlike.optim import ZeroRedundancyOptimizer

    if comm.size == 1:
        pytest.skip("no rank runs out of inputs before another at one rank")
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=comm,
                                  lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = DataParallel(net, comm)
    with pytest.raises(RuntimeError, match="GradScaler steps a ZeroRedundancyOptimizer"):
        with Join([model, opt]):
            for step in range(_steps(comm.rank)):
                x, y = _batch(comm.rank, step)
                opt.zero_grad()
                scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()

"""heatlike.recipes.evaluate and train_task: a model is scored as a trained model is used (eval
mode, no gradient, one set of buffers on every rank) and left as it was; ``target`` stops
training with or without ``curve``. References: one process scoring rank 0's model in torch."""

import pytest
import torch
from torch import nn

from heatlike import recipes
from heatlike.nn import DataParallel
from heatlike.optim import DataParallelOptimizer

pytestmark = pytest.mark.mpi

_DIGITS = {}


def _digits():
    if not _DIGITS:
        _DIGITS["data"] = recipes.load_digits_split(0)
    return _DIGITS["data"]


def _bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(32, 10))


def _reference_accuracy(state: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """One process, torch: the model of ``state`` in eval mode over the whole test set."""
    ref = _bn_net()
    ref.load_state_dict(state)
    ref.eval()
    with torch.no_grad():
        correct = int((ref(x).argmax(1) == y).sum())
    return float(torch.tensor([correct, len(y)], dtype=torch.float64)[0] / len(y))


def _state(net: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("target", ["wrapper", "module"])
def test_evaluate_scores_in_eval_mode_with_one_set_of_buffers_and_changes_nothing(comm, target):
    """After training on different batches per rank, ``evaluate`` of the DataParallel (or of the
    module it wraps) gives the accuracy of rank 0's model in eval mode scored in one process;
    every rank then holds rank 0's buffers, the parameters are unchanged, no test batch reached
    the running statistics, and every submodule is back in the mode it was in (mixed modes
    included)."""
    x_train, y_train, x_test, y_test = _digits()
    net = _bn_net()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), blocking=True)
    model = DataParallel(net, comm, optimizer=opt)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(3):
        idx = torch.randint(0, len(y_train), (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_train[idx] + 0.5 * comm.rank), y_train[idx]).backward()
        opt.step()
    net[3].eval()  # mixed modes: the Dropout already off, everything else training
    modes = [m.training for m in model.modules()]
    root = comm.handle.bcast(_state(net) if comm.rank == 0 else None, root=0)
    expected = _reference_accuracy(root, x_test, y_test)
    for _ in range(2):
        accuracy = recipes.evaluate(model if target == "wrapper" else net, x_test, y_test, comm)
        assert accuracy == expected, (accuracy, expected)
        assert [m.training for m in model.modules()] == modes
        after = _state(net)
        for name, value in root.items():  # rank 0's parameters and buffers, unchanged
            assert torch.equal(after[name], value), name
    # and training goes on as before
    model(x_train[:8]).sum().backward()
    model.close()


def test_evaluate_a_plain_module_in_training_mode_as_in_eval_mode(comm):
    """A module without a wrapper (identical on every rank), left in training mode: scored with
    its running statistics and without Dropout, and left in training mode."""
    _, _, x_test, y_test = _digits()
    net = _bn_net(1)
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    state = _state(net)
    assert recipes.evaluate(net, x_test, y_test, comm) == _reference_accuracy(state, x_test,
                                                                                y_test)
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def _bn_task() -> recipes.Task:
    return recipes.Task("digits-bn", _digits(), [64, 10], batch_size=16, lr=0.05, model=_bn_net)


def test_train_task_scores_a_batchnorm_model_as_one_model_in_eval_mode(comm):
    """``train_task`` with the ``allreduce`` runner: each evaluation scores the synchronized model
    in eval mode (the final accuracy is rank 0's model's in one process), no evaluation counts
    into the BatchNorm statistics (num_batches_tracked = training steps), and the model ends in
    training mode."""
    runners = []
    result = recipes.train_task("allreduce", comm, _bn_task(), epochs=2, curve=True,
                                on_runner=runners.append)
    net = runners[0].model.module
    assert all(m.training for m in runners[0].model.modules())
    assert int(net[1].num_batches_tracked) == len(result.step_times)
    root = comm.handle.bcast(_state(net) if comm.rank == 0 else None, root=0)
    for name, value in root.items():  # the last evaluation synchronized the buffers
        assert torch.equal(net.state_dict()[name], value), name
    expected = _reference_accuracy(root, *_digits()[2:])
    assert result.accuracy == expected == result.curve[-1].accuracy
    assert result.accuracy > 0.8
    runners[0].close()


def test_train_task_stops_at_the_target_without_a_curve(comm):
    """``target`` is checked after every epoch with ``curve=False`` too: reached after the first
    epoch, training stops there (the same steps, accuracy and parameters as a one-epoch run);
    never reached, every epoch runs."""
    task = recipes.digits_task(0, _digits())
    task.batch_size = 64  # fewer steps per epoch
    runs = {}
    for key, epochs, target in (("one", 1, None), ("reached", 3, 0.0), ("never", 2, 1.01)):
        runners = []
        result = recipes.train_task("allreduce", comm, task, epochs=epochs, curve=False,
                                    target=target, on_runner=runners.append)
        assert result.curve == []
        runs[key] = (result, [p.detach().clone() for p in runners[0].model.parameters()])
        runners[0].close()
    (one, one_params), (reached, reached_params) = runs["one"], runs["reached"]
    assert len(reached.step_times) == len(one.step_times) > 0
    assert reached.accuracy == one.accuracy
    assert all(torch.equal(a, b) for a, b in zip(reached_params, one_params))
    assert len(runs["never"][0].step_times) == 2 * len(one.step_times)


def test_train_task_splits_the_data_over_the_communicator_it_is_given(comm):
    """Each rank trains alone on a communicator of its own: every batch of the whole set (the
    data were split over the world, so each rank saw 1/P of them, and a call made by some
    ranks only hung in the loader's setup)."""
    import math

    alone = comm.Split(comm.rank)
    task = recipes.digits_task(0, _digits())
    task.batch_size = 128
    result = recipes.train_task("allreduce", alone, task, epochs=1, curve=False)
    assert len(result.step_times) == math.ceil(len(task.data[0]) / task.batch_size)
    alone.Free()


def test_daso_with_no_epochs_evaluates_the_untrained_model(comm):
    """(it built DASO with warmup_epochs=-1 and raised)"""
    task = recipes.digits_task(0, _digits())
    result = recipes.train_task("daso", comm, task, epochs=0, curve=False)
    assert result.step_times == [] and 0.0 <= result.accuracy <= 1.0


def test_the_average_of_differing_replicas_averages_their_batchnorm_statistics(comm):
    """Decentralized methods are scored with the ranks' average model: its BatchNorm running
    statistics too (before: each rank scored its shard with its own statistics)."""
    from heatlike.recipes import _averaged

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    net[1].running_mean.fill_(float(comm.rank))
    net[0].weight.data.add_(comm.rank)
    values = _averaged(net, comm)().values
    mean = (comm.size - 1) / 2
    assert torch.allclose(values["1.running_mean"], torch.full((3,), mean))
    assert torch.allclose(values["0.weight"], net[0].weight.detach() - comm.rank + mean)
    assert "1.num_batches_tracked" not in values  # an integer count: each rank's own

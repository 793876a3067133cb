"""SyncBatchNorm: batch normalization over every rank's batch together, over MPI.

torch's ``nn.SyncBatchNorm`` needs a ``torch.distributed`` process group; without one it silently
normalizes each rank's batch alone. heatlike's takes an MPI communicator (``process_group``: an
:class:`~heatlike.core.communication.MPICommunication`, an mpi4py communicator, or None for
heatlike's default communicator) and is otherwise torch's module: the same constructor, the same
parameters, buffers and ``state_dict`` as ``BatchNorm1d/2d/3d``, and
:meth:`SyncBatchNorm.convert_sync_batchnorm` to convert a model's batch norms.

Training forward (several ranks). With C channels, each rank computes per channel its element
count n_r (batch x spatial positions), mean m_r and sum of squared deviations M2_r; one
all-gather of (m_r, M2_r, n_r) in float64 gives every rank the statistics of the combined batch,
combined as in Chan, Golub and LeVeque's parallel variance (no cancellation of sums of squares):

    N = sum_r n_r,   mean = sum_r n_r m_r / N,   var = (sum_r M2_r + sum_r n_r (m_r - mean)^2) / N

    y = (x - mean) / sqrt(var + eps) * weight + bias

The running statistics move towards ``mean`` and the unbiased ``var * N / (N - 1)`` with torch's
momentum rule (``momentum=None``: the cumulative average), the same on every rank. So P ranks
with batches of b samples compute what one process computes with the combined batch of P*b.

Backward: per channel, ``sum_dy`` = sum(dy) and ``sum_dy_xmu`` = sum(dy (x - mean)) are summed
over every rank (one all-reduce of 2C values) and

    dx = (dy - sum_dy / N - (x - mean) invstd^2 sum_dy_xmu / N) * invstd * weight

with invstd = 1 / sqrt(var + eps) (torch's ``batch_norm_backward_elemt``). The gradients of
``weight`` (sum of dy * x_hat) and ``bias`` (sum of dy) are this rank's part only: the
data-parallel average makes them the combined batch's, like every other parameter's gradient.

Statistics are accumulated in float32 (float64 for float64 inputs); float16/bfloat16 inputs
give outputs of their own type. Evaluation (with running statistics, or with batch statistics
where there are none: torch's ``SyncBatchNorm`` does not synchronize them either, and a program
may evaluate on some ranks only) and a one-rank communicator normalize locally through
``torch.nn.functional.batch_norm``, exactly as ``BatchNorm`` does, with no communication. An
input a rank cannot normalize (fewer than 2 dimensions, another number of channels, not floating
point) raises on every rank: the ranks' verdicts travel in the all-gather. A combined batch of
one value per channel raises ``ValueError`` on every rank, as torch does for one process. A rank
may have an empty batch (its count is 0) while the others' are not. Every rank of the group must
be in the same mode (``train()`` or ``eval()``). A second derivative raises (``backward`` is
``once_differentiable``).
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..core.communication import MPICommunication, sanitize_comm

__all__ = ["SyncBatchNorm"]


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over an input of ``dims`` dimensions (N, C, ...)."""
    return t.view(1, -1, *([1] * (dims - 2)))


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _input_error(x: object, num_features: int, like: torch.Tensor | None) -> str | None:
    """Why this rank cannot normalize ``x`` (None if it can), ``like`` being a parameter or
    running statistic of the module: torch's rule, the same dtype and device, or a float16 or
    bfloat16 input to float32 parameters."""
    if not isinstance(x, torch.Tensor):
        return f"SyncBatchNorm expects a tensor, got {type(x).__name__}"
    if x.dim() < 2:
        return f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got " \
               f"{x.dim()}D input of shape {tuple(x.shape)}"
    if x.size(1) != num_features:
        return f"SyncBatchNorm has {num_features} channels, got an input of shape " \
               f"{tuple(x.shape)} (channels on dimension 1)"
    if not x.is_floating_point():
        return f"SyncBatchNorm normalizes floating-point inputs, got {x.dtype}"
    if like is not None and x.device != like.device:
        return f"SyncBatchNorm's parameters are on {like.device}, its input on {x.device}"
    if like is not None and x.dtype != like.dtype and not (
            x.dtype in (torch.float16, torch.bfloat16) and like.dtype == torch.float32):
        return f"SyncBatchNorm's parameters are {like.dtype}, its input {x.dtype} (a " \
               f"float16 or bfloat16 input to float32 parameters is the one mix allowed)"
    return None


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the mean and the sum of squared deviations of ``x`` (float64, on the host):
    the corrected two-pass algorithm. A first pass gives a shift (the mean in the accumulation
    dtype), the second the deviations d from it, and then mean = shift + sum(d) / n and
    M2 = sum(d^2) - sum(d)^2 / n, which corrects the shift's rounding: on 32x16x16x16 float32
    values of mean 1e3 and spread 1e-2 the mean came out exact and the variance within 1.2e-7
    (relative) of a float64 computation, against 1.4e-4 and 1.8e-4 without the correction, in
    91 us (float64 sums: 177 us; torch.var_mean over the batch and spatial dimensions: 600 us).
    """
    xa, dims = x.detach().to(_accumulation_dtype(x)), _reduced_dims(x)
    n = x.numel() // x.size(1)
    shift = xa.mean(dims)
    d = xa - _per_channel(shift, x.dim())
    s = d.sum(dims).double()
    m2 = d.square_().sum(dims).double()
    return (shift.double() + s / n).cpu(), (m2 - s * s / n).clamp_(min=0).cpu()


def global_statistics(x: torch.Tensor | None, num_features: int, comm: MPICommunication,
                      error: str | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Collective: the per-channel mean and biased variance (float64) and the element count per
    channel of every rank's ``x`` together (module docstring). A rank passing ``error`` (its
    input is unusable; ``x`` is then ignored) makes every rank raise ``ValueError`` naming it."""
    row = torch.zeros(2 * num_features + 2, dtype=torch.float64)
    if error is not None:
        row[-1] = 1.0
    else:
        n = x.numel() // num_features
        if n > 0:
            row[:num_features], row[num_features:2 * num_features] = _moments(x)
        row[-2] = n
    rows = torch.empty(comm.size, row.numel(), dtype=torch.float64)
    comm.Allgather(row, rows)
    bad = [r for r in range(comm.size) if rows[r, -1] != 0]
    if bad:
        raise ValueError(error if error is not None else
                         f"SyncBatchNorm: rank {bad[0]} got an input it cannot normalize "
                         f"(ranks {bad})")
    means, m2s, counts = rows[:, :num_features], rows[:, num_features:-2], rows[:, -2]
    total = int(counts.sum().item())
    if total <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got "
                         f"{total} over the {comm.size} ranks' inputs")
    mean = (counts[:, None] * means).sum(0) / total
    m2 = m2s.sum(0) + (counts[:, None] * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with the statistics of every rank's batch, and its
    backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, counter, eps, factor, comm):
        c = x.size(1)
        mean64, var64, total = global_statistics(x, c, comm)
        if running_mean is not None:  # training statistics move the running ones (torch's rule)
            running_mean.mul_(1 - factor).add_(mean64.to(running_mean), alpha=factor)
            running_var.mul_(1 - factor).add_((var64 * total / (total - 1)).to(running_var),
                                              alpha=factor)
        if counter is not None:  # counted with the running statistics' update, once agreed (a
            counter.add_(1)  # recomputation by torch.utils.checkpoint counts again, as torch's)
        ctx.bias_dtype = None if bias is None else bias.dtype
        acc = _accumulation_dtype(x)
        mean = mean64.to(device=x.device, dtype=acc)
        invstd = torch.rsqrt(var64 + eps).to(device=x.device, dtype=acc)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.comm = total, comm
        if x.dtype == acc:  # torch's fused kernel, the global statistics as "running" ones
            return torch.nn.functional.batch_norm(
                x, mean, var64.to(device=x.device, dtype=acc), weight, bias, False, 0.0, eps)
        scale = invstd if weight is None else invstd * weight.to(acc)
        y = (x.to(acc) - _per_channel(mean, x.dim())).mul_(_per_channel(scale, x.dim()))
        if bias is not None:
            y.add_(_per_channel(bias.to(acc), x.dim()))
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable  # the all-reduce and the statistics' dependence on x are not
    def backward(ctx, dy):  # differentiated: a second derivative raises instead of being wrong
        x, weight, mean, invstd = ctx.saved_tensors
        bias_dtype = ctx.bias_dtype
        acc, dims = mean.dtype, _reduced_dims(x)
        dy_acc = dy.to(acc)
        xmu = x.to(acc) - _per_channel(mean, x.dim())
        sum_dy = dy_acc.sum(dims)
        sum_dy_xmu = (dy_acc * xmu).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # the same graph on every rank: all enter the all-reduce
            sums = torch.cat([sum_dy, sum_dy_xmu])
            ctx.comm.Allreduce(MPI.IN_PLACE, sums, MPI.SUM)
            mean_dy, mean_dy_xmu = (sums / ctx.total).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = xmu.mul_(_per_channel(-invstd * invstd * mean_dy_xmu, x.dim()))
            grad_x.add_(dy_acc).sub_(_per_channel(mean_dy, x.dim()))
            grad_x = grad_x.mul_(_per_channel(scale, x.dim())).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the combined batch of every rank of ``process_group`` (module
    docstring): torch's ``nn.SyncBatchNorm`` signature and behaviour, over MPI.

    ``process_group``: an :class:`~heatlike.core.communication.MPICommunication`, an mpi4py
    communicator, or None (heatlike's default communicator, ``heatlike.MPI_WORLD`` unless
    ``heatlike.use_comm`` chose another), e.g. a node's communicator to normalize over the
    ranks of a node only."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: MPICommunication | MPI.Intracomm | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        sanitize_comm(process_group)  # TypeError for anything else
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _counts(self) -> bool:
        """Whether this forward counts a batch in ``num_batches_tracked`` (torch's rule)."""
        return self.training and self.track_running_stats and \
            self.num_batches_tracked is not None

    def _factor(self) -> float:
        """The weight of this batch in the running statistics (torch's ``_BatchNorm`` rule),
        with this batch counted."""
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(self.num_batches_tracked + 1) if self._counts() else 0.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        comm = sanitize_comm(self.process_group)
        training = self.training or (self.running_mean is None and self.running_var is None)
        # evaluation is local even with batch statistics (no running ones), as in torch: a
        # program may evaluate on some ranks only
        if not self.training or comm.size == 1:  # exactly torch's BatchNorm
            self._check_input_dim(input)
            track = not self.training or self.track_running_stats
            output = torch.nn.functional.batch_norm(
                input, self.running_mean if track else None,
                self.running_var if track else None, self.weight, self.bias, training,
                self._factor(), self.eps)
            if self._counts():  # after the batch went through (torch counts a failed one too)
                self.num_batches_tracked.add_(1)
            return output
        error = _input_error(input, self.num_features, self.weight if self.weight is not None
                             else self.running_mean)
        if error is not None:
            global_statistics(None, self.num_features, comm, error)  # raises on every rank
        track = self.track_running_stats and self.running_mean is not None
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if track else None,
            self.running_var if track else None,
            self.num_batches_tracked if self._counts() else None, self.eps, self._factor(), comm)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: MPICommunication | MPI.Intracomm | None = None
                               ) -> torch.nn.Module:
        """``module`` with every batch norm (``BatchNorm1d/2d/3d``, torch's ``SyncBatchNorm``)
        replaced by a heatlike :class:`SyncBatchNorm` over ``process_group`` holding the same
        parameter and buffer tensors (an optimizer built before keeps working) in the same
        training mode (torch's ``convert_sync_batchnorm``). Returns the converted module: a batch
        norm given directly is replaced, so use the return value."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted

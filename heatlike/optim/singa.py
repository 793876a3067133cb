"""SINGA's local optimizers and schedules in torch.

Most map onto torch directly (docs/algorithms.md, "DistOpt"):

=====================================================  =========================================
SINGA (``singa.opt``)                                  torch
=====================================================  =========================================
``SGD(lr, momentum, dampening, weight_decay,           ``torch.optim.SGD`` (identical for
nesterov)``                                            ``dampening=0``)
``Adam(lr, beta_1, beta_2, epsilon, weight_decay)``    ``torch.optim.Adam(lr, (beta_1, beta_2),
                                                       epsilon, weight_decay)``
``ExponentialDecay(init, decay_steps, rate,            ``StepLR(opt, decay_steps, rate)``
staircase=True)``
``ExponentialDecay(..., staircase=False)``             ``ExponentialLR(opt, rate ** (1 /
                                                       decay_steps))``
``Constant(v)``                                        a plain float
=====================================================  =========================================

RMSProp and AdaGrad put epsilon *inside* the square root in SINGA,
``p -= lr * g / sqrt(s + eps)``, where torch computes ``lr * g / (sqrt(s) + eps)``; the two
classes here implement SINGA's formulas (weight decay added to the gradient first) so ported
training reproduces SINGA's numbers.
"""

from __future__ import annotations

import torch

__all__ = ["RMSProp", "AdaGrad"]


class _EpsilonInsideSqrt(torch.optim.Optimizer):
    """``p <- p - lr g / sqrt(acc + epsilon)`` with ``acc`` updated by :meth:`_accumulate` and
    ``g`` including ``weight_decay * p`` (SINGA's placement of epsilon)."""

    state_name = ""

    def _accumulate(self, acc: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # the closure runs its own backward, as torch's optimizers allow
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + group["weight_decay"] * p if group["weight_decay"] else p.grad
                acc = self.state[p].setdefault(self.state_name, torch.zeros_like(p))
                self._accumulate(acc, g, group)
                p.addcdiv_(g, (acc + group["epsilon"]).sqrt(), value=-group["lr"])
        return loss


class RMSProp(_EpsilonInsideSqrt):
    """``s <- rho s + (1 - rho) g^2;  p <- p - lr g / sqrt(s + epsilon)`` (g includes
    ``weight_decay * p``)."""

    state_name = "running_average"

    def __init__(self, params, lr: float = 0.1, rho: float = 0.9, epsilon: float = 1e-8,
                 weight_decay: float = 0) -> None:
        if lr < 0 or not 0 <= rho <= 1 or epsilon < 0 or weight_decay < 0:
            raise ValueError("need lr >= 0, 0 <= rho <= 1, epsilon >= 0, weight_decay >= 0")
        super().__init__(params, {"lr": lr, "rho": rho, "epsilon": epsilon,
                                  "weight_decay": weight_decay})

    def _accumulate(self, acc, g, group):
        acc.mul_(group["rho"]).addcmul_(g, g, value=1 - group["rho"])


class AdaGrad(_EpsilonInsideSqrt):
    """``h <- h + g^2;  p <- p - lr g / sqrt(h + epsilon)`` (g includes ``weight_decay * p``)."""

    state_name = "history"

    def __init__(self, params, lr: float = 0.1, epsilon: float = 1e-8,
                 weight_decay: float = 0) -> None:
        if lr < 0 or epsilon < 0 or weight_decay < 0:
            raise ValueError("need lr >= 0, epsilon >= 0, weight_decay >= 0")
        super().__init__(params, {"lr": lr, "epsilon": epsilon, "weight_decay": weight_decay})

    def _accumulate(self, acc, g, group):
        acc.addcmul_(g, g)

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


class RMSProp(torch.optim.Optimizer):
    """``s <- rho s + (1 - rho) g^2;  p <- p - lr g / sqrt(s + epsilon)`` (g includes
    ``weight_decay * p``)."""

    def __init__(self, params, lr: float = 0.1, rho: float = 0.9, epsilon: float = 1e-8,
                 weight_decay: float = 0) -> None:
        if lr < 0 or not 0 <= rho <= 1 or epsilon < 0 or weight_decay < 0:
            raise ValueError("need lr >= 0, 0 <= rho <= 1, epsilon >= 0, weight_decay >= 0")
        super().__init__(params, {"lr": lr, "rho": rho, "epsilon": epsilon,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + group["weight_decay"] * p if group["weight_decay"] else p.grad
                s = self.state[p].setdefault("running_average", torch.zeros_like(p))
                s.mul_(group["rho"]).addcmul_(g, g, value=1 - group["rho"])
                p.addcdiv_(g, (s + group["epsilon"]).sqrt(), value=-group["lr"])
        return loss


class AdaGrad(torch.optim.Optimizer):
    """``h <- h + g^2;  p <- p - lr g / sqrt(h + epsilon)`` (g includes ``weight_decay * p``)."""

    def __init__(self, params, lr: float = 0.1, epsilon: float = 1e-8,
                 weight_decay: float = 0) -> None:
        if lr < 0 or epsilon < 0 or weight_decay < 0:
            raise ValueError("need lr >= 0, epsilon >= 0, weight_decay >= 0")
        super().__init__(params, {"lr": lr, "epsilon": epsilon, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + group["weight_decay"] * p if group["weight_decay"] else p.grad
                h = self.state[p].setdefault("history", torch.zeros_like(p))
                h.addcmul_(g, g)
                p.addcdiv_(g, (h + group["epsilon"]).sqrt(), value=-group["lr"])
        return loss

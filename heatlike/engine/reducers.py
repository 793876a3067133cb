"""Reducers: how payloads are combined across ranks.

:class:`AllReduce` combines every rank's payload with one non-blocking all-reduce:

* ``op="avg"`` (default): sum, then divide by the number of ranks P (``divide_before=True``
  divides each contribution by P first: float16 overflow safety);
* ``op="custom_avg"``: sum, then divide by ``denom`` (mlbench's ``average_custom``);
* ``op="sum"``, ``"min"``, ``"max"``: the plain reduction.

The engine calls ``prepare(buffer)`` on the float buffer before the codec encodes it (division
before the sum), ``start(payload)`` to begin the reduction of the encoded payload in place (returns
the request), and ``finish(buffer)`` on the decoded buffer once it has completed (division after
the sum): divisions happen in the buffer's own precision, never in a narrow wire type.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..core.communication import IN_PLACE, MPICommunication, Request, sanitize_comm

__all__ = ["Reducer", "AllReduce"]

_OPS = {"avg": MPI.SUM, "custom_avg": MPI.SUM, "sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


class Reducer:
    """Base class: ``prepare(buffer)``, ``start(payload) -> Request``, ``finish(buffer)``."""

    comm: MPICommunication

    def prepare(self, buffer: torch.Tensor) -> None:
        """Before encoding (default: nothing)."""

    def start(self, payload: torch.Tensor) -> Request:
        raise NotImplementedError

    def finish(self, buffer: torch.Tensor) -> None:
        """After decoding (default: nothing)."""


class AllReduce(Reducer):
    """One all-reduce per payload over ``comm`` (see the module docstring for ``op``)."""

    def __init__(self, comm: MPICommunication | None = None, op: str = "avg",
                 divide_before: bool = False, denom: float | None = None) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if op == "custom_avg" and (denom is None or denom <= 0):
            raise ValueError("op='custom_avg' needs a positive denom")
        if divide_before and op not in ("avg", "custom_avg"):
            raise ValueError("divide_before only applies to op='avg' or 'custom_avg'")
        self.comm = sanitize_comm(comm)
        self.op = op
        self.divide_before = divide_before
        self.denom = float(self.comm.size if op == "avg" else denom or 1.0)

    @property
    def _divides(self) -> bool:
        return self.op in ("avg", "custom_avg")

    def prepare(self, buffer: torch.Tensor) -> None:
        if self._divides and self.divide_before:
            buffer.div_(self.denom)

    def start(self, payload: torch.Tensor) -> Request:
        return self.comm.Iallreduce(IN_PLACE, payload, _OPS[self.op])

    def finish(self, buffer: torch.Tensor) -> None:
        if self._divides and not self.divide_before:
            buffer.div_(self.denom)

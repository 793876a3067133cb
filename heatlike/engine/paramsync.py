"""Averaging parameters (rather than gradients) through the engine.

:class:`ParameterSync` packs a list of tensors (model parameters, floating-point buffers) into
buckets, runs every bucket's exchange (codec and reducer, all buckets in flight at once) and
writes the result back: the average over ranks with :class:`~heatlike.engine.AllReduce`, the
neighbor mix with :class:`~heatlike.engine.Gossip`. Used for mlbench's ``agg_grad=False`` mode
(local step, then average the weights) and for decentralized SGD.

A lossless codec (:class:`~heatlike.engine.Identity`, a cast to float32) exchanges the values
themselves. A lossy codec (a cast to bfloat16 / float16, sparsifiers, PowerSGD, signs) never
compresses the weights: it would round every weight to bfloat16 at every step, so that updates
smaller than a bfloat16 step are lost, or zero the weights a sparsifier does not send. It
compresses the change since the last synchronization instead:

* averaging (an all-reduce reducer with ``op="avg"``): with ``x_ref`` the weights after the last
  synchronization, the same on every rank,

      x <- x_ref + (1/P) sum_r C(x_r - x_ref),    x_ref <- x

  (C: the codec, error feedback included; with a lossless C this is the plain average). Every
  rank ends with the same ``x``. ``x_ref`` is kept at the tensors' precision, so a weight
  moves by any amount, however small.
* gossip, with a cast codec (bfloat16, float16): CHOCO-gossip with step 1 (Koloskova et al.
  2019). Rank i keeps its public copy ``h_i`` (what its neighbors know of its weights) and
  ``y_i = sum_j W_ij h_j`` (``W_ii`` included), both at full precision; each step

      q_i = cast(x_i - h_i)  (sent to the neighbors),  h_i <- h_i + q_i,
      y_i <- y_i + W_ii q_i + sum_j W_ij q_j,          x_i <- x_i + y_i - h_i

  so that ``x_i`` becomes ``sum_j W_ij x_j`` up to ``e_i - sum_j W_ij e_j``, with ``e`` the
  rounding errors of the last changes (not of the weights); this rank's own term stays at full
  precision and the ranks' mean is kept (W is doubly stochastic). Other lossy codecs are refused
  for gossip (ValueError): their rounding of a neighbor's change cannot be reproduced by the
  rank that sent it.
* any other reduction (a sum, min, max, or a custom denominator) with a lossy codec: ValueError.

The first synchronization, which has no ``x_ref`` (no ``h``, ``y``) yet, exchanges the values
exactly (uncompressed), and sets them. That state (:meth:`ParameterSync.state_dict`) is saved
and loaded with the optimizer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.agreement import agree_on
from ..core.communication import MPICommunication, sanitize_comm, wait_all
from .buckets import pack, plan_buckets, unpack
from .codecs import Cast, Codec, Identity
from .exchange import Context, Lane
from .reducers import AllReduce, Reducer

__all__ = ["ParameterSync", "lossless", "weights_codec_error"]

MiB = 1 << 20


def lossless(codec: Codec | None) -> bool:
    """Whether ``codec`` delivers the values exactly: none, :class:`Identity`, or a
    :class:`Cast` to float32."""
    return codec is None or type(codec) is Identity or \
        (type(codec) is Cast and codec.dtype is torch.float32)


def weights_codec_error(codec: Codec | None, mixes: bool) -> ValueError | None:
    """Why ``codec`` cannot synchronize weights (module docstring), or None: with gossip
    (``mixes``), lossless codecs and casts to bfloat16 / float16 only."""
    if lossless(codec) or not mixes or type(codec) is Cast:
        return None
    return ValueError(
        f"gossip mixes the ranks' models: codec={codec!r} cannot be used there (a neighbor's "
        "change compressed by it cannot be reproduced by the rank that sent it); use a cast "
        "(codec='bf16' or 'fp16', sent as changes since the last mix) or no codec")


def _averages(reducer: Reducer) -> bool:
    return isinstance(reducer, AllReduce) and reducer.op == "avg"


class ParameterSync:
    """Replace ``tensors`` by their average (or mix) over ranks, bucket by bucket (lossy codecs
    exchange the change since the last synchronization: module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor], comm: MPICommunication | None = None,
                 codec: Codec | None = None, reducer: Reducer | None = None,
                 bucket_cap_mb: float = 25.0, seed: int = 0,
                 cap_numel: int | None = None) -> None:
        self.comm = sanitize_comm(comm)
        self.tensors = [t for t in tensors]
        cap = max(1, int(bucket_cap_mb * MiB) if cap_numel is None else cap_numel)
        agree_on({"tensors": [(tuple(t.shape), str(t.dtype)) for t in self.tensors],
                  "bucket cap": (cap, cap_numel is not None), "codec": repr(codec),
                  "seed": seed}, self.comm, "the parameter synchronization")
        self.reducer = reducer if reducer is not None else AllReduce(self.comm)
        mixes = bool(getattr(self.reducer, "mixes", False))
        error = weights_codec_error(codec, mixes)
        if error is not None:  # the codec is the same on every rank (agreed above)
            raise error
        self.buckets = plan_buckets(self.tensors, cap, cap, flags=False,
                                    per_element=cap_numel is not None)
        self.codec = codec if codec is not None else Identity()
        self.seed = seed
        self._steps = 0
        # how a lossy codec travels: "delta" (averaging) or "choco" (gossip); None: the values
        self.scheme = None if lossless(codec) else "choco" if mixes else "delta"
        # the first synchronization with a lossy codec, exact; also the lane of CHOCO's state
        self._exact = Lane(Identity(), self.reducer) if self.scheme else None
        self.lane = self._exact if self.scheme == "choco" else Lane(self.codec, self.reducer)
        # bucket -> {"reference": x_ref} ("delta"), {"public": h, "mixed": y} ("choco")
        self.memory: dict[int, dict[str, torch.Tensor]] = {}
        self.closed = False

    @property
    def bytes_sent(self) -> int:
        return self.reducer.bytes_sent

    @torch.no_grad()
    def synchronize(self, buckets: Sequence[int] | None = None) -> None:
        """Collective: average (mix) the tensors in place (only those of ``buckets``, if
        given)."""
        if self.closed:
            raise RuntimeError("this parameter synchronization was closed (close()): its "
                               "optimizer no longer synchronizes; build a new one")
        if self.scheme == "delta" and not _averages(self.reducer):
            raise ValueError(
                f"weights sent through the lossy codec {self.codec!r} are averaged as changes "
                "since the last synchronization: the reduction must be the average over the "
                f"ranks (op='avg'), got op={getattr(self.reducer, 'op', None)!r}")
        chosen = self.buckets if buckets is None else [self.buckets[b] for b in buckets]
        requests, first, mixing = [], [], []
        for bucket in chosen:
            data = [t.data for t in bucket.params]
            pack(data, bucket.buffer)
            ctx = Context(key=("param", bucket.index), shapes=[t.shape for t in data],
                          size=self.comm.size, rank=self.comm.rank, step=self._steps,
                          seed=self.seed, state=self.codec.state_for(("param", bucket.index)))
            memory = self.memory.get(bucket.index)
            if self.scheme is None:
                requests.append(self.lane.start(bucket.values, ctx))
            elif memory is None:  # no reference yet: exact, then kept
                if self.scheme == "choco":
                    self.memory[bucket.index] = {"public": _full(bucket.values)}
                first.append(bucket)
                requests.append(self._exact.start(bucket.values, ctx))
            elif self.scheme == "delta":
                bucket.values.sub_(memory["reference"])
                requests.append(self.lane.start(bucket.values, ctx))
            else:
                mixing.append((bucket, self._start_mix(bucket, memory)))
        wait_all(requests + [request for _, (request, _, _) in mixing])
        for bucket in chosen:
            memory = self.memory.get(bucket.index)
            if self.scheme == "delta":
                if bucket in first:
                    self.memory[bucket.index] = {"reference": bucket.values.clone()}
                else:  # x = x_ref + the average change, the same on every rank
                    memory["reference"].add_(bucket.values)
                    unpack(memory["reference"], [t.data for t in bucket.params])
                    continue
            elif self.scheme == "choco":
                if bucket not in first:
                    continue  # written by _finish_mix
                memory["mixed"] = _full(bucket.values)
            unpack(bucket.buffer, [t.data for t in bucket.params])
        for bucket, (_, q, received) in mixing:
            self._finish_mix(bucket, self.memory[bucket.index], q, received)
        self._steps += 1

    def _start_mix(self, bucket, memory: dict):
        """CHOCO's exchange of one bucket (module docstring): ``q = cast(x - h)`` to the
        neighbors; returns (request, q at full precision, what the neighbors send)."""
        gossip = self.reducer
        public = memory["public"]
        change = torch.sub(bucket.values.to(public.dtype), public)  # the buffer keeps x
        wire = change.to(self.codec.dtype)
        received = torch.empty(len(gossip.graph.neighbors) * wire.numel(), dtype=wire.dtype,
                               device=wire.device)
        return gossip.exchange(wire, received), change.copy_(wire), received

    def _finish_mix(self, bucket, memory: dict, q: torch.Tensor,
                    received: torch.Tensor) -> None:
        """``h += q; y += W_ii q + sum_j W_ij q_j; x += y - h``."""
        public, mixed = memory["public"], memory["mixed"]
        mixed.add_(q, alpha=self.reducer.graph.self_weight)
        self.reducer.add_neighbors(mixed, received)
        public.add_(q)
        x = bucket.values.to(mixed.dtype).add_(mixed).sub_(public)
        unpack(x, [t.data for t in bucket.params])

    def close(self) -> None:
        """Collective: free the private channel's communicators (unusable afterwards)."""
        self.lane.close()
        if self._exact is not None and self._exact is not self.lane:
            self._exact.close()
        self.closed = True

    def state_dict(self) -> dict:
        """The exchange counter (seeds of randomized codecs), the codec's state and, with a
        lossy codec, each bucket's reference weights (CHOCO: public copy and mix)."""
        return {"steps": self._steps, "codec": self.codec.state_dict(),
                "memory": {b: {k: v.clone() for k, v in m.items()}
                           for b, m in self.memory.items()}}

    def load_state_dict(self, state: dict) -> None:
        memory = {}
        for b, saved in dict(state.get("memory", {})).items():
            b = int(b)
            if not 0 <= b < len(self.buckets) or any(
                    v.numel() != self.buckets[b].size for v in saved.values()):
                raise ValueError(f"the saved reference weights of bucket {b} do not match "
                                 "this parameter synchronization's buckets")
            memory[b] = {k: v.clone() for k, v in saved.items()}
        self._steps = int(state["steps"])
        self.codec.load_state_dict(state["codec"])
        self.memory = memory


def _full(values: torch.Tensor) -> torch.Tensor:
    """A copy of ``values`` at full precision (float32 for half types)."""
    dtype = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else values.dtype
    return values.to(dtype, copy=True)

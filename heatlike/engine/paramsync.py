"""Averaging parameters (rather than gradients) through the engine.

:class:`ParameterSync` packs a list of tensors (model parameters, floating-point buffers) into
buckets, runs every bucket's exchange (codec and reducer, all buckets in flight at once) and
writes the result back: the average over ranks with :class:`~heatlike.engine.AllReduce`, the
neighbor mix with :class:`~heatlike.engine.Gossip`. Used for mlbench's ``agg_grad=False`` mode
(local step, then average the weights) and for decentralized SGD.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.agreement import agree_on
from ..core.communication import MPICommunication, sanitize_comm, wait_all
from .buckets import pack, plan_buckets, unpack
from .codecs import Codec, Identity
from .exchange import Context, Lane
from .reducers import AllReduce, Reducer

__all__ = ["ParameterSync"]

MiB = 1 << 20


class ParameterSync:
    """Replace ``tensors`` by their average (or mix) over ranks, bucket by bucket."""

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
        self.buckets = plan_buckets(self.tensors, cap, cap, flags=False,
                                    per_element=cap_numel is not None)
        self.codec = codec if codec is not None else Identity()
        self.reducer = reducer if reducer is not None else AllReduce(self.comm)
        self.seed = seed
        self._steps = 0
        self.lane = Lane(self.codec, self.reducer)
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
        chosen = self.buckets if buckets is None else [self.buckets[b] for b in buckets]
        requests = []
        for bucket in chosen:
            data = [t.data for t in bucket.params]
            pack(data, bucket.buffer)
            ctx = Context(key=("param", bucket.index), shapes=[t.shape for t in data],
                          size=self.comm.size, rank=self.comm.rank, step=self._steps,
                          seed=self.seed, state=self.codec.state_for(("param", bucket.index)))
            requests.append(self.lane.start(bucket.values, ctx))
        wait_all(requests)
        for bucket in chosen:
            unpack(bucket.buffer, [t.data for t in bucket.params])
        self._steps += 1

    def close(self) -> None:
        """Collective: free the private channel's communicators (unusable afterwards)."""
        self.lane.close()
        self.closed = True

    def state_dict(self) -> dict:
        """The exchange counter (seeds of randomized codecs) and the codec's state."""
        return {"steps": self._steps, "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._steps = int(state["steps"])
        self.codec.load_state_dict(state["codec"])

"""Codecs: what a bucket looks like on the wire.

A codec turns a bucket's flat float buffer into the payload that is communicated and back. A
*linear* codec's payloads can be summed by an all-reduce (sum of encodings = encoding of the sum,
up to rounding); the others need an all-gather (added with the compression optimizers).

* :class:`Identity`: the buffer itself, no copy.
* :class:`Cast`: the buffer in a narrower float type (bfloat16 / float16) on the wire. Sums are
  still accumulated in float32 by the communication layer, so the only error is the one rounding
  of each rank's contribution to the narrow type (and of the result). For float16, let the
  reducer divide before the sum (``divide_before``) if values may overflow.
"""

from __future__ import annotations

import torch

__all__ = ["Codec", "Identity", "Cast"]


class Codec:
    """Base class. ``encode`` returns the payload to reduce (it may be the buffer itself);
    ``decode`` writes the reduced payload back into the buffer."""

    linear = True
    name = "codec"

    def encode(self, buffer: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        """Bytes one rank contributes for a buffer of ``numel`` float32 elements."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{self.name} has no state, got keys {sorted(state)}")


class Identity(Codec):
    """Send the buffer as it is."""

    name = "identity"

    def encode(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer

    def decode(self, payload: torch.Tensor, buffer: torch.Tensor) -> None:
        if payload.data_ptr() != buffer.data_ptr():
            buffer.copy_(payload)

    def wire_bytes(self, numel: int) -> int:
        return numel * 4


class Cast(Codec):
    """Send the buffer as ``dtype`` (torch.bfloat16, torch.float16 or torch.float32)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"Cast supports bfloat16, float16 and float32, got {dtype}")
        self.dtype = dtype
        self.name = f"cast-{str(dtype).removeprefix('torch.')}"

    def encode(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.to(self.dtype)

    def decode(self, payload: torch.Tensor, buffer: torch.Tensor) -> None:
        buffer.copy_(payload)

    def wire_bytes(self, numel: int) -> int:
        return numel * torch.empty((), dtype=self.dtype).element_size()

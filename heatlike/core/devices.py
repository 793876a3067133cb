"""Where a DNDarray's local tensors live: ``"cpu"`` or ``"gpu"``.

``"gpu"`` means the current CUDA device of each process (``torch.cuda.current_device()``; select
it per rank, e.g. from the local rank, before creating arrays). The default for factories is
``"cpu"``; :func:`use_device` changes it.
"""

from __future__ import annotations

import torch

__all__ = ["sanitize_device", "torch_device", "device_name", "use_device", "get_device"]

_default = "cpu"


def sanitize_device(device: object = None) -> str:
    """``"cpu"`` or ``"gpu"`` for ``device`` (None: the default; ``"cuda"``, ``"cuda:0"`` and
    ``torch.device`` objects are understood). ``ValueError`` for unknown names or a GPU request
    without CUDA."""
    if device is None:
        return _default
    if isinstance(device, torch.device):
        device = device.type
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'gpu', got {type(device).__name__}")
    name = device.lower().split(":", 1)[0]
    if name == "cpu":
        return "cpu"
    if name in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError("device 'gpu' requested but CUDA is not available")
        return "gpu"
    raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def torch_device(name: str) -> torch.device:
    """The torch device of a heatlike device name on this process."""
    if name == "gpu":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(t: torch.Tensor) -> str:
    """``"gpu"`` for a CUDA tensor, else ``"cpu"``."""
    return "gpu" if t.is_cuda else "cpu"


def use_device(device: object = None) -> None:
    """Make ``device`` the default of the factories (None: back to ``"cpu"``)."""
    global _default
    _default = "cpu" if device is None else sanitize_device(device)


def get_device() -> str:
    """The factories' default device."""
    return _default

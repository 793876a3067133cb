"""Where a DNDarray's local tensors live: ``cpu`` or ``gpu`` (Heat's ``heat.core.devices``).

A :class:`Device` is a string (``"cpu"`` or ``"gpu"``) with Heat's attributes ``device_type``,
``device_id`` and ``torch_device``, so ``x.device == "cpu"``, ``x.device == heatlike.cpu`` and
``x.device.torch_device`` all work. ``heatlike.cpu`` always exists; ``heatlike.gpu`` exists only
when CUDA is available (as in Heat, ``hasattr(heatlike, "gpu")`` tells whether it is). ``gpu``
means the current CUDA device of each process (``torch.cuda.current_device()``; select it per
rank, e.g. from the local rank, before creating arrays). The default for factories is ``cpu``;
:func:`use_device` changes it.
"""

from __future__ import annotations

import torch

__all__ = ["Device", "cpu", "sanitize_device", "torch_device", "device_name", "use_device",
           "get_device"]


class Device(str):
    """A device name (``"cpu"`` or ``"gpu"``) with Heat's attributes.

    ``Device("cpu")`` or Heat's ``Device(device_type, device_id, torch_device)``.
    """

    def __new__(cls, device_type: str, device_id: int = 0, torch_device: str | None = None
                ) -> Device:
        if device_type not in ("cpu", "gpu"):
            raise ValueError(f"device_type must be 'cpu' or 'gpu', got {device_type!r}")
        obj = super().__new__(cls, device_type)
        obj._id = int(device_id)
        obj._torch = torch_device
        return obj

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"gpu"``."""
        return str.__str__(self)

    @property
    def device_id(self) -> int:
        """The CUDA device index for ``gpu`` (this process's current one), 0 for ``cpu``."""
        if self.device_type == "gpu" and self._torch is None and torch.cuda.is_available():
            return torch.cuda.current_device()
        return self._id

    @property
    def torch_device(self) -> str:
        """The torch device string: ``"cpu"`` or ``"cuda:<index>"``."""
        if self._torch is not None:
            return self._torch
        return "cpu" if self.device_type == "cpu" else f"cuda:{self.device_id}"

    def __repr__(self) -> str:
        return f"device({self.device_type}:{self.device_id})"

    def __reduce__(self):
        return (Device, (self.device_type, self._id, self._torch))


cpu = Device("cpu")
_gpu: Device | None = None
if torch.cuda.is_available():
    gpu = _gpu = Device("gpu")
    __all__.append("gpu")

_default: Device = cpu


def sanitize_device(device: object = None) -> Device:
    """The :class:`Device` for ``device`` (None: the default; ``"cpu"``, ``"gpu"``, ``"cuda"``,
    ``"cuda:0"``, ``torch.device`` objects and Devices are understood). ``ValueError`` for unknown
    names or a GPU request without CUDA; ``TypeError`` for other types."""
    if device is None:
        return _default
    if isinstance(device, torch.device):
        device = device.type
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'gpu', got {type(device).__name__}")
    name = str.__str__(device).lower().split(":", 1)[0]
    if name == "cpu":
        return cpu
    if name in ("gpu", "cuda"):
        if _gpu is None:
            raise ValueError("device 'gpu' requested but CUDA is not available")
        return _gpu
    raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def torch_device(name: str) -> torch.device:
    """The torch device of a heatlike device name on this process."""
    if name == "gpu":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(t: torch.Tensor) -> Device:
    """``gpu`` for a CUDA tensor, else ``cpu``."""
    if t.is_cuda:
        return _gpu if _gpu is not None else Device("gpu")
    return cpu


def use_device(device: object = None) -> None:
    """Make ``device`` the default of the factories (None: back to ``cpu``)."""
    global _default
    _default = cpu if device is None else sanitize_device(device)


def get_device() -> Device:
    """The factories' default device."""
    return _default

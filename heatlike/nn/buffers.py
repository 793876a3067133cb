"""A module's buffers without walking the module at every call.

``module.buffers()`` walks every submodule: about 80 us for a model of 150 layers without
buffers and 160 us with a BatchNorm after each of 50 convolutions (this machine), which
DataParallel paid before every training forward to synchronize the buffers. :class:`ModuleBuffers`
keeps where the walk found them (submodule, name) and reads each buffer from its submodule at
every call, so a buffer replaced by ``module.to()``, ``half()`` or an assignment is the current
one. It walks again after any buffer or submodule is registered anywhere in the process (torch's
global registration hooks: ``register_buffer``, ``add_module`` and assignments of tensors to
buffer names or of modules). A buffer deleted with ``del`` is left out. Changes of the module's
structure that call no hook (a submodule deleted, ``del model.block``, ``del seq[2]``; inserted,
``nn.Sequential.insert``, ``nn.ModuleList.insert``; or any other write to a ``_modules`` table)
are found by every call: it compares each walked module's table of submodules with the walk's
(the tables' total size, and the submodules, by identity, of each table that had any) and walks
again when one changed. The check took 1 us for 50 layers in one ``nn.Sequential``, 2.4 us for
150, and 6-10 us for 50 blocks of a convolution and a BatchNorm (151 modules, 51 tables with
submodules) on a loaded 2-core machine, against 0.15, 0.15 and 3 us for the check of the links
down to the buffers' modules it replaces (which missed insertions).
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
)

__all__ = ["ModuleBuffers"]

_generation = [0]  # how many buffers and submodules were registered in this process


def _registered(*_args) -> None:
    _generation[0] += 1  # returns None: the registration itself is left as it is


register_module_buffer_registration_hook(_registered)
register_module_module_registration_hook(_registered)


class ModuleBuffers:
    """``ModuleBuffers(module)()`` is ``list(module.buffers())``: the same tensors in the same
    order (shared submodules and buffers once), found without a walk while no buffer or
    submodule has been registered since the last call and the module's structure (the
    submodules of every module the walk reached) is the walk's."""

    __slots__ = ("module", "_seen", "_places", "_tables", "_size", "_parents", "_children")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._seen = -1
        self._places: list[tuple[torch.nn.Module, str]] = []
        self._tables: list[dict] = []  # every walked module's _modules
        self._size = 0  # their total size
        self._parents: list[dict] = []  # those of them that held submodules
        self._children: list[list] = []  # what each of those held (the submodules, or None)

    def _walk(self) -> None:
        """Where the buffers are, and the structure of the module."""
        modules = list(self.module.modules())
        self._places = [(m, name) for m in modules for name in m._buffers]
        self._tables = [m._modules for m in modules]
        self._size = sum(map(len, self._tables))
        self._parents = [table for table in self._tables if table]
        self._children = list(map(list, map(dict.values, self._parents)))

    def _restructured(self) -> bool:
        """Whether a submodule was deleted, replaced or inserted anywhere the walk reached,
        hook or not. A table empty at the walk that gained a submodule changes the total size,
        unless another lost one at the same time, whose list of submodules then differs."""
        return sum(map(len, self._tables)) != self._size or \
            list(map(list, map(dict.values, self._parents))) != self._children

    def __call__(self) -> list[torch.Tensor]:
        if self._seen != _generation[0] or self._restructured():
            self._seen = _generation[0]
            self._walk()
        found, ids = [], set()
        for m, name in self._places:
            b = m._buffers.get(name)
            if b is not None and id(b) not in ids:
                ids.add(id(b))
                found.append(b)
        return found

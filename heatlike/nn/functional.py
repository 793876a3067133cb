"""``heatlike.nn.functional``: Heat's ``heat.nn.functional``, which is ``torch.nn.functional``.

Every name is looked up in ``torch.nn.functional`` (``heatlike.nn.functional.relu is
torch.nn.functional.relu``), so model code written as ``import heat.nn.functional as F`` runs
unchanged. A name torch does not have raises ``AttributeError``.
"""

from __future__ import annotations

import torch.nn.functional as _torch_functional

from .._forwarding import forward_to

__getattr__, __dir__ = forward_to(__name__, globals(), _torch_functional)

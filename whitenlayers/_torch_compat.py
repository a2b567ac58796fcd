"""What torch offers differently across the versions the package supports, used on both sides of a fold (the fold and
coordinator, the layers' forwards): autocast's state and a way to leave it. Imports nothing of the package."""
from __future__ import annotations

import contextlib
from typing import Callable, cast

import torch

__all__ = ["autocast_enabled", "no_autocast"]


def no_autocast(device: torch.device):
    """Statistics and transforms are computed in their own dtype, never in autocast's lower precision."""
    return torch.autocast(device_type=device.type, enabled=False)


def _autocast_enabled_any(device_type: str) -> bool:
    """:data:`autocast_enabled` for a torch < 2.4, whose ``torch.is_autocast_enabled`` takes no device type."""
    return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


#: Whether autocast is on for a device type (a test before entering :func:`no_autocast` on a hot path): torch's own
#: function, one C call, where it takes the device type (torch 2.4 and later).
autocast_enabled: Callable[[str], bool] = _autocast_enabled_any
with contextlib.suppress(TypeError):  # (torch < 2.4: a TypeError)
    torch.is_autocast_enabled("cpu")
    autocast_enabled = cast(Callable[[str], bool], torch.is_autocast_enabled)

"""What the torch under test has, for the tests of features that need more than the package's floor (torch 2.4,
``setup.cfg``): each a skip mark naming the feature and the torch it needs (``.ci/run`` runs the suite on the floor
and on the newest torch too)."""
import pytest
import torch
from torch.torch_version import TorchVersion

VERSION = TorchVersion(torch.__version__)


def needs(version: tuple, feature: str) -> pytest.MarkDecorator:
    """Skip where torch is older than ``version``, naming ``feature``."""
    return pytest.mark.skipif(VERSION < version, reason=f"{feature} needs torch >= {'.'.join(map(str, version))}, "
                                                        f"this is torch {torch.__version__}")


#: Selective activation checkpointing (``torch.utils.checkpoint.CheckpointPolicy``).
SELECTIVE_CHECKPOINTING = needs((2, 5), "selective activation checkpointing (CheckpointPolicy)")


def recompile_limit(n: int):
    """``torch._dynamo.config.patch`` of dynamo's recompile limit (``recompile_limit``; ``cache_size_limit`` before
    torch 2.7)."""
    import torch._dynamo

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    return torch._dynamo.config.patch(**{name: n})

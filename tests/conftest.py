"""Test-suite configuration: deterministic hypothesis runs by default.

The default profile ``deterministic`` derandomizes hypothesis (the same examples
on every run and machine, so CI is reproducible); ``HYPOTHESIS_PROFILE=explore``
draws fresh random examples for a local bug hunt::

    HYPOTHESIS_PROFILE=explore python -m pytest -q tests/test_robustness.py
"""
import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    # Under pytest-xdist (-n N) the cores are shared by N workers: each takes its share of torch threads, and the
    # processes the tests start (torchrun, the coverage self-test) inherit it. N workers with a thread per core
    # each would oversubscribe the CPU, where OpenMP threads that wait for each other slow every step down.
    import torch

    _threads = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

if os.environ.get("WHITENLAYERS_TEST_FUSED") == "1":
    # CUDA's fewest-kernel paths emulated on the CPU for the whole suite (functional.fused_moments): a local check
    # of the GPU's code paths for sessions without a GPU, not a CI configuration.
    from whitenlayers.functional import batch as _batch

    _batch._fused_on_cpu = True


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny tensors (``pytestmark = pytest.mark.usefixtures("single_thread")``):
    much faster than two on a shared 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


#: Modules whose module-scoped fixture is expensive (a distributed run, the op counts of every variant): under
#: ``-n N`` each runs whole on one worker, so its fixture is computed once, not on each worker that draws one of its
#: tests. Every other test is dealt out one at a time, as ``--dist load`` does.
ONE_WORKER_MODULES = ("tests/test_hot_path.py", "tests/test_distributed.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The default ``--dist load``, but with each module of ``ONE_WORKER_MODULES`` one unit of work (a test's
    ``xdist_group`` mark would do this under ``--dist loadgroup``, which the README's command does not pass)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModulesOnOneWorker(config, log)


def pytest_sessionfinish(session):
    """The forkserver of ``dist_utils.run_distributed``, if a test started one, stops with the session."""
    if "dist_utils" in sys.modules:
        sys.modules["dist_utils"].stop_forkserver()

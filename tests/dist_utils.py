"""Run a function on several local ``gloo`` (or ``nccl``) processes (in the style of kfac-pytorch's test helpers).

``run_distributed(fn, *args, world_size=2)`` starts ``world_size`` processes with
``torch.multiprocessing``, initialises a ``gloo`` process group in each (a
file-based rendezvous in a temporary directory, so there is no port to race
for), calls ``fn(rank, world_size, *args)`` and returns the list of the values
the ranks returned, in rank order. An exception in any rank fails the call with
that rank's traceback (``torch.multiprocessing.ProcessRaisedException``); a
rank stuck in a collective fails after the process group's timeout.

``fn`` must be a module-level function (it is pickled by reference), and what
it returns must be serialisable with ``torch.save``. The processes are forked
from a ``forkserver`` that has imported torch and the library once (a fresh
interpreter like ``spawn``'s, none of the test process's state, without each
rank importing torch again: ~4 CPU s a rank); where there is no forkserver
(Windows) they are spawned. Starting them still costs about a second, so a
test should batch several checks into one run.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "stop_forkserver", "CountingDist"]

# The forkserver (one per test process, started by the first run) imports these before it forks any rank.
_PRELOAD = ["torch", "torch.distributed", "whitenlayers", "dist_utils"]
_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
if _START_METHOD == "forkserver":
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def _worker(rank: int, world_size: int, store: str, outdir: str, fn: Callable, args: tuple, backend: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    # Everything has succeeded: leave without the interpreter's finalization, where a gloo worker thread still
    # alive can abort the process (pytorch#179291's class of crash). Seen once in CI: a rank of
    # test_fsdp_trains_like_one_process[fsdp2-no-reshard] killed by SIGABRT, "terminate called without an active
    # exception", not reproduced in 40 runs here; if it comes from finalization, this removes it. An exception
    # above still fails the run with its traceback, and an abort before this line still fails it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, backend: str = "gloo") -> List[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each in its own process.

    ``backend="nccl"`` puts rank ``r`` on ``cuda:r`` (needs ``world_size`` GPUs).
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(world_size, store, tmp, fn, args, backend), nprocs=world_size, join=True,
                           start_method=_START_METHOD)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def stop_forkserver() -> None:
    """Stop this process's forkserver (``tests/conftest.py`` calls it at the end of the session) and wait for it:
    none outlives the test process, and the ranks' CPU time counts as the test process's children's (``time``,
    ``getrusage``), as spawned ranks did. ``_stop`` is the stop CPython's own tests use; a no-op if none runs."""
    if _START_METHOD == "forkserver":
        import multiprocessing.forkserver

        multiprocessing.forkserver._forkserver._stop()


class CountingDist:
    """Stands in for the ``torch.distributed`` module inside one library module and counts collectives.

    ``wl.stats.dist = CountingDist(torch.distributed)`` counts the ``all_reduce``
    / ``reduce`` / ``broadcast`` / ``all_gather`` calls that module makes, and nothing that
    other code (DDP, a batch norm) does; every other attribute is the real one.
    """

    COUNTED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "all_reduce_coalesced")

    def __init__(self, real) -> None:
        self._real = real
        self.calls: List[str] = []

    def __getattr__(self, name: str):
        attr = getattr(self._real, name)
        if name in self.COUNTED:
            def counted(*a, **k):
                self.calls.append(name)
                return attr(*a, **k)
            return counted
        return attr

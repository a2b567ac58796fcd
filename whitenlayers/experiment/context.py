"""This process's place in a run: rank, world size, device, threads, and the few collectives the runner needs.

Several processes or machines (``torch.distributed``)
-----------------------------------------------------
Launch with ``torchrun``; the runner then uses ``DistributedDataParallel``
(gloo on CPU, NCCL on GPU, default settings, ``broadcast_buffers=True``) and
a ``DistributedSampler``-ordered, rank-sharded data stream. ``--batch-size`` is
the *global* batch, split evenly over the processes, so a run's block
statistics are those of one process seeing the global batch. Rank 0 writes
metrics, figure and checkpoints; on ``--resume`` rank 0 reads the checkpoint
and broadcasts it, so only rank 0 needs the output folder. The test set is
sharded across ranks and the counts are summed. When distributed, every rank
also writes ``ranks/<method>-seed<seed>-rank<r>.json`` with a hash of its
whitening buffers, which must agree across ranks.

One machine, 4 processes::

    torchrun --standalone --nproc_per_node=4 -m whitenlayers.experiment --preset paper-cifar --data-dir data

Two machines with 8 GPUs each; run on both, with ``--node_rank=0`` on the
machine whose address is given as ``--master_addr`` and ``--node_rank=1`` on
the other::

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 \\
        --master_addr=10.0.0.1 --master_port=29500 \\
        -m whitenlayers.experiment --preset paper-imagenet --dataset imagefolder:/data/imagenet

or with the elastic c10d rendezvous (same command on every machine)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=10.0.0.1:29400 --rdzv_id=whiten-in1k \\
        -m whitenlayers.experiment --preset paper-imagenet --dataset imagefolder:/data/imagenet

The data (``--data-dir`` or the ImageFolder path) must be readable on every
machine.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["Context"]


def _load1() -> float:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return 0.0


class Context:
    """Rank, world size and device of this process (from torchrun's environment variables)."""

    def __init__(self, device_arg: str, threads: Optional[int]) -> None:
        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        want_cuda = device_arg.startswith("cuda") or (device_arg == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device_arg}: CUDA is not available")
        if want_cuda:
            # Under torchrun each process takes its local rank's GPU; alone, the one asked for (or the current one).
            if self.world > 1:
                index = self.local_rank
            elif ":" in device_arg:
                index = int(device_arg.split(":", 1)[1])
            else:
                index = torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.saved_threads = torch.get_num_threads()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        if threads is None:
            # On the CPU one thread per process by default, whatever the machine's cores and load: another thread
            # count splits the convolutions' sums differently and so trains differently (a --quick run's epoch-2
            # accuracies differed by up to 14 points between 1 and 2 threads), so the default run gives the same
            # metrics.csv on a rerun on the same CPU, idle or busy. One thread is also the fast choice on a shared
            # CPU, where OpenMP threads that wait for each other slow every step down (a --quick run took 21 s with
            # 2 threads against 2.7 s with 1 at load 1 on 2 cores). On CUDA: the cores divided by the processes.
            threads = 1 if self.device.type == "cpu" else max(1, cores // max(1, self.local_world))
        self.threads = threads
        self.note = ""
        if self.device.type == "cpu" and self.threads > 1:
            load = _load1()
            if load >= cores - 0.5:
                self.note = (f"note: the machine is busy (1-minute load {load:.1f} on {cores} cores): {self.threads} "
                             f"threads per process may run far slower than 1 (OpenMP threads that wait for each "
                             f"other on a busy CPU slow every step down); the default is 1")
        torch.set_num_threads(self.threads)
        self.initialized_here = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
            self.initialized_here = True

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """Print on rank 0."""
        if self.is_main:
            print(msg, flush=True)

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                self.dist.barrier(device_ids=[self.device.index])
            else:
                self.dist.barrier()

    def all_sum(self, values: Sequence[float]) -> List[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.distributed:
            self.dist.all_reduce(t)
        return t.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def synchronize(self) -> None:
        """Wait for the device (CUDA) to finish, before reading a clock."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        torch.set_num_threads(self.saved_threads)
        if self.initialized_here and self.dist.is_initialized():
            self.dist.destroy_process_group()

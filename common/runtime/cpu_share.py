"""A CPU model stage's torch threads: its share of the host's cores, which the deployment's other CPU
stages use at the same time.

Each stage process used to make a torch pool of every core, and a waiting OpenMP thread spins
(libgomp): with four model stages of two threads on 2 cores, the tiny pipeline's start-up took ~40%
more CPU time than with one thread each, and its first tokens came later (bench/RESULTS.md,
2026-11-28 CPU start-up). A CPU TP rank keeps at most its group's share of that (tp/distributed.py).
"""

from __future__ import annotations

import os

import torch
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.stages import MODEL_KINDS

# Set in the environment, it wins: the stage keeps torch's count.
THREADS_ENV = "OMP_NUM_THREADS"


def threads_each(cfg: DeployConfig) -> int:
    """The cores this process may use, shared by the deployment's model stage processes on the CPU (each
    TP rank one; the gateway and CUDA stages do not count), at least 1. A CPU stage alone keeps every
    core."""
    procs = sum(s.tp_size for s in cfg.services.values() if s.device == "cpu" and s.kind in MODEL_KINDS)
    return max(1, len(os.sched_getaffinity(0)) // max(1, procs))


def share_cpu_cores(cfg: DeployConfig, svc: ServiceConfig) -> int | None:
    """Set this process's torch threads to its share when it is a CPU model stage and the environment
    sets no OMP_NUM_THREADS; returns the count set (None: left as it was)."""
    if svc.device != "cpu" or svc.kind not in MODEL_KINDS or THREADS_ENV in os.environ:
        return None
    threads = threads_each(cfg)
    torch.set_num_threads(threads)
    return threads

"""One worker of an executor: the backend, this rank's place in a tensor-parallel group, and its model runner.

The multiprocess executor (one spawned process per rank) and the Ray executor (one actor per rank, on any node of
the cluster) both start their workers here, so a rank is set up the same way whoever launched it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

from infertune.config import EngineConfig

log = logging.getLogger(__name__)

# How long the ranks wait for each other at start-up and in any collective (a rank that died is seen at once by the
# driver; this bounds what a stuck one can hold up).
GROUP_TIMEOUT = timedelta(minutes=5)
# The tokens of activations one shared-memory slot holds (a bigger all-reduce goes through it in pieces);
# INFERTUNE_TP_SHM=0 turns the shared-memory path off (for A/B measurements).
SHM_MAX_TOKENS = 256


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_worker(
    config: EngineConfig,
    show_progress: bool,
    rank: int = 0,
    size: int = 1,
    init_method: str | None = None,
    one_host: bool = True,
    bind: bool = True,
):
    """-> (the ModelRunner, a description for logs). With size > 1 this process joins the group at init_method
    (tcp://HOST:PORT) as `rank`; bind: pin it to its share of the host's CPUs (the multiprocess executor; Ray
    gives each actor its CPUs itself); one_host: every rank on this host (the shared-memory all-reduce)."""
    from infertune.backends import get_backend
    from infertune.runner.model_runner import ModelRunner

    backend = get_backend(config.device.device)
    tp = None
    if size > 1:
        import torch.distributed as dist

        from infertune.layers.parallel import TensorParallel

        where = backend.bind_rank(rank, size) if bind else backend.describe()
        dist.init_process_group(
            backend.dist_backend, init_method=init_method, rank=rank, world_size=size, timeout=GROUP_TIMEOUT
        )
        shm = None
        if one_host and backend.shm_allreduce and os.environ.get("INFERTUNE_TP_SHM", "1") != "0":
            from infertune.layers.shm_allreduce import ShmAllReduce

            # a slot: decode-sized steps' activations, and the vocabulary-split head's logits of one row a
            # sequence (all-reduces take bigger tensors in pieces; gathers of more rows, prompt logprobs, use gloo)
            arch, sched = config.model.arch, config.scheduler
            numel = max(
                min(sched.max_num_batched_tokens, SHM_MAX_TOKENS) * arch.hidden_size,
                sched.max_num_seqs * -(-arch.vocab_size // size),
            )
            shm = ShmAllReduce.connect(rank, size, numel, dist.barrier, init_method.rsplit(":", 1)[-1])
        tp = TensorParallel(rank, size, shm=shm, expert_parallel=config.parallel.enable_expert_parallel)
        log.info("tensor-parallel rank %d of %d: %s%s", rank, size, where, ", shared-memory all-reduce" * bool(shm))
    runner = ModelRunner(config, backend, show_progress and rank == 0, tp)
    return runner, f"{backend.describe()}, {str(runner.dtype).removeprefix('torch.')}"


def run_step(runner, scheduler_output):
    """One step on this rank, its time added to the rank's collective counts (layers/parallel.py COMM)."""
    from infertune.layers.parallel import COMM

    t0 = time.perf_counter_ns()
    try:
        return runner.execute_model(scheduler_output)
    finally:
        COMM.exec_ns += time.perf_counter_ns() - t0
        COMM.steps += 1
        fused = getattr(runner, "fused", None)  # (its all-reduces run inside the kernels: counted by them)
        got = fused.take_allreduce() if fused is not None and runner.tp is not None else None
        if got is not None and got[0]:
            COMM.add_many("all_reduce (fused step, in C)", got[0], got[1], int(got[2] * 1e9))


def take_comm_stats() -> dict:
    from infertune.layers.parallel import COMM

    return COMM.take()

"""Process groups for tensor parallelism: the two collectives the engine needs, two ways.

A group has `rank`, `world`, `xp` (the array module of the arrays it exchanges) and
- all_reduce_sum(array): the element-wise sum over the ranks, written into `array` (which must be
  C-contiguous) and returned; every rank gets the same bits;
- broadcast(array, root): the root's `array` copied into every rank's, in place, and returned.

NcclGroup runs them on GPUs through cupyx.distributed (NCCL on CUDA; on ROCm cupy's nccl module
is RCCL), one process per GPU, on one host or several: the rendezvous is cupyx's TCP store on
rank 0's host. No transport of our own. ThreadGroup is the CPU stand-in: `world` threads of one
process, each running one rank's whole forward (numpy), meet at a barrier to sum. It really runs
N ranks in lock-step, so what the CPU tests check (the same collectives in the same order on
every rank, sums equal to the unsharded forward) is what the GPUs will have to do.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from cupa.arrays import to_host

# Environment of every NCCL process. NVLink SHARP (NVLS) algorithms allocate NVLink multicast
# objects; this engine never creates multicast objects, so NCCL is told not to either (it then
# uses its ring / tree algorithms, over NVLink all the same).
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0"}

# Longest wait at a ThreadGroup barrier: a rank that never arrives is a bug (a collective that
# the other ranks do not make), which must fail the run instead of hanging it.
SIMULATION_BARRIER_TIMEOUT_S = 300.0


def _require_c_contiguous(array) -> None:
    """all_reduce_sum writes the sum into `array` itself, which a strided view cannot take."""
    if not array.flags.c_contiguous:
        raise ValueError("all_reduce_sum: the array must be C-contiguous (it is reduced in "
                         "place)")


class NcclGroup:
    """One rank of a group of GPU processes over NCCL / RCCL (cupyx.distributed).

    The collectives run on the current cupy stream at the time of the call: the default stream
    for eager steps, and inside DecodeGraphs' `with stream:` the capture stream, so a captured
    decode step records its all-reduces in the graph (NCCL supports stream capture) and every
    replay runs them. Not run: no two GPUs were available (see README)."""

    def __init__(self, rank: int, world: int, local_rank: int, host: str, port: int):
        import cupy
        import cupyx.distributed
        os.environ.update(NCCL_ENVIRONMENT)  # before NCCL reads it, in every process
        self.rank, self.world, self.local_rank, self.xp = rank, world, local_rank, cupy
        cupy.cuda.Device(local_rank).use()  # NCCL binds the communicator to the current device
        self._comm = cupyx.distributed.init_process_group(world, rank, backend="nccl",
                                                          host=host, port=port)

    def all_reduce_sum(self, array):
        _require_c_contiguous(array)
        self._comm.all_reduce(array, array, op="sum")  # in place, on the current stream
        return array

    def broadcast(self, array, root: int = 0):
        self._comm.broadcast(array, root)
        return array

    def close(self) -> None:
        """Stop the rendezvous store (rank 0 runs it)."""
        self._comm.stop()


class _Meeting:
    """What the threads of one simulated group share: a barrier and one slot per rank."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=SIMULATION_BARRIER_TIMEOUT_S)
        self.slots = [None] * world


class ThreadGroup:
    """One rank of `world` simulated in threads of this process (numpy arrays)."""

    xp = np

    def __init__(self, meeting: _Meeting, rank: int, world: int):
        self._meeting, self.rank, self.world = meeting, rank, world
        self.local_rank = rank

    def all_reduce_sum(self, array):
        _require_c_contiguous(array)
        meeting = self._meeting
        meeting.slots[self.rank] = array.copy()
        meeting.barrier.wait()  # every rank's part is in
        # Every rank adds the parts in rank order, so every rank gets the same bits (as NCCL
        # gives every rank the same result).
        total = meeting.slots[0].copy()
        for part in meeting.slots[1:]:
            total += part
        meeting.barrier.wait()  # every rank has read the parts before any slot is reused
        array[...] = total
        return array

    def broadcast(self, array, root: int = 0):
        meeting = self._meeting
        if self.rank == root:
            meeting.slots[root] = array.copy()
        meeting.barrier.wait()
        if self.rank != root:
            array[...] = meeting.slots[root]
        meeting.barrier.wait()
        return array


def thread_groups(world: int) -> list[ThreadGroup]:
    """The `world` ranks of one simulated group."""
    meeting = _Meeting(world)
    return [ThreadGroup(meeting, rank, world) for rank in range(world)]


def run_simulated_ranks(world: int, rank_main) -> list:
    """Run rank_main(group) for every rank of a ThreadGroup, each in its own thread; the list
    of their results, by rank. A rank that raises breaks the barrier, so the others stop at
    their next collective instead of waiting forever; the first real error is raised again."""
    groups = thread_groups(world)
    results, errors = [None] * world, [None] * world

    def run(rank):
        try:
            results[rank] = rank_main(groups[rank])
        except BaseException as e:  # re-raised below, in the caller's thread
            errors[rank] = e
            groups[rank]._meeting.barrier.abort()

    # Daemon threads: an interrupt of the main thread ends the run instead of waiting on them.
    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}", daemon=True)
               for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A BrokenBarrierError only says that another rank failed first: report that rank's error.
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results


def minimum_over_ranks(group, value: int) -> int:
    """The smallest of every rank's `value` (say, the KV-cache blocks each GPU has room for),
    the same on every rank: an all-gather made of all_reduce_sum (each rank fills its own
    slot of a zero vector)."""
    slots = np.zeros(group.world, dtype=np.int64)
    slots[group.rank] = value
    return int(to_host(group.all_reduce_sum(group.xp.asarray(slots))).min())

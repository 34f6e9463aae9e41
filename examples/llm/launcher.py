"""Starting the ranks of a tensor-parallel run: one process per GPU, on one host or several.

A program (generate.py, bench_generate.py) has a `rank_main(argv, group)` that runs one rank
given its process group; run_tensor_parallel(world, backend, rank_main, argv) starts them:

- numpy backend: `world` threads of this process over a collectives.ThreadGroup (the CPU
  simulation; the same program, the same collectives, in lock-step).
- GPU, this process already one rank: RANK and WORLD_SIZE are set (by torchrun, a cluster
  scheduler's wrapper or by hand, with LOCAL_RANK, MASTER_ADDR, MASTER_PORT): it runs that rank.
- GPU otherwise: this process spawns the ranks of this host (multiprocessing, spawn context: a
  fresh interpreter per GPU, nothing CUDA inherited), world / NNODES of them, ranks NODE_RANK *
  (world / NNODES) + local rank. One host needs no variables; for several, every host runs the
  same command with NNODES, its NODE_RANK and the same MASTER_ADDR (an address of node 0,
  where rank 0 runs cupyx's rendezvous store) and MASTER_PORT.

Each rank process selects its GPU (cupy.cuda.Device(local_rank).use()) and joins NCCL through
cupyx.distributed.init_process_group with host MASTER_ADDR and port MASTER_PORT. What the ranks
share: the command line (the checkpoint path, prompts, options: every host must see the same
checkpoint at that path) and the collectives; nothing else.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
from dataclasses import dataclass

from .collectives import NCCL_ENVIRONMENT, NcclGroup, run_simulated_ranks

# The rendezvous port on several hosts when MASTER_PORT is not set (torchrun's default); one
# host picks a free port instead.
DEFAULT_MASTER_PORT = 29500
LOCAL_MASTER_ADDR = "127.0.0.1"


class NotEnoughGpusError(RuntimeError):
    """Fewer GPUs are visible on this host than its tensor-parallel ranks need."""


class LaunchError(ValueError):
    """The launch variables (RANK, WORLD_SIZE, NNODES, ...) do not fit --tensor-parallel."""


@dataclass(frozen=True)
class RankEnvironment:
    """Where one rank runs: its place in the group, its GPU on its host, the rendezvous."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int

    def variables(self) -> dict[str, str]:
        """The rank's environment variables (torchrun's names) plus NCCL's settings."""
        return dict(NCCL_ENVIRONMENT, RANK=str(self.rank), WORLD_SIZE=str(self.world),
                    LOCAL_RANK=str(self.local_rank), MASTER_ADDR=self.master_addr,
                    MASTER_PORT=str(self.master_port))


def _int_variable(environ, name: str, default=None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer") from None


def environment_rank(world: int, environ=None) -> RankEnvironment | None:
    """This process's rank when RANK and WORLD_SIZE are set (an outside launcher started one
    process per GPU), else None. LaunchError when they do not fit `world`."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    rank, size = _int_variable(environ, "RANK"), _int_variable(environ, "WORLD_SIZE")
    if size != world:
        raise LaunchError(f"WORLD_SIZE={size} but --tensor-parallel {world}: they must agree")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not in [0, {world})")
    if "MASTER_ADDR" not in environ:
        raise LaunchError("RANK and WORLD_SIZE are set but MASTER_ADDR is not (an address of "
                          "the host of rank 0)")
    return RankEnvironment(rank, world, _int_variable(environ, "LOCAL_RANK", rank),
                           environ["MASTER_ADDR"],
                           _int_variable(environ, "MASTER_PORT", DEFAULT_MASTER_PORT))


def host_ranks(world: int, environ=None, free_port=None) -> list[RankEnvironment]:
    """The ranks this host starts: all of them on one host (NNODES unset or 1, rendezvous on
    this host at a free port), else this node's share. LaunchError for inconsistent values."""
    environ = os.environ if environ is None else environ
    nodes = _int_variable(environ, "NNODES", 1)
    node = _int_variable(environ, "NODE_RANK", 0)
    if nodes < 1 or world % nodes:
        raise LaunchError(f"NNODES={nodes}: --tensor-parallel {world} must split evenly over "
                          "the hosts")
    if not 0 <= node < nodes:
        raise LaunchError(f"NODE_RANK={node} is not in [0, NNODES={nodes})")
    if nodes == 1:
        addr = environ.get("MASTER_ADDR", LOCAL_MASTER_ADDR)
        port = _int_variable(environ, "MASTER_PORT", 0) or (free_port or _free_port)()
    else:
        if "MASTER_ADDR" not in environ:
            raise LaunchError(f"NNODES={nodes} needs MASTER_ADDR: an address of node 0 that "
                              "every host reaches (rank 0 runs the rendezvous store there)")
        addr = environ["MASTER_ADDR"]
        port = _int_variable(environ, "MASTER_PORT", DEFAULT_MASTER_PORT)
    per_node = world // nodes
    return [RankEnvironment(node * per_node + local, world, local, addr, port)
            for local in range(per_node)]


def _free_port() -> int:
    """A TCP port nothing listens on now (the one-host rendezvous)."""
    with socket.socket() as s:
        s.bind((LOCAL_MASTER_ADDR, 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    """GPUs cupy sees on this host (0 without cupy or a driver)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: none usable
        return 0


def check_visible_gpus(local_ranks: int, world: int) -> None:
    """NotEnoughGpusError unless this host sees a GPU for each of its `local_ranks` ranks."""
    count = visible_gpus()
    if count < local_ranks:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get("HIP_VISIBLE_DEVICES"))
        note = f" (visible devices: {shown})" if shown is not None else ""
        raise NotEnoughGpusError(
            f"--tensor-parallel {world} needs {local_ranks} GPUs on this host (one process "
            f"per GPU), but only {count} {'is' if count == 1 else 'are'} visible{note}")


class RankExit(Exception):
    """A simulated rank's non-zero exit status, raised so that the other ranks stop."""

    def __init__(self, status: int):
        super().__init__(f"a rank exited with status {status}")
        self.status = status


def run_tensor_parallel(world: int, backend: str, rank_main, argv) -> int:
    """Run rank_main(argv, group) on every rank of this host (see the module docstring); the
    exit status: 0, or the first failing rank's."""
    if backend != "gpu":
        def simulated(group):
            status = rank_main(argv, group)
            if status:
                raise RankExit(status)
            return status
        try:
            run_simulated_ranks(world, simulated)
        except RankExit as e:
            return e.status
        return 0
    outside = environment_rank(world)
    if outside is not None:
        check_visible_gpus(outside.local_rank + 1, world)
        return _run_rank(outside, rank_main, argv)
    ranks = host_ranks(world)
    check_visible_gpus(len(ranks), world)
    return spawn_ranks(ranks, rank_main, argv)


def nccl_group(where: RankEnvironment) -> NcclGroup:
    """The NCCL group of a rank (its GPU selected)."""
    return NcclGroup(where.rank, where.world, where.local_rank, where.master_addr,
                     where.master_port)


def _run_rank(where: RankEnvironment, rank_main, argv, make_group=nccl_group) -> int:
    """One rank in this process: its environment, its group (GPU and NCCL communicator: the
    tests pass a stand-in), its program."""
    os.environ.update(where.variables())
    group = make_group(where)
    try:
        return rank_main(argv, group)
    finally:
        group.close()


def _rank_process(where: RankEnvironment, rank_main, argv, make_group) -> None:
    """The entry point of a spawned rank process."""
    raise SystemExit(_run_rank(where, rank_main, argv, make_group))


def spawn_ranks(ranks: list[RankEnvironment], rank_main, argv, make_group=nccl_group) -> int:
    """Start one process per rank and wait for them. When one fails, the others are stopped:
    they would otherwise wait forever in a collective that rank never makes."""
    # Inherited by the children as they start; each also sets its own rank's variables.
    os.environ.update(NCCL_ENVIRONMENT)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_process,
                                 args=(where, rank_main, argv, make_group),
                                 name=f"rank-{where.rank}") for where in ranks]
    for process in processes:
        process.start()
    status, running = 0, list(processes)
    while running:
        for sentinel in multiprocessing.connection.wait([p.sentinel for p in running]):
            process = next(p for p in running if p.sentinel == sentinel)
            process.join()
            running.remove(process)
            if process.exitcode and not status:
                # A signal shows as a negative exit code; the caller needs a failure status.
                status = process.exitcode if process.exitcode > 0 else 1
                for other in running:
                    other.terminate()
    return status

"""Runs one of cupa's kernels on the CPU under AddressSanitizer and UndefinedBehaviorSanitizer,
with every array it gets in guarded memory (guarded_memory.py), in a process of its own.

Why a process: the sanitizers' runtime must be loaded before anything else (LD_PRELOAD), and a
kernel that touches a guard kills the process it runs in. The parent (a test) calls
`run_sanitized(job, workdir)`; this file, run as a script, is the child: it places the job's
arrays, prints where each lies, runs the kernel and saves what it wrote. A finding (a fault in a
guard, an ASan report on shared memory or the stack, a UBSan report such as a signed overflow or
an out-of-bounds index) ends the child, and the parent raises `SanitizerFinding` with the report
and, for a fault, which array the address was next to.

Jobs (dicts, pickled):
- {"kind": "decode", "arch", "placement", "arrays": {name: array} of decode_on_cpu's arrays
  (query, key_cache, ..., sinks), "options": its other keywords; optionally "kv_view":
  cases.kv_views's keywords, to read the caches as such a view}
  -> {"out", "lse", "variant"}
- {"kind": "cache_write", "arch", "placement", "arrays": {"key", "value", "key_cache",
  "value_cache", "slots"}, "kv_format", "k_scale", "v_scale"}
  -> {"key_cache", "value_cache"}
- {"kind": "kernel", "placement", "source", "name", "grid", "block", "args": [(name, value,
  writable)]}: any kernel source (the harness's own tests) -> {name: array} of the writable
  arrays
Each job may hold "environ": environment variables for the child (cupa's dispatch switches).
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

CHILD_TIMEOUT_S = 900


class SanitizerFinding(AssertionError):
    """A sanitized kernel run that did not finish cleanly; the message holds the report."""


@lru_cache(maxsize=None)
def asan_runtime() -> str | None:
    """The path of the compiler's ASan runtime, or None where g++ has none."""
    try:
        path = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def sanitizers_missing() -> str | None:
    """Why the sanitized runs cannot run here, or None."""
    if asan_runtime() is None:
        return "g++ has no AddressSanitizer runtime (libasan.so; Debian: the gcc package's)"
    return None


@lru_cache(maxsize=None)
def asan_cannot_start() -> str | None:
    """Why a Python process with the ASan runtime preloaded does not start here (some kernels'
    address-space layouts defeat an older runtime's shadow memory), or None."""
    here = str(Path(__file__).resolve().parent)
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                            "import cuda_on_cpu; assert cuda_on_cpu.asan_preloaded()"],
                           env=_child_env({}), capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return None
    return f"python with {asan_runtime()} preloaded exits {probe.returncode}: " \
           f"{probe.stderr.strip()[-300:]}"


def _child_env(environ: dict) -> dict:
    return dict(os.environ, **environ, LD_PRELOAD=asan_runtime(),
                # Python's own allocations are never freed at exit: leak reports would be noise.
                ASAN_OPTIONS="detect_leaks=0:handle_segv=1:print_summary=1",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")


def run_sanitized(job: dict, workdir: Path) -> dict:
    """Run `job` in a sanitized child; its results as a dict of arrays (and strings)."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, result_path = workdir / "job.pkl", workdir / "result.pkl"
    job_path.write_bytes(pickle.dumps(job))
    result_path.unlink(missing_ok=True)  # a workdir may serve several runs
    env = _child_env(job.get("environ", {}))
    child = subprocess.run([sys.executable, __file__, str(job_path), str(result_path)],
                           env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if child.returncode != 0 or not result_path.exists():
        raise SanitizerFinding(_report(job, child))
    return pickle.loads(result_path.read_bytes())


def _report(job: dict, child) -> str:
    """The child's findings, with the array a faulting address lies next to."""
    from guarded_memory import describe_address
    regions = [(name, int(start), int(nbytes)) for name, start, nbytes in
               re.findall(r"^region (\w+) (\d+) (\d+)$", child.stdout, re.M)]
    where = ""
    fault = re.search(r"SEGV on unknown address (0x[0-9a-f]+)", child.stderr)  # a guard
    if fault and regions:
        where = f"\nthe address is {describe_address(regions, int(fault.group(1), 16))}"
    finding = [line for line in child.stderr.splitlines()
               if "ERROR" in line or "runtime error" in line or "SUMMARY" in line]
    label = {k: job[k] for k in ("kind", "arch", "placement", "environ") if k in job}
    return (f"sanitized {label}: exit status {child.returncode}{where}\n"
            + "\n".join(finding[:5]) + "\n--- stderr (tail) ---\n" + child.stderr[-6000:])


def _run_decode(job: dict, place) -> dict:
    from decode_on_cpu import decode_on_cpu
    arrays = dict(job["arrays"])
    if "kv_view" in job:  # strided views are built here: a pickle would make them contiguous
        from cases import kv_views
        arrays["key_cache"], arrays["value_cache"] = kv_views(
            arrays["key_cache"], arrays["value_cache"], **job["kv_view"])
    result = decode_on_cpu(job["arch"], **arrays, **job["options"], place=place,
                           sanitize=True)
    return {"out": np.array(result.out), "lse": np.array(result.lse),
            "variant": repr(result.plan.variant)}


def _run_cache_write(job: dict, place) -> dict:
    from cache_write_on_cpu import cache_write_on_cpu
    arrays = job["arrays"]
    written = cache_write_on_cpu(job["arch"], arrays["key"], arrays["value"],
                                 arrays["key_cache"], arrays["value_cache"], arrays["slots"],
                                 kv_format=job.get("kv_format"), k_scale=job.get("k_scale"),
                                 v_scale=job.get("v_scale"), place=place, sanitize=True)
    return {name: np.array(a) for name, a in zip(("key_cache", "value_cache"), written)}


def _run_kernel(job: dict, place) -> dict:
    from cuda_on_cpu import cpu_kernels
    kernel = cpu_kernels(job["source"], (), sanitize=True)[job["name"]]
    args = [place(name, value, writable=writable) if isinstance(value, np.ndarray) else value
            for name, value, writable in job["args"]]
    kernel(job["grid"], job["block"], args)
    return {name: np.array(a) for (name, _, writable), a in zip(job["args"], args) if writable}


def _child(job_path: str, result_path: str) -> None:
    # The runtime is in (LD_PRELOAD); the compilers this process starts need not carry it.
    from cuda_on_cpu import asan_preloaded
    if not asan_preloaded():
        sys.exit("sanitized_run.py: the ASan runtime is not preloaded (run_sanitized does it)")
    os.environ.pop("LD_PRELOAD", None)
    from guarded_memory import GuardedArena
    job = pickle.loads(Path(job_path).read_bytes())
    with GuardedArena(job["placement"]) as arena:
        def place(name, array, writable=False):
            placed = arena.place(name, array, writable=writable)
            if placed is not None:
                print("region %s %d %d" % arena.regions[-1], flush=True)
            return placed
        run = {"decode": _run_decode, "cache_write": _run_cache_write,
               "kernel": _run_kernel}[job["kind"]]
        result = run(job, place)
    Path(result_path).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parents[1])]  # the helpers, and cupa from the tree
    _child(*sys.argv[1:])

"""Command line: `python -m cupa info | compile | bench | selftest`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def cmd_info(args) -> int:
    import numpy as np

    from . import __version__, arrays, platform
    from .gpu import catalogue, offline
    from .fp8 import default_kv_format
    print(f"cupa {__version__}  (numpy {np.__version__})")
    cupy = arrays.cupy_module()
    if cupy is None:
        print("cupy: not installed -> backend 'numpy' (install cupa[cuda12|cuda13|rocm] for GPU)")
    else:
        rocm = platform.is_rocm()
        print(f"cupy: {cupy.__version__} built for {'ROCm/HIP' if rocm else 'CUDA'}")
        if rocm:
            print(f"hipcc on PATH: {shutil.which('hipcc') or 'NO - ' + platform.hipcc_missing()}")
        if arrays.gpu_available():
            from .gpu.device import device_info
            info = device_info()
            t = info.target
            print(f"device {info.index}: {info.name}")
            print(f"  arch {t.arch}, warp size {info.warp_size}, {info.multiprocessors} "
                  f"multiprocessors, {info.shared_memory_per_block // 1024} KB shared/block")
            print(f"  compiler: {'hipRTC' if t.is_hip else 'NVRTC'} via cupy.RawModule, "
                  f"options {' '.join(t.runtime_options())}")
            kv_format = default_kv_format(t.arch)
            print(f"  default kv_format: {kv_format}" if kv_format else
                  f"  default kv_format: None (no fp8 hardware on {t.arch}; fp8 KV caches "
                  f"still work, converted in software)")
        else:
            print("device: none visible -> backend 'numpy'")
        cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
        print(f"kernel cache dir: {cache_dir}")
    print("offline compile (python -m cupa compile):")
    for target in offline.targets_by_default():
        if target.startswith("gfx"):
            why = offline.hip_toolchain_missing(target)
            clang = offline.hip_compiler(target)
            how = why or (f"{clang}, headers {offline.hip_include_dir(clang)}, "
                          f"device libraries {offline.device_library_dir(clang)}")
        else:
            why = offline.nvrtc_missing()
            how = why or "NVRTC (cupy)"
        print(f"  {target:<8} {'NO - ' if why else ''}{how}")
    print(f"kernel variants: {len(catalogue.all_variants())} "
          f"({', '.join(f'{k}: {len(f())}' for k, f in catalogue.VARIANT_FAMILIES.items())})")
    print(f"default backend: {'gpu' if arrays.gpu_available() else 'numpy'}")
    if not arrays.gpu_available():
        print("default kv_format: none detected (no GPU)")
    return 0


def _compile_batch(job):
    batch, arch = job
    from .gpu.offline import compile_offline
    start = time.perf_counter()
    from .gpu.offline import CompilerMissing
    try:
        size = compile_offline(batch, arch)
        return batch, arch, True, f"{size} B", time.perf_counter() - start
    except CompilerMissing as exc:  # one cause for the whole target: reported once
        return batch, arch, False, MISSING_COMPILER + str(exc), time.perf_counter() - start
    except Exception as exc:  # reported in the table, and makes the exit code non-zero
        return batch, arch, False, str(exc), time.perf_counter() - start


MISSING_COMPILER = "compiler missing: "


def _batch_cost(batch) -> int:
    """A batch's compile time, roughly: the registers its kernels keep per thread grow with
    head size x query rows."""
    return sum(getattr(v, "head_size", 32) * getattr(v, "rows", 1) for v in batch)


class CompileRun:
    """Offline compiles submitted to a pool of worker processes (start_compile); `results`
    waits for them. The pool's workers are made at submission, so a caller can go on with other
    work (the test suite runs its other tests) while they compile."""

    def __init__(self, work: list, jobs=None):
        self.total = sum(len(batch) for batch, _ in work)
        self.start = time.perf_counter()
        self._pool = ProcessPoolExecutor(max_workers=jobs or os.cpu_count())
        self._futures = [self._pool.submit(_compile_batch, job) for job in work]
        self._results = None

    def results(self, progress=False) -> dict:
        """{(variant, arch): (ok, detail)} once every batch has finished. progress: a line on
        stderr per finished batch (rewritten in place on a terminal)."""
        if self._results is not None:
            return self._results
        results = {}
        in_place = sys.stderr.isatty()
        for future in as_completed(self._futures):
            batch, arch, ok, detail, seconds = future.result()
            results.update({(v, arch): (ok, detail) for v in batch})
            if progress:
                done = len(results) == self.total
                print(f"{chr(13) if in_place else ''}  compiled {len(results)}/{self.total} "
                      f"variants in {time.perf_counter() - self.start:.0f} s  (last: "
                      f"{len(batch)} of {batch[0].entry_names[0]} on {arch}, {seconds:.1f} s"
                      f"{'' if ok else ', FAILED'})", end="\n" if (done or not ok or not in_place)
                      else "", file=sys.stderr, flush=True)
        self._pool.shutdown()
        self._results = results
        return results

    def cancel(self) -> None:
        """Drop the batches not yet started (the running ones finish: a compiler run is not
        interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def start_compile(targets, jobs=None, representative=False) -> CompileRun:
    """Submit the compiles of every target's variants (all, or offline.representative_variants)
    in batches of one source file and dtype (one compiler run each). A failing batch marks each
    of its variants failed, with the compiler's log naming the instantiation at fault."""
    from .gpu import catalogue, offline
    pick = offline.representative_variants if representative else catalogue.all_variants
    work = [(batch, a) for a in targets for batch in offline.variant_batches(pick(a))]
    # Longest first, so that the last batches to finish are short ones (the pool's tail).
    work.sort(key=lambda job: -_batch_cost(job[0]))
    return CompileRun(work, jobs)


def compile_all(targets, jobs=None, progress=True, representative=False):
    """start_compile, then wait: {(variant, arch): (ok, detail)}."""
    return start_compile(targets, jobs, representative).results(progress)


def _default_targets() -> tuple[list[str], list[str]]:
    """(targets this machine can compile, [note for each one it cannot]) of the defaults."""
    from .gpu import offline
    usable, notes = [], []
    for target in offline.targets_by_default():
        why = (offline.nvrtc_missing() if not target.startswith("gfx") else
               offline.hip_toolchain_missing(target))
        if why:
            notes.append(f"{target}: skipped, {why}")
        else:
            usable.append(target)
    return usable, notes


def cmd_compile(args) -> int:
    from .gpu import catalogue
    from .gpu import offline
    if args.targets == "all":
        targets = list(offline.ALL_TARGETS)
    elif args.targets:
        try:
            targets = offline.check_targets([t.strip() for t in args.targets.split(",")
                                             if t.strip()])
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:  # the defaults this machine has compilers for; named targets must all compile
        targets, notes = _default_targets()
        for note in notes:
            print(note, file=sys.stderr)
        if not targets:
            print("no offline compiler for any default target", file=sys.stderr)
            return 1
    started = time.perf_counter()
    results = compile_all(targets, jobs=args.jobs, representative=args.representative)
    elapsed = time.perf_counter() - started
    # A target whose compiler is missing fails every variant for one cause: one line, with
    # what to install, instead of a column of FAIL.
    missing = {t: detail[len(MISSING_COMPILER):] for (_, t), (ok, detail) in results.items()
               if not ok and detail.startswith(MISSING_COMPILER)}
    shown_targets = [t for t in targets if t not in missing]
    width = max(len(v.entry_names[0]) for v in catalogue.all_variants())
    print(f"{'variant':<{width}}  " + "  ".join(f"{t:>8}" for t in shown_targets))
    failures = []
    for v in catalogue.all_variants():
        cells = []
        for t in shown_targets:
            if (v, t) not in results:  # not for this target, or not in the subset
                cells.append(f"{'-':>8}")
                continue
            ok, detail = results[(v, t)]
            cells.append(f"{'ok' if ok else 'FAIL':>8}")
            if not ok:
                failures.append((v, t, detail))
        if any(cell.strip() != "-" for cell in cells):
            print(f"{v.entry_names[0]:<{width}}  " + "  ".join(cells))
    not_compiled = sum(1 for (_, t) in results if t in missing)
    total = len(results)
    print(f"{total - len(failures) - not_compiled}/{total} compiled for {', '.join(targets)} "
          f"in {elapsed:.0f} s")
    for target, cause in missing.items():
        count = sum(1 for (_, t) in results if t == target)
        print(f"{target}: {count} variants not compiled: {cause}; install: "
              f"{offline.missing_compiler_hint(target)}", file=sys.stderr)
    shown = set()
    for v, t, detail in failures:  # each distinct log once (a batch's variants share theirs)
        if detail not in shown and len(shown) < 5:
            shown.add(detail)
            print(f"\n--- {v.entry_names[0]} on {t}:\n{detail[:4000]}", file=sys.stderr)
    return 1 if failures or missing else 0


def cmd_selftest(args) -> int:
    from .selftest import main as selftest_main
    return selftest_main(args)


def cmd_bench(args) -> int:
    from .bench.main import main as bench_main
    return bench_main(args)


def main(argv=None) -> int:
    from .gpu.offline import ALL_TARGETS
    parser = argparse.ArgumentParser(prog="python -m cupa",
                                     description="cupa: paged decode attention without PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, arch, warp size, compiler, kernel cache")
    p = sub.add_parser("compile", help="compile every kernel variant offline (no GPU needed)")
    p.add_argument("--targets", default=None,
                   help="comma-separated sm_XX / gfxXXXX targets, or 'all' "
                        f"({','.join(ALL_TARGETS)}), each of which must compile (default: those "
                        "of 'all' this machine has a compiler for; not sm_XX on ROCm)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    p.add_argument("--representative", action="store_true",
                   help="only the representative subset the test suite compiles by default")
    p = sub.add_parser("selftest", help="every kernel variant this GPU can use against the "
                                        "float64 reference (exit 1 on a mismatch, 2 when nothing "
                                        "was tested)")
    p.add_argument("--kernel", default=None, help="only the kernels whose name contains this")
    from .bench.main import add_arguments
    add_arguments(sub.add_parser("bench", help="time decode against the copy ceiling and peers"))
    args = parser.parse_args(argv)
    commands = {"info": cmd_info, "compile": cmd_compile, "bench": cmd_bench,
                "selftest": cmd_selftest}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

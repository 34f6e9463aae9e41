"""Command line: `python -m cupa info | compile | bench`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def cmd_info(args) -> int:
    import numpy as np

    from . import __version__, arrays
    from .gpu import catalogue
    from .gpu.offline import hip_compiler, hip_include_dir
    from .fp8 import default_kv_format
    print(f"cupa {__version__}  (numpy {np.__version__})")
    cupy = arrays.cupy_module()
    if cupy is None:
        print("cupy: not installed -> backend 'numpy' (install cupa[cuda12|cuda13|rocm] for GPU)")
    else:
        is_hip = bool(cupy.cuda.runtime.is_hip)
        print(f"cupy: {cupy.__version__} built for {'ROCm/HIP' if is_hip else 'CUDA'}")
        if is_hip:
            hipcc = shutil.which("hipcc") or ("NO - CuPy >= 14.1 runs hipcc to find headers; "
                                              "add /opt/rocm/bin to PATH")
            print(f"hipcc on PATH: {hipcc}")
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
    print(f"offline HIP compiler: {hip_compiler() or 'not found'} "
          f"(headers: {hip_include_dir() or 'not found'})")
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
    try:
        size = compile_offline(batch, arch)
        return batch, arch, True, f"{size} B", time.perf_counter() - start
    except Exception as exc:  # reported in the table, and makes the exit code non-zero
        return batch, arch, False, str(exc), time.perf_counter() - start


def compile_all(targets, jobs=None, progress=True):
    """Compile every variant for every target, in batches of one source file and dtype (one
    compiler run each); returns {(variant, arch): (ok, detail)}. A failing batch marks each of
    its variants failed, with the compiler's log naming the instantiation at fault."""
    from .gpu import catalogue
    work = [(batch, a) for a in targets for batch in catalogue.offline_batches(a)]
    total = sum(len(batch) for batch, _ in work)
    results = {}
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as pool:
        futures = [pool.submit(_compile_batch, job) for job in work]
        for future in as_completed(futures):
            batch, arch, ok, detail, _ = future.result()
            results.update({(v, arch): (ok, detail) for v in batch})
            if progress:
                print(f"\r  compiled {len(results)}/{total} variants in "
                      f"{time.perf_counter() - start:.0f} s"
                      + ("" if ok else f"  FAILED a batch of {batch[0].entry_names[0]} on {arch}"),
                      end="\n" if (len(results) == total or not ok) else "", file=sys.stderr,
                      flush=True)
    return results


def cmd_compile(args) -> int:
    from .gpu import catalogue
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    results = compile_all(targets, jobs=args.jobs)
    width = max(len(v.entry_names[0]) for v in catalogue.all_variants())
    print(f"{'variant':<{width}}  " + "  ".join(f"{t:>8}" for t in targets))
    failures = []
    for v in catalogue.all_variants():
        cells = []
        for t in targets:
            if (v, t) not in results:  # a family that does not exist for this target
                cells.append(f"{'-':>8}")
                continue
            ok, detail = results[(v, t)]
            cells.append(f"{'ok' if ok else 'FAIL':>8}")
            if not ok:
                failures.append((v, t, detail))
        print(f"{v.entry_names[0]:<{width}}  " + "  ".join(cells))
    total = len(results)
    print(f"{total - len(failures)}/{total} compiled for {', '.join(targets)}")
    for v, t, detail in failures[:5]:
        print(f"\n--- {v.entry_names[0]} on {t}:\n{detail[:4000]}", file=sys.stderr)
    return 1 if failures else 0


def cmd_bench(args) -> int:
    from .bench.main import main as bench_main
    return bench_main(args)


def main(argv=None) -> int:
    from .gpu.offline import DEFAULT_TARGETS
    parser = argparse.ArgumentParser(prog="python -m cupa",
                                     description="cupa: paged decode attention without PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, arch, warp size, compiler, kernel cache")
    p = sub.add_parser("compile", help="compile every kernel variant offline (no GPU needed)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated sm_XX / gfxXXXX targets (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    from .bench.main import add_arguments
    add_arguments(sub.add_parser("bench", help="time decode against the copy ceiling and peers"))
    args = parser.parse_args(argv)
    return {"info": cmd_info, "compile": cmd_compile, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m cupa selftest`: every kernel variant the planner can pick on this GPU, run once on a
small random problem and compared with the float64 numpy oracle (cupa.reference).

The matrix follows dispatch, not the catalogue: each query dtype x cache kind (same dtype, fp8 in
both formats) x head size, with the fewest query rows per KV head that reach each row tile, so
every (variant, fp8 format) the planner would launch here runs, in the planner's partitions and in
forced 256-token ones (several: the merge runs). Where the planner's choice depends on the
problem's size (the 16-row tensor-core kernel, and on sm_90 the dense and wide forms that large
grids get), the case forces it on its small problem with the switches of dispatch.FORM_SWITCHES.
The output is a table; the exit code is 0 when every case is within its bound, 1 on a mismatch, 2
when nothing was tested (no GPU, or a --kernel filter that matches no case).

`check_variant_once` is the per-process, disk-cached form for one variant. `first_use_guard`
hooks it into the planner on real AMD devices: a matrix-core variant (MFMA / WMMA, so far
emulated but never run on AMD hardware) is checked before its first use there, and one that
fails is replaced by the portable kernel with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np

from . import arrays, platform
from .fp8 import FP8_FORMATS, dequantize_fp8, quantize_fp8
from .gpu import catalogue, dispatch
from .problem import FP8_QUERY_DTYPES, STORAGE_DTYPES, SUPPORTED_HEAD_SIZES
from .reference import paged_decode_reference

# ||out - ref|| / ||ref|| bounds, as the GPU tests use them (tests/helpers/cases.py REL_BOUND and
# tests/gpu/test_gpu_fp8_decode.py FP8_REL_BOUND; tests/unit/test_selftest.py checks they agree).
REL_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
FP8_REL_BOUND = 1e-2
# The problem each case decodes: sequences of 1 token, of a part-filled block, and long enough
# for PARTITION_SIZE to split it in 3 (the partitioned run exercises the reduce kernel).
SEQ_LENS = (1, 37, 700)
BLOCK_SIZE = 16
NUM_KV_HEADS = 2
PARTITION_SIZE = 256
# The largest query-row count per KV head the matrix tries: past the biggest row tile of every
# kernel (8 portable, 64 in the 16-row tensor-core kernel), so each tile is reached.
MAX_ROWS = 64
SEED = 20240611
NOTHING_TESTED_EXIT = 2  # no GPU to test, or a --kernel filter that no case matches


@dataclass(frozen=True)
class Case:
    """One selftest case: the variant dispatch picks for (dtype, head_size, rows, kv_format)."""

    dtype: str
    head_size: int
    rows: int  # query rows per KV head: the GQA group (one new token per sequence)
    kv_format: str | None
    variant: object

    @property
    def form(self) -> str | None:
        """The size rule its plan is forced past (dispatch.FORM_SWITCHES), or None."""
        return dispatch.size_form(self.variant)

    @property
    def kernel(self) -> str:
        return self.variant.partition_name

    @property
    def bound(self) -> float:
        return FP8_REL_BOUND if self.kv_format else REL_BOUND[self.dtype]


def cases_for(arch: str) -> list[Case]:
    """Every (variant, fp8 format) dispatch can pick on `arch`, each with the fewest query rows
    per KV head that reach it."""
    seen, cases = set(), []
    for dtype in STORAGE_DTYPES:
        formats = (None, *FP8_FORMATS) if dtype in FP8_QUERY_DTYPES else (None,)
        for kv_format in formats:
            for head_size in SUPPORTED_HEAD_SIZES:
                for rows in range(1, MAX_ROWS + 1):
                    variant = dispatch.decode_variant(dtype, head_size, rows, arch, kv_format)
                    if (variant, kv_format) not in seen:
                        seen.add((variant, kv_format))
                        cases.append(Case(dtype, head_size, rows, kv_format, variant))
    return cases + [Case(c.dtype, c.head_size, c.rows, c.kv_format, form)
                    for c in cases for form in grid_forms(c, arch)]


def grid_forms(case: Case, arch: str) -> list:
    """The dense and wide forms of the case's variant that exist on `arch`: large grids get
    them."""
    forms = (dispatch.dense_variant(case.variant, arch),
             dispatch.wide_variant(case.variant, case.rows, arch))
    return [variant for variant in forms if variant is not None]


@dataclass
class Outcome:
    """What running a case gave: relative error per partitioning ('planned, 1 partition',
    '256-token, 3 partitions'), or an error message where it did not run."""

    errors: dict = field(default_factory=dict)
    failure: str | None = None


def _rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    denominator = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denominator if denominator > 0 else 1.0))


def make_problem(case: Case, rng) -> dict:
    """A random paged problem for `case` (host arrays): caches in the query dtype or fp8 codes
    with scales, the dequantised caches the oracle reads, tables with shuffled block ids."""
    storage = STORAGE_DTYPES[case.dtype]
    lens = np.asarray(SEQ_LENS, np.int32)
    blocks_per_seq = -(-lens // BLOCK_SIZE)
    num_blocks = int(blocks_per_seq.sum()) + 1
    width = int(blocks_per_seq.max())
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, case.head_size)
    key = rng.standard_normal(shape, dtype=np.float32)
    value = rng.standard_normal(shape, dtype=np.float32)
    tables = np.full((len(lens), width), -1, np.int32)  # past a sequence's blocks: never read
    ids = rng.permutation(num_blocks).astype(np.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[start:start + n]
        start += n
    query = rng.standard_normal((len(lens), NUM_KV_HEADS * case.rows, case.head_size))
    problem = dict(query=query.astype(storage), block_tables=tables, seq_lens=lens, options={})
    if case.kv_format:
        # N(0, 1) data over scales of 1/30 uses the codes' range without saturating (e4m3fnuz's
        # largest code is 240).
        scale = 1 / 30
        codes = [quantize_fp8(c, case.kv_format, scale) for c in (key, value)]
        problem.update(key_cache=codes[0], value_cache=codes[1],
                       reference_caches=[dequantize_fp8(c, case.kv_format, scale) for c in codes],
                       options=dict(kv_format=case.kv_format, k_scale=scale, v_scale=scale))
    else:
        caches = [c.astype(storage) for c in (key, value)]
        problem.update(key_cache=caches[0], value_cache=caches[1], reference_caches=caches)
    return problem


def nhd_pages(key_cache, value_cache):
    """The caches in one allocation [num_blocks, 2, block_size, num_kv_heads, head_size]
    (FlashInfer's "NHD" pages): `pages[:, 0]` and `pages[:, 1]` are strided "NHD" views of K
    and V, which the partitioned run reads in place (kv_layout="NHD")."""
    return np.ascontiguousarray(np.stack([key_cache.swapaxes(1, 2), value_cache.swapaxes(1, 2)],
                                         axis=1))


# The two runs of a case: (partition_size, kv_layout); the second reads nhd_pages' views.
RUNS = ((None, "HND"), (PARTITION_SIZE, "NHD"))


def run_label(partition_size, kv_layout: str, max_partitions: int) -> str:
    """An outcome's key: how the run split its sequences and read its caches."""
    return (("planned" if partition_size is None else f"{partition_size}-token") +
            f", {max_partitions} partition" + ("s" if max_partitions > 1 else "") +
            ("" if kv_layout == "HND" else f", {kv_layout}"))


def run_on_gpu(case: Case, rng) -> Outcome:
    """Decode `case`'s problem on the GPU in one partition and in several (RUNS), the second
    with its caches as strided "NHD" views; the relative error of each against the oracle. The
    kernel actually planned must be the case's."""
    import cupy

    from .api import plan_decode
    problem = make_problem(case, rng)
    key_ref, value_ref = problem["reference_caches"]
    ref, _ = paged_decode_reference(problem["query"], key_ref, value_ref,
                                    problem["block_tables"], problem["seq_lens"])
    device = [cupy.asarray(problem[k]) for k in ("query", "key_cache", "value_cache",
                                                 "block_tables", "seq_lens")]
    pages = cupy.asarray(nhd_pages(problem["key_cache"], problem["value_cache"]))
    outcome = Outcome()
    for partition_size, kv_layout in RUNS:
        if kv_layout == "NHD":
            device[1:3] = pages[:, 0], pages[:, 1]
        with dispatch.switches_set(dispatch.FORM_SWITCHES.get(case.form, {})):
            plan = plan_decode(*device, **problem["options"], partition_size=partition_size,
                               kv_layout=kv_layout, max_seq_len=max(SEQ_LENS), backend="gpu")
        if plan.kernel != case.kernel:
            outcome.failure = f"planned {plan.kernel}, not {case.kernel}"
            return outcome
        poisoned = cupy.full(problem["query"].shape, np.nan, dtype=problem["query"].dtype)
        out = cupy.asnumpy(plan.run(*device, out=poisoned)).astype(np.float64)
        # Both plans may split alike (the dense and wide forms' own plans split these lengths).
        label = run_label(partition_size, kv_layout, plan.max_partitions)
        outcome.errors[label] = _rel_error(out, ref) if np.isfinite(out).all() else float("nan")
    return outcome


def passed(case: Case, outcome: Outcome) -> bool:
    # NaN compares False: a non-finite output fails.
    return outcome.failure is None and bool(outcome.errors) and all(
        err <= case.bound for err in outcome.errors.values())


def run_cases(cases, runner, out=None, seed: int = SEED) -> int:
    """Run each case through `runner(case, rng) -> Outcome`, print one table row per case and
    a summary on `out` (stdout); 0 when every case passed, 1 otherwise. A runner that raises
    fails its case."""
    out = out or sys.stdout
    header = (f"{'kernel':<38} {'dtype':<9} {'kv':<13} {'head':>4} {'rows':>4}  "
              f"{'rel. error (partitions)':<58} {'bound':>8}  result")
    print(header, file=out)
    print("-" * len(header), file=out, flush=True)
    failures = 0
    for case in cases:
        rng = np.random.default_rng([seed, zlib.crc32(case.kernel.encode()), case.head_size,
                                     case.rows])
        try:
            outcome = runner(case, rng)
        except Exception as exc:  # a compile or launch error is this case's failure
            outcome = Outcome(failure=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        ok = passed(case, outcome)
        failures += not ok
        errors = ", ".join(f"{err:.1e} ({label})" for label, err in outcome.errors.items())
        print(f"{case.kernel:<38} {case.dtype:<9} {case.kv_format or '-':<13} "
              f"{case.head_size:>4} {case.rows:>4}  {errors:<58} {case.bound:>8.1e}  "
              f"{'ok' if ok else 'MISMATCH'}" + (f"  {outcome.failure}" if outcome.failure
                                                 else ""), file=out, flush=True)
    print(f"{len(cases) - failures}/{len(cases)} cases within bounds", file=out)
    return 1 if failures else 0


def no_gpu_reason() -> str | None:
    """Why the selftest cannot run here, or None."""
    if arrays.cupy_module() is None:
        return "cupy is not installed (pip install cupa[cuda12|cuda13|rocm])"
    if not arrays.gpu_available():
        return "cupy sees no GPU"
    return platform.hipcc_missing()


def main(args=None, out=None) -> int:
    out = out or sys.stdout
    why = no_gpu_reason()
    if why:
        print(f"cupa selftest needs a GPU it can compile for: {why}", file=sys.stderr)
        return NOTHING_TESTED_EXIT
    from .gpu.device import device_info
    info = device_info()
    print(f"cupa selftest on device {info.index}: {info.name} ({info.target.arch}, wavefront "
          f"{info.warp_size}, {'hipRTC' if platform.is_rocm() else 'NVRTC'})", file=out)
    cases = cases_for(info.target.arch)
    wanted = getattr(args, "kernel", None)
    if wanted:
        cases = [c for c in cases if wanted in c.kernel]
        if not cases:  # a mistyped name must not read as a pass
            print(f"cupa selftest: no kernel on {info.target.arch} has {wanted!r} in its name "
                  f"(the table's first column lists them)", file=sys.stderr)
            return NOTHING_TESTED_EXIT
    print(f"{len(cases)} cases; each kernel compiles on its first use (cached afterwards)",
          file=out, flush=True)
    return run_cases(cases, run_on_gpu, out)


# --- one variant, once per device, driver and kernel source -------------------------------------

CHECKS_FILE = "cupa_variant_checks.json"
_checked: dict = {}  # this process's answers, by cache key
_running: set = set()  # keys being checked now: the check's own decodes run the variant
_warned: set = set()  # variants already reported as failed in this process


def kernel_cache_dir() -> str:
    """cupy's kernel cache directory (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def driver_version() -> int:
    """The CUDA / HIP driver version cupy reports (0 where it cannot)."""
    cupy = arrays.cupy_module()
    try:
        return int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        return 0


def check_key(variant, info, driver: int) -> str:
    """What a stored answer is valid for: the device model, driver, variant, compile options
    and kernel source (an edit to the kernels or a new driver checks again)."""
    source = hashlib.sha1((catalogue.module_source(variant) + " ".join(
        info.target.runtime_options())).encode()).hexdigest()[:16]
    return f"{info.name}|{info.target.arch}|driver {driver}|{variant.partition_name}|{source}"


def _read_checks(path: str) -> dict:
    try:
        with open(path) as f:
            stored = json.load(f)
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: check again
        return {}


def _write_check(path: str, key: str, ok: bool) -> None:
    """Add one answer to the file: read, update, replace atomically. Two processes writing at
    once may lose one's entry, which only means that variant is checked again later."""
    stored = _read_checks(path)
    stored[key] = ok
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cupa-checks-", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(stored, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def case_for_variant(variant, arch: str) -> Case | None:
    """A selftest case whose dispatch reaches `variant` on `arch` (None if none does)."""
    for case in cases_for(arch):
        if case.variant == variant:
            return case
    return None


def check_variant_once(variant, device_info, *, runner=None, cache_dir: str | None = None,
                       driver: int | None = None) -> bool:
    """Whether `variant` gives correct results on this device: a tiny decode against the
    oracle, run the first time a process asks for a (device model, driver, variant, kernel
    source), remembered on disk (JSON under cupy's kernel cache directory) and in the process.

    runner(case, rng) -> Outcome runs the check (default: on the GPU). A variant no dispatch
    reaches on this device is reported as not passing, without running anything. A failing
    check is remembered too, so a bad kernel is not retried on every start; a new driver or
    kernel source makes a new key.
    """
    driver = driver_version() if driver is None else driver
    key = check_key(variant, device_info, driver)
    if key in _checked:
        return _checked[key]
    if key in _running:  # the check's own decode planning this variant
        return True
    path = os.path.join(cache_dir or kernel_cache_dir(), CHECKS_FILE)
    stored = _read_checks(path)
    if isinstance(stored.get(key), bool):
        _checked[key] = stored[key]
        return stored[key]
    case = case_for_variant(variant, device_info.target.arch)
    if case is None:
        ok = False
    else:
        _running.add(key)
        try:
            ok = passed(case, (runner or run_on_gpu)(case, np.random.default_rng(SEED)))
        except Exception:  # a kernel that does not compile or launch has not passed
            ok = False
        finally:
            _running.discard(key)
    _checked[key] = ok
    try:
        _write_check(path, key, ok)
    except OSError:  # a read-only cache directory: remembered for this process only
        pass
    return ok


def first_use_guard(device_info):
    """The planner's `trusted` hook for a device: on a real AMD device (HIP runtime), each
    matrix-core variant passes check_variant_once before it is first planned; one that fails
    is reported once per process and the planner uses the portable kernel instead. Everything
    else (NVIDIA, the emulated AMD build, the portable kernels) is trusted as it is."""
    def trusted(variant) -> bool:
        if not (device_info.hip_runtime and isinstance(variant, catalogue.DecodeMatrixVariant)):
            return True
        ok = check_variant_once(variant, device_info)
        if not ok and variant.partition_name not in _warned:
            _warned.add(variant.partition_name)
            warnings.warn(f"cupa: {variant.partition_name} gave wrong results in its first-use "
                          f"check on {device_info.name} ({device_info.target.arch}); using the "
                          f"portable kernel instead. Please run `python -m cupa selftest` and "
                          f"report its table.", RuntimeWarning, stacklevel=2)
        return ok
    return trusted

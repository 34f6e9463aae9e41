"""cupa's kernels built for the CPU (the AMD targets' emulated builds and the NVIDIA targets'
own) under AddressSanitizer and UndefinedBehaviorSanitizer, every array in guarded memory
(tests/helpers/sanitized_run.py, guarded_memory.py): a read or write outside an array the
kernel was given, an overrun of shared memory or the stack, a signed overflow or an
out-of-range shift fails the test with the sanitizer's report.

The inputs are the ones no host check sees, because device tables are never read back: block
ids outside [0, num_blocks) in the used columns of a table, lengths past the table's capacity or
negative, and cache-write slots that are negative or past the cache. cupa's contract for them
(docs/bad_inputs_api.md): the tokens of a bad block id are left out, a length is clamped to
[0, capacity], a bad slot is skipped, and nothing outside the arrays is ever touched. Each
placement runs once with every array flush against its upper guard (reads past the end fault)
and once against its lower guard (reads before the start fault).

GPU twins: tests/gpu/test_gpu_sanitizer.py (compute-sanitizer on NVIDIA) and
tests/gpu/test_gpu_decode.py's tests of the same tables; this file covers the AMD builds
(wave64 and wave32, MFMA and WMMA emulation), where no AMD GPU is, and the NVIDIA builds in CI,
where no GPU is.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, rel_error
from cuda_on_cpu import compiler_missing
from fuzz_draws import compare, draw, fresh_seed, problem
from guarded_memory import PLACEMENTS
from offline_compile import need_compiler
from sanitized_run import (SanitizerFinding, asan_cannot_start, run_sanitized,
                           sanitizers_missing)

# The AMD builds (emulated) and the NVIDIA ones (tensor-core PTX by the runner's shim).
TARGETS = ("gfx90a", "gfx942", "gfx1100", "gfx1201", "sm_80", "sm_90")


@pytest.fixture(autouse=True)
def sanitizers():
    """g++ and its ASan runtime: a skip without them, a failure in CI (which installs them). A
    runtime that cannot start on this machine's kernel is a skip with its message."""
    need_compiler(compiler_missing() or sanitizers_missing())
    cause = asan_cannot_start()
    if cause:
        pytest.skip(cause)


# --- the harness catches what it is for ----------------------------------------------------

PROBE_SOURCE = r"""
extern "C" __global__ void read_at(const float* x, int i, float* out) { out[0] = x[i]; }
extern "C" __global__ void shared_overrun(float* out) {
    __shared__ float s[32];
    float* p = s;  // through a pointer, as the kernels address their LDS: ASan sees it
    p[threadIdx.x] = 1.0f;  // launched with 64 threads
    __syncthreads();
    out[threadIdx.x] = s[0];
}
extern "C" __global__ void add_one(int x, int* out) { out[0] = x + 1; }
"""


def probe(tmp_path, name, block, args, placement="end"):
    return run_sanitized({"kind": "kernel", "placement": placement, "source": PROBE_SOURCE,
                          "name": name, "grid": (1,), "block": (block,), "args": args},
                         tmp_path)


def test_the_harness_reports_reads_outside_an_array(tmp_path):
    """One element past the end (placed against the upper guard) and one before the start
    (placed against the lower guard) each fault, named by the array; an index inside reads."""
    x = np.arange(16, dtype=np.float32)
    out = np.zeros(1, np.float32)
    got = probe(tmp_path, "read_at", 1, [("x", x, False), ("i", np.int32(15), False),
                                        ("out", out, True)])
    assert got["out"][0] == 15.0
    with pytest.raises(SanitizerFinding, match="0 bytes past the end of x"):
        probe(tmp_path, "read_at", 1, [("x", x, False), ("i", np.int32(16), False),
                                      ("out", out, True)])
    with pytest.raises(SanitizerFinding, match="4 bytes before x"):
        probe(tmp_path, "read_at", 1, [("x", x, False), ("i", np.int32(-1), False),
                                      ("out", out, True)], placement="start")


def test_the_harness_reports_shared_memory_overruns_and_signed_overflow(tmp_path):
    out = np.zeros(64, np.float32)
    # UBSan's object-size check or ASan's redzone, whichever sees it first.
    overrun = r"insufficient space for an object|global-buffer-overflow"
    with pytest.raises(SanitizerFinding, match=overrun):
        probe(tmp_path, "shared_overrun", 64, [("out", out, True)])
    result = np.zeros(1, np.int32)
    assert probe(tmp_path, "add_one", 1, [("x", np.int32(41), False),
                                          ("out", result, True)])["out"][0] == 42
    with pytest.raises(SanitizerFinding, match="signed integer overflow"):
        probe(tmp_path, "add_one", 1, [("x", np.int32(2**31 - 1), False),
                                       ("out", result, True)])


# --- decode: block tables and lengths no host check sees ------------------------------------

BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, GROUP = 16, 128, 2, 8
WIDTH = 20  # table columns: a capacity of 320 tokens, five 64-token partitions
PARTITION = 64


def hostile_tables(rng):
    """A problem whose device tables hold what only the kernels can guard against. Per
    sequence: (length, {column: bad id}); every other used column has a block of its own, every
    slot that holds no token is NaN, and the columns past a sequence's blocks name NaN blocks of
    the cache (read one block too many and the output is NaN)."""
    layout = [(0, {}), (1, {}),
              (300, {0: -1, 7: "num_blocks", 18: 2**30}),  # 18: the last block, a tail
              (WIDTH * BLOCK_SIZE + 1000, {5: -2**31, 19: "num_blocks+3"}),  # clamped: 320
              (-7, {}),  # clamped to 0
              (150, {4: -2, 9: 2**31 - 1}),
              (PARTITION, {3: -1}),  # the partition's last block
              (200, {})]
    used = [(s, c) for s, (length, bad) in enumerate(layout)
            for c in range(-(-max(min(length, WIDTH * BLOCK_SIZE), 0) // BLOCK_SIZE))
            if c not in bad]
    num_blocks = len(used) + 4  # four blocks no table reaches with data: NaN
    ids = rng.permutation(num_blocks)
    tables = np.empty((len(layout), WIDTH), np.int32)
    tables[:] = rng.choice(ids[len(used):], size=tables.shape)  # NaN blocks past each end
    for (s, c), block in zip(used, ids):
        tables[s, c] = block
    for s, (_, bad) in enumerate(layout):
        for c, bad_id in bad.items():
            tables[s, c] = {"num_blocks": num_blocks,
                            "num_blocks+3": num_blocks + 3}.get(bad_id, bad_id)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    key = np.full(shape, np.nan, np.float32)
    value = np.full(shape, np.nan, np.float32)
    lengths = np.array([length for length, _ in layout], np.int32)
    clamped = np.clip(lengths, 0, WIDTH * BLOCK_SIZE)
    for s, c in used:
        tokens = min(BLOCK_SIZE, clamped[s] - c * BLOCK_SIZE)
        rows = (NUM_KV_HEADS, tokens, HEAD_SIZE)
        key[tables[s, c], :, :tokens] = rng.standard_normal(rows)
        value[tables[s, c], :, :tokens] = rng.standard_normal(rows)
    query = rng.standard_normal((len(layout), NUM_KV_HEADS * GROUP, HEAD_SIZE))
    return query, key, value, tables, lengths, clamped


def reference_without_bad_blocks(query, key, value, tables, clamped):
    """The reference over each sequence's readable tokens: its table without the columns of
    bad ids, its length short by their tokens. Without ALiBi, a window or several new tokens
    the positions do not enter the softmax, so leaving tokens out is this."""
    num_blocks = key.shape[0]
    kept_tables = np.zeros_like(tables)
    kept_lens = np.zeros_like(clamped)
    for s, length in enumerate(clamped):
        columns = -(-int(length) // BLOCK_SIZE)
        good = [c for c in range(columns) if 0 <= tables[s, c] < num_blocks]
        kept_tables[s, :len(good)] = tables[s, good]
        kept_lens[s] = sum(min(BLOCK_SIZE, length - c * BLOCK_SIZE) for c in good)
    return paged_decode_reference(query, key, value, kept_tables, kept_lens)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("arch", TARGETS)
def test_decode_leaves_bad_block_ids_out_and_clamps_lengths(rng, tmp_path, arch, kernel,
                                                            placement):
    """The matrix-core (AMD) or tensor-core (NVIDIA) kernel (auto) and the portable one,
    planned in 64-token partitions for device tables, as cupa.decode plans them: merged by the
    reduce, or on sm_90's tensor-core kernel within thread-block clusters."""
    query, key, value, tables, lengths, clamped = hostile_tables(rng)
    query, key, value = (a.astype(np.float16) for a in (query, key, value))
    merge = "cluster" if (arch, kernel) == ("sm_90", "auto") else "reduce"
    result = run_sanitized({
        "kind": "decode", "arch": arch, "placement": placement,
        "environ": {"CUPA_KERNEL": kernel, "CUPA_MERGE": merge},
        "arrays": dict(query=query, key_cache=key, value_cache=value, block_tables=tables,
                       seq_lens=lengths),
        "options": dict(partition_size=PARTITION, max_seq_len=WIDTH * BLOCK_SIZE,
                        hints_from_arrays=False)}, tmp_path)
    matrix_cores = "DecodeMatrixVariant" in result["variant"] or "DecodeMmaVariant" in \
        result["variant"]
    assert matrix_cores == (kernel == "auto")
    ref, ref_lse = reference_without_bad_blocks(query, key, value, tables, clamped)
    out = result["out"].astype(np.float64)
    unfinished = [s for s in range(len(lengths)) if not np.isfinite(out[s]).all()]
    assert not unfinished, f"NaN or infinity in sequences {unfinished}, {result['variant']}"
    for s in range(len(lengths)):
        error = rel_error(out[s], ref[s])
        assert error < REL_BOUND["float16"], f"sequence {s}: {error:.3g}, {result['variant']}"
        finite = np.isfinite(ref_lse[s])
        assert np.array_equal(np.isfinite(result["lse"][s]), finite)
        assert rel_error(result["lse"][s][finite], ref_lse[s][finite]) < REL_BOUND["float16"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch, kernel", [("gfx942", "auto"), ("gfx1100", "portable"),
                                          ("sm_80", "auto"), ("sm_90", "auto")])
def test_decode_reads_strided_views_inside_them(rng, tmp_path, arch, kernel, placement):
    """The same hostile tables with the caches as "NHD" views, K and V interleaved in one
    allocation per block and rows padded (poison between the views' elements): the stride
    arithmetic stays inside each view, a view's last row flush against the guard."""
    query, key, value, tables, lengths, clamped = hostile_tables(rng)
    query, key, value = (a.astype(np.float16) for a in (query, key, value))
    result = run_sanitized({
        "kind": "decode", "arch": arch, "placement": placement,
        "environ": {"CUPA_KERNEL": kernel},
        "arrays": dict(query=query, key_cache=key, value_cache=value, block_tables=tables,
                       seq_lens=lengths),
        "kv_view": dict(kv_layout="NHD", interleaved=True, row_pad=8),
        "options": dict(kv_layout="NHD", partition_size=PARTITION,
                        max_seq_len=WIDTH * BLOCK_SIZE, hints_from_arrays=False)}, tmp_path)
    ref, _ = reference_without_bad_blocks(query, key, value, tables, clamped)
    assert rel_error(result["out"], ref) < REL_BOUND["float16"], result["variant"]


FUZZ_DRAWS = 8


def test_fuzz_draws_under_the_sanitizers(tmp_path):
    """The fuzz's random configurations (fp8 formats, every head size, GQA, block sizes,
    ALiBi, windows, soft caps, sinks, new tokens, garbage ids past each sequence's blocks,
    partition sizes, the portable kernel now and then) at random AMD targets, sanitized and
    guarded. A fresh seed a run, printed; CUPA_FUZZ_SEED=<seed> replays one."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    failures = []
    for i in range(FUZZ_DRAWS):
        d, arch, placement = draw(rng), str(rng.choice(TARGETS)), str(rng.choice(PLACEMENTS))
        p = problem(d)
        names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
        options = p.case.options()
        arrays = {**dict(zip(names, p.args)),
                  **{k: options.pop(k) for k in ("query_start_loc", "alibi_slopes", "sinks")}}
        result = run_sanitized({
            "kind": "decode", "arch": arch, "placement": placement,
            "environ": {"CUPA_KERNEL": d.kernel}, "arrays": arrays,
            "options": dict(options, **p.fp8, partition_size=d.partition_size)},
            tmp_path / str(i))
        found = compare(p, result["out"], result["lse"])
        if found is not None:
            failures.append(f"{arch}, {placement}, {result['variant']}: {found}: {d}")
    assert not failures, (f"{len(failures)} of {FUZZ_DRAWS} configurations failed (seed {seed})"
                          ":\n" + "\n".join(failures))


# --- the cache write: slots no host check sees ---------------------------------------------

@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kv_format", [None, "fp8_e4m3", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("arch", ["gfx942", "gfx1100"])
def test_cache_write_skips_bad_slots(rng, tmp_path, arch, kv_format, placement):
    """Device slots negative or past the cache are skipped (padding tokens, or garbage): the
    rows of the good slots land bit for bit (fp8: cupa.quantize_fp8's codes), every other slot
    of the cache keeps its bytes, and nothing outside the cache is written."""
    num_blocks, heads, block_size, head_size = 6, 2, 16, 128
    num_slots = num_blocks * block_size
    slots = np.array([3, -1, num_slots, 17, 2**40, -2**63, num_slots - 1, 2**63 - 1,
                      num_slots + 5, 40], np.int64)
    good = (slots >= 0) & (slots < num_slots)
    rows = (len(slots), heads, head_size)
    key, value = (rng.standard_normal(rows).astype(np.float16) for _ in range(2))
    cache_shape = (num_blocks, heads, block_size, head_size)
    k_scale = v_scale = None
    if kv_format is None:
        caches = [rng.standard_normal(cache_shape).astype(np.float16) for _ in range(2)]
        encoded = key, value
    else:
        caches = [rng.integers(0, 256, cache_shape, dtype=np.uint8) for _ in range(2)]
        k_scale, v_scale = (rng.uniform(1 / 8, 1 / 2, heads).astype(np.float32)
                            for _ in range(2))
        encoded = [cupa.quantize_fp8(rows_.astype(np.float32), kv_format, scale[:, None])
                   for rows_, scale in ((key, k_scale), (value, v_scale))]
    result = run_sanitized({
        "kind": "cache_write", "arch": arch, "placement": placement,
        "arrays": dict(key=key, value=value, key_cache=caches[0], value_cache=caches[1],
                       slots=slots),
        "kv_format": kv_format, "k_scale": k_scale, "v_scale": v_scale}, tmp_path)
    for name, before, rows_ in zip(("key_cache", "value_cache"), caches, encoded):
        expected = before.copy()
        for token in np.flatnonzero(good):
            block, offset = divmod(int(slots[token]), block_size)
            expected[block, :, offset] = rows_[token]
        assert np.array_equal(result[name].view(np.uint8), expected.view(np.uint8)), name


# --- multi-token decode: a query_start_loc no host check sees ----------------------------

@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("arch", ["gfx942", "gfx1201", "sm_90"])
def test_decode_clamps_query_start_loc_into_the_query(rng, tmp_path, arch, kernel):
    """Sequences 0 and 1 own the query's four rows; the entries after them are the extremes
    of int32. The kernels clamp each end of a span into the query array, so the bad sequences
    own no row here: nothing outside the arrays is touched, no arithmetic overflows (a span's
    raw difference would: -2^31 - 4), and the good sequences' rows are the reference's."""
    query, key, value, tables, lengths, _ = hostile_tables(rng)
    tables = tables[[7, 7, 7, 7]]  # sequence 7's table: 200 tokens, every block id good
    lengths = np.array([200, 137, 200, 200], np.int32)
    query = rng.standard_normal((4, NUM_KV_HEADS * GROUP, HEAD_SIZE)).astype(np.float16)
    key, value = key.astype(np.float16), value.astype(np.float16)
    # Sequence 2 spans [4, 2^31 - 1), sequence 3 [2^31 - 1, -2^31): both clamp to [4, 4).
    starts = np.array([0, 2, 4, 2**31 - 1, -2**31], np.int32)
    result = run_sanitized({
        "kind": "decode", "arch": arch, "placement": "end",
        "environ": {"CUPA_KERNEL": kernel},
        "arrays": dict(query=query, key_cache=key, value_cache=value, block_tables=tables,
                       seq_lens=lengths, query_start_loc=starts),
        "options": dict(partition_size=PARTITION, max_seq_len=WIDTH * BLOCK_SIZE,
                        max_query_len=2, hints_from_arrays=False)}, tmp_path)
    ref, _ = paged_decode_reference(query, key, value, tables[:2], lengths[:2],
                                    query_start_loc=starts[:3])
    assert rel_error(result["out"], ref) < REL_BOUND["float16"], result["variant"]

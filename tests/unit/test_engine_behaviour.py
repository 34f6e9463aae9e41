"""The example engine's scheduling, finish reasons and platform choices, on the CPU.

The numpy backend runs the whole engine; what only a GPU can run (graph capture, hipBLAS, the
bfloat16 decision on ROCm) is checked through its bookkeeping with simulated platforms and fake
objects. tests/gpu/test_gpu_examples.py runs the real thing on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import types
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cupa

ROOT = Path(__file__).resolve().parents[2]

from llm import engine as engine_module  # noqa: E402
from llm import step_attention  # noqa: E402
from llm.engine import (ADMISSION_RESERVE_BLOCKS, CacheTooSmallWarning, Engine,  # noqa: E402
                        blocks_to_run_together)
from llm.graphs import DecodeGraphs, StepLayout, StepRows, table_width  # noqa: E402
from llm.runtime import default_num_blocks, load_model, make_cache  # noqa: E402
from llm.sampling import SamplingParams  # noqa: E402
from make_tiny_llama import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny float32 Llama checkpoint (2 layers, 4 / 2 heads of 64, vocab 320)."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=False)


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The same model with a 12-token context (max_position_embeddings), to reach the model's
    length limit with a roomy cache."""
    path = make_checkpoint(tmp_path_factory.mktemp("tiny") / "short", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 12
    (path / "config.json").write_text(json.dumps(config))
    return path


def numpy_engine(path, num_blocks, block_size, **engine_kwargs):
    model, _ = load_model(path, backend="numpy", progress=False)
    cache = make_cache(model, num_blocks, block_size, "numpy")
    return Engine(model, cache, backend="numpy", **engine_kwargs)


def generate(engine, prompts, max_new_tokens, **params):
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **params))
            for p, n in zip(prompts, max_new_tokens)]
    engine.run()
    return seqs


# --- goal: the default cache admits every prompt together ---------------------------------------

def test_blocks_to_run_together_counts_the_admission_reserve():
    # 3 + 8 and 4 + 8 tokens: one block of 16 each at full length, plus one reserve block each.
    assert ADMISSION_RESERVE_BLOCKS == 1
    assert blocks_to_run_together([11, 12], 16) == 2 + 2
    assert blocks_to_run_together([16, 17, 1], 16) == (1 + 2 + 1) + 3
    assert blocks_to_run_together([], 16) == 0


def test_default_cache_decodes_two_prompts_in_one_batch(tiny):
    # The brief's case: 2 prompts x 8 new tokens. One prefill gives each its first token, so
    # running together they need 7 decode steps; one after the other they needed 14.
    prompts, new = [[1, 2, 3], [1, 5, 6, 7]], 8
    model, _ = load_model(tiny, backend="numpy", progress=False)
    blocks = default_num_blocks(model, 16, [len(p) + new for p in prompts], "numpy")
    engine = Engine(model, make_cache(model, blocks, 16, "numpy"), backend="numpy")
    seqs = generate(engine, prompts, [new, new])
    assert engine.stats.decode_steps <= new
    assert engine.stats.decode_steps == new - 1 and engine.stats.preemptions == 0
    assert [s.finish_reason for s in seqs] == ["length", "length"]
    roomy = generate(numpy_engine(tiny, 64, 16), prompts, [new, new])
    assert [s.output_ids for s in seqs] == [s.output_ids for s in roomy]
    assert engine.cache.num_free_blocks == blocks


@pytest.mark.parametrize("case", range(6))
def test_default_cache_admits_every_prompt_at_the_first_step(tiny, case, rng):
    block_size = int(rng.choice([8, 16, 32]))
    count = int(rng.integers(2, 7))
    prompts = [[1] + rng.integers(3, 300, size=int(rng.integers(0, 30))).tolist()
               for _ in range(count)]
    new = rng.integers(1, 20, size=count).tolist()
    model, _ = load_model(tiny, backend="numpy", progress=False)
    blocks = default_num_blocks(model, block_size,
                                [len(p) + n for p, n in zip(prompts, new)], "numpy")
    engine = Engine(model, make_cache(model, blocks, block_size, "numpy"), backend="numpy")
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, new)]
    engine.step()  # the first step is one prefill of everything admitted
    assert not engine.waiting and all(len(s.output_ids) == 1 for s in seqs)
    # max_new_tokens=1 sequences are done after their prefill; all others run.
    assert len(engine.running) == sum(n > 1 for n in new)
    engine.run()
    assert engine.stats.preemptions == 0
    assert engine.stats.decode_steps == max(new) - 1


def test_without_the_reserve_the_last_prompt_waits(tiny):
    # The blocks at full length alone (the old default) make the second prompt wait for the
    # first to finish: the reserve is what the default has to count.
    prompts, new = [[1, 2, 3], [1, 5, 6, 7]], [8, 8]
    engine = numpy_engine(tiny, blocks_to_run_together([11, 12], 16) - 2, 16)
    generate(engine, prompts, new)
    assert engine.stats.decode_steps == 2 * 7


# --- goal: a full cache reports its own finish reason -------------------------------------------

def test_sequence_alone_in_a_full_cache_stops_with_cache_too_small(tiny):
    # One block of 8 tokens: the 3-token prompt's decode steps write positions 3..7, then the
    # next token has nowhere to go. Before, this reported 'length'.
    prompt, streamed = [1, 17, 42], []
    engine = numpy_engine(tiny, 1, 8, on_token=lambda seq, token: streamed.append(token))
    with pytest.warns(CacheTooSmallWarning, match=r"too small \(1 blocks of 8 tokens\).*"
                                                  r"raise num_blocks.*at least 3") as record:
        (seq,) = generate(engine, [prompt], [16])
    assert len(record) == 1 and "stopped after 6 of 16 new tokens" in str(record[0].message)
    assert seq.finish_reason == "cache_too_small"
    (roomy,) = generate(numpy_engine(tiny, 8, 8), [prompt], [16])
    assert seq.output_ids == roomy.output_ids[:6]
    assert streamed == seq.output_ids + [None]  # the stream is told the sequence ended
    assert engine.cache.num_free_blocks == 1


def test_full_cache_after_preemption_reports_cache_too_small(tiny):
    # 4 blocks of 8: both 3-token prompts are admitted, grow to 2 blocks each, then the newest is
    # preempted; each later runs alone until it fills all 4 blocks.
    prompts = [[1, 17, 42], [1, 5, 9]]
    engine = numpy_engine(tiny, 4, 8)
    with pytest.warns(CacheTooSmallWarning) as record:
        seqs = generate(engine, prompts, [40, 40])
    assert engine.stats.preemptions >= 1
    assert [s.finish_reason for s in seqs] == ["cache_too_small"] * 2
    assert sorted(str(w.message).split()[1] for w in record) == ["0", "1"]
    # Each held the whole cache (32 tokens) and one sampled token more.
    assert [s.num_tokens for s in seqs] == [33, 33]
    roomy = generate(numpy_engine(tiny, 32, 8), prompts, [40, 40])
    assert [s.output_ids for s in seqs] == [r.output_ids[:30] for r in roomy]


def test_prompt_larger_than_the_cache_warns(tiny):
    engine = numpy_engine(tiny, 2, 8)
    with pytest.warns(CacheTooSmallWarning, match="at least 7"):
        long, short = generate(engine, [list(range(3, 50)), [1, 2]], [4, 4])
    assert long.finish_reason == "cache_too_small" and long.output_ids == []
    assert short.finish_reason == "length" and len(short.output_ids) == 4


def test_model_context_limit_is_length_without_warning(short_context):
    engine = numpy_engine(short_context, 16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheTooSmallWarning)
        (seq,) = generate(engine, [[1, 2, 3]], [30])
    assert seq.finish_reason == "length" and seq.num_tokens == 12


# --- goal: one write-then-attend for every step -------------------------------------------------

class RecordingCache:
    """Stands in for PagedKVCache.write; records the calls."""

    def __init__(self):
        self.calls = []

    def write(self, layer, slots, key, value):
        self.calls.append(("write", layer, np.asarray(slots).tolist(), key.dtype, value.dtype))


def test_write_then_attend_writes_before_attending():
    cache = RecordingCache()

    def attention(layer, q, k, v):
        cache.calls.append(("attend", layer))
        return q * 2

    attend = step_attention.write_then_attend(cache, np.array([4, -1]), np.dtype(np.float16),
                                              attention)
    q = np.ones((2, 4, 8), np.float32)
    k = v = np.zeros((2, 2, 8), np.float32)
    np.testing.assert_array_equal(attend(1, q, k, v), q * 2)
    assert cache.calls == [("write", 1, [4, -1], np.float16, np.float16), ("attend", 1)]


def test_every_step_kind_goes_through_write_then_attend(tiny, monkeypatch):
    calls = []
    original = step_attention.write_then_attend

    def counting(cache, slots, kv_dtype, attention):
        calls.append(len(np.asarray(slots)))
        return original(cache, slots, kv_dtype, attention)

    monkeypatch.setattr(engine_module, "write_then_attend", counting)
    for attention in ("paged", "naive"):
        calls.clear()
        generate(numpy_engine(tiny, 16, 8, attention=attention), [[1, 2, 3], [4, 5]], [3, 3])
        assert calls == [5, 2, 2]  # the prefill's 5 tokens, then two decode steps of 2 rows


def test_eager_steps_plan_once_per_batch_size_and_planned_length(tiny, monkeypatch):
    """An eager step's attention is one cupa.plan_decode plan, kept while the batch size and the
    planned length (the longest sequence rounded up to PLAN_HINT_STEP) stay the same, over
    block tables as wide as that length; the tokens are those of a roomier engine that plans
    afresh (a cache with larger blocks, so other table widths and plans)."""
    planned = []
    real = cupa.plan_decode

    def recording(query, key_cache, value_cache, block_tables, seq_lens, **kwargs):
        planned.append((query.shape[0], kwargs["max_seq_len"], block_tables.shape[1]))
        return real(query, key_cache, value_cache, block_tables, seq_lens, **kwargs)

    monkeypatch.setattr(cupa, "plan_decode", recording)
    step = engine_module.PLAN_HINT_STEP
    # 250 + 10 tokens cross one planned length; the second sequence stops after 4, so the batch
    # shrinks once too.
    prompts, new = [list(range(1, 251)), [7, 8]], [10, 4]
    engine = numpy_engine(tiny, 64, 8, graphs=False)
    seqs = generate(engine, prompts, new)
    assert planned == [(2, step, step // 8), (1, step, step // 8), (1, 2 * step, 2 * step // 8)]
    assert engine.stats.decode_steps == 9
    monkeypatch.setattr(cupa, "plan_decode", real)
    other = generate(numpy_engine(tiny, 32, 32, graphs=False), prompts, new)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in other]


def test_baseline_attention_moved_out_of_the_engine():
    from llm.baseline_attention import naive_decode_attention
    assert naive_decode_attention.__module__ == "llm.baseline_attention"
    assert "def naive_decode_attention" not in (ROOT / "examples/llm/engine.py").read_text()


def test_graph_forward_matches_the_eager_step_on_numpy(tiny):
    """DecodeGraphs._forward (what a graph captures) run on numpy with a fake plan that calls
    cupa.decode: the same logits and the same cache contents as an eager decode step, with a
    padding row that writes nothing."""
    prompts = [[1, 17, 42], [1, 5, 9, 200, 33], [7]]
    twins = []
    for _ in range(2):
        engine = numpy_engine(tiny, 16, 8, graphs=False)
        for p in prompts:
            engine.add_request(p, SamplingParams(max_new_tokens=4))
        engine.step()  # prefill
        twins.append(engine)
    eager, graph = twins

    logged = []
    eager.on_logits = lambda seqs, logits: logged.append(np.array(logits))
    eager.step()  # one eager decode step

    model, cache = graph.model, graph.cache
    seqs = list(graph.running)
    slots = cache.extend([s.seq_id for s in seqs], 1)
    runner = DecodeGraphs.__new__(DecodeGraphs)  # no GPU: only what _forward reads
    runner._cupy, runner.model, runner.cache = np, model, cache
    runner.kv_dtype, runner.query_dtype, runner.fp8 = step_attention.paged_decode_formats(model,
                                                                                         cache)
    runner.gemm = lambda x, w: (x.astype(w.dtype) @ w.T).astype(np.float32)
    width = table_width(model.config.max_seq_len, cache.block_size, cache.num_blocks)
    layout = StepLayout(max_batch=4, width=width)
    inputs = layout.views(np.zeros(layout.nbytes, np.uint8), 4)  # bucket 4: one padding row
    StepRows.gather(seqs, slots, cache).pack_into(inputs)

    class NumpyPlan:
        def run(self, query, key_cache, value_cache, block_tables, seq_lens):
            return cupa.decode(query, key_cache, value_cache, block_tables, seq_lens,
                               scale=model.scale, backend="numpy")

    logits, argmax = runner._forward(inputs, NumpyPlan())
    np.testing.assert_allclose(logits[:3], logged[0], rtol=1e-5, atol=1e-5)
    assert argmax[:3].tolist() == [s.output_ids[-1] for s in eager.running]
    # The rows come from GEMMs of 4 rows (the bucket) against the eager step's 3, which BLAS may
    # sum in another order (numpy 2.4: 2% of the elements differ in the last bits): equal to
    # float32 rounding, while a padding row's write or a wrong slot would differ by O(1).
    for layer in range(cache.num_layers):
        np.testing.assert_allclose(cache.key_cache(layer), eager.cache.key_cache(layer),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cache.value_cache(layer), eager.cache.value_cache(layer),
                                   rtol=1e-5, atol=1e-5)


# --- goal: graphs on ROCm (bookkeeping; the capture itself needs a GPU) ------------------------

from llm import blas, runtime  # noqa: E402
from llm.cublas import CUBLAS, GraphGemm  # noqa: E402
from llm.hipblas import HIPBLAS, HipblasGraphGemm  # noqa: E402


def test_gpu_is_hip_reads_cupys_runtime_flag(monkeypatch):
    for flag in (True, False):
        fake = type(sys)("cupy")
        fake.cuda = type(sys)("cupy.cuda")
        fake.cuda.runtime = type(sys)("cupy.cuda.runtime")
        fake.cuda.runtime.is_hip = flag
        monkeypatch.setitem(sys.modules, "cupy", fake)
        assert blas.gpu_is_hip() is flag
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    assert blas.gpu_is_hip() is False


def test_graph_gemm_type_follows_the_platform(monkeypatch):
    assert blas.graph_gemm_type(hip=True) is HipblasGraphGemm
    assert blas.graph_gemm_type(hip=False) is GraphGemm
    for simulated, library in ((True, HipblasGraphGemm), (False, GraphGemm)):
        monkeypatch.setattr(blas, "gpu_is_hip", lambda simulated=simulated: simulated)
        assert blas.graph_gemm_type() is library
    assert GraphGemm.api is CUBLAS and HipblasGraphGemm.api is HIPBLAS


def test_hipblas_enums_are_hipblas_not_cublas():
    # hipblas.h: HIPBLAS_OP_N/T 111/112, HIPBLAS_COMPUTE_32F 2, HIPBLAS_GEMM_DEFAULT 160;
    # hipDataType (library_types.h of HIP) numbers R_32F/R_16F/R_16BF as CUDA does: 0, 2, 14.
    assert (HIPBLAS.op_n, HIPBLAS.op_t, HIPBLAS.compute_32f, HIPBLAS.gemm_default) == \
        (111, 112, 2, 160)
    assert (CUBLAS.op_n, CUBLAS.op_t, CUBLAS.compute_32f, CUBLAS.gemm_default) == (0, 1, 68, -1)
    for api in (CUBLAS, HIPBLAS):
        assert [api.data_type(t) for t in ("float32", "float16", "bfloat16")] == [0, 2, 14]
        assert not api.supports("float64")
    assert HIPBLAS.gemm_ex[0] == "hipblasGemmEx_v2"  # ROCm 6's hipDataType entry point first


class FakeFunction:
    """A ctypes function stand-in: argtypes / restype settable, calls recorded."""

    def __init__(self, result=0, body=None):
        self.result, self.body, self.calls = result, body, []

    def __call__(self, *args):
        self.calls.append(args)
        if self.body is not None:
            self.body(*args)
        return self.result


class FakeLibrary:
    def __init__(self, names):
        for name in names:
            setattr(self, name, FakeFunction())


@pytest.mark.parametrize("exported, chosen", [
    (["hipblasGemmEx_v2", "hipblasGemmEx"], "hipblasGemmEx_v2"),
    (["hipblasGemmEx"], "hipblasGemmEx"),
    ([], None),
])
def test_declare_picks_the_first_exported_gemm(exported, chosen):
    lib = FakeLibrary(["hipblasCreate", "hipblasDestroy", "hipblasSetStream"] + exported)
    gemm = blas._declare(lib, HIPBLAS)
    assert gemm is (getattr(lib, chosen) if chosen else None)
    if chosen:
        assert len(gemm.argtypes) == 19 and lib.hipblasSetStream.argtypes is not None
        assert not hasattr(lib, "hipblasSetWorkspace")  # optional: absent is fine


def _column_major(pointer, dtype, rows, cols, ld):
    """A view of a column-major rows x cols matrix with leading dimension ld at `pointer`."""
    count = ld * (cols - 1) + rows
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(pointer)
    flat = np.frombuffer(raw, dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols),
                                           (dtype.itemsize, ld * dtype.itemsize))


def _address(pointer) -> int:
    """A pointer argument as ctypes converts it for a c_void_p parameter (an int or a c_void_p
    both arrive as an address)."""
    return pointer.value if isinstance(pointer, ctypes.c_void_p) else int(pointer)


def reference_gemm_ex(api):
    """A host GemmEx with `api`'s enums: C = alpha op(A) op(B) + beta C, column-major, as the
    BLAS computes it (from the raw pointers GraphGemm passes)."""
    types = {code: np.dtype(name if name != "bfloat16" else ml_dtypes.bfloat16)
             for name, code in api.data_types}

    def gemm(handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c,
             c_type, ldc, compute, algo):
        assert (compute, algo) == (api.compute_32f, api.gemm_default)
        op = {api.op_n: False, api.op_t: True}
        a_rows, a_cols = (k, m) if op[transa] else (m, k)
        b_rows, b_cols = (n, k) if op[transb] else (k, n)
        A = _column_major(_address(a), types[a_type], a_rows, a_cols, lda).astype(np.float32)
        B = _column_major(_address(b), types[b_type], b_rows, b_cols, ldb).astype(np.float32)
        A, B = (A.T if op[transa] else A), (B.T if op[transb] else B)
        C = _column_major(_address(c), types[c_type], m, n, ldc)
        # As in BLAS, a zero beta means C is not read (it may hold anything, NaN included).
        scaled = beta._obj.value * C if beta._obj.value else 0
        C[...] = alpha._obj.value * (A @ B) + scaled
    return gemm


class HostArray(np.ndarray):
    """numpy with cupy's `.data.ptr`, so GraphGemm's pointer arithmetic runs on the host."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


HOST_CUPY = types.SimpleNamespace(
    ascontiguousarray=lambda a, dtype=None: np.ascontiguousarray(a, dtype=dtype).view(HostArray),
    empty=lambda shape, dtype: np.zeros(shape, dtype).view(HostArray))


@pytest.mark.parametrize("gemm_type", [GraphGemm, HipblasGraphGemm])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_graph_gemm_arguments_compute_x_times_weight_transposed(gemm_type, dtype, rng):
    """The GemmEx arguments (operations, sizes, leading dimensions, types) of both libraries,
    executed by a host GemmEx that reads them as the BLAS does."""
    gemm = gemm_type.__new__(gemm_type)  # without a GPU: only what __call__ reads
    gemm._cupy, gemm._handle = HOST_CUPY, ctypes.c_void_p(1)
    gemm._set_call_state()
    gemm._gemm = FakeFunction(body=reference_gemm_ex(gemm_type.api))
    weight_dtype = np.dtype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
    # Device arrays as the fake cupy makes them (a float32 x of the weight's dtype is used as is).
    x = rng.standard_normal((5, 96), dtype=np.float32).view(HostArray)
    w = rng.standard_normal((40, 96), dtype=np.float32).astype(weight_dtype).view(HostArray)
    y = gemm(x, w)
    assert y.dtype == np.float32 and y.shape == (5, 40)
    want = x.astype(weight_dtype).astype(np.float32) @ w.astype(np.float32).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
    assert len(gemm._gemm.calls) == 1
    assert gemm(x[:0], w).shape == (0, 40) and len(gemm._gemm.calls) == 1  # no call for 0 rows
    with pytest.raises(TypeError, match="float64"):
        gemm(x, w.astype(np.float64))
    # The same weight again: what was worked out at its first product serves (and is right).
    x2 = rng.standard_normal((3, 96), dtype=np.float32).view(HostArray)
    np.testing.assert_allclose(np.asarray(gemm(x2, w)),
                               x2.astype(weight_dtype).astype(np.float32)
                               @ w.astype(np.float32).T, rtol=1e-5, atol=1e-4)
    assert len(gemm._weights) == 1
    out = np.full((3, 40), np.nan, np.float32).view(HostArray)
    assert gemm(x2, w, out=out) is out
    np.testing.assert_allclose(np.asarray(out), np.asarray(gemm(x2, w)), rtol=0, atol=0)


class FailingGraphs:
    """Stands in for graphs.DecodeGraphs; fails where `fail_at` says ('init', 'capture' or
    'run'), as a platform without working capture (or replay) would."""

    fail_at = "capture"
    error = "hipStreamBeginCapture: operation not supported"

    def __init__(self, model, cache, *, max_batch):
        if self.fail_at == "init":
            raise RuntimeError(self.error)
        self.buckets, self.steps, self.capture_seconds = (1, 2, 4, 8), {}, 0.0
        self.stream = contextlib.nullcontext()

    def capture(self, bucket):
        if self.fail_at == "capture":
            raise RuntimeError(self.error)
        self.steps[bucket] = object()

    def run(self, rows):
        raise RuntimeError(self.error)


def graph_engine(tiny, monkeypatch, graphs, fail_at, hip=True):
    """A numpy engine that takes the graph path (the blocker is bypassed) with FailingGraphs."""
    monkeypatch.setattr(engine_module, "graph_blocker", lambda **why: None)
    monkeypatch.setattr(engine_module, "DecodeGraphs", FailingGraphs)
    monkeypatch.setattr(FailingGraphs, "fail_at", fail_at)
    monkeypatch.setattr(blas, "gpu_is_hip", lambda: hip)
    return numpy_engine(tiny, 16, 8, graphs=graphs)


@pytest.mark.parametrize("fail_at", ["init", "capture", "run"])
def test_auto_graphs_fall_back_to_eager_with_a_warning(tiny, monkeypatch, fail_at):
    prompts, new = [[1, 17, 42], [1, 5]], [6, 4]
    eager = generate(numpy_engine(tiny, 16, 8, graphs=False), prompts, new)
    engine = graph_engine(tiny, monkeypatch, None, fail_at)
    assert engine.use_graphs is True
    with pytest.warns(RuntimeWarning, match=r"decode graphs turned off, decoding eagerly: "
                                            r"\w+ a decode graph failed on ROCm/HIP "
                                            r"\(RuntimeError: hipStreamBeginCapture") as record:
        seqs = generate(engine, prompts, new)
    assert len([w for w in record if "decode graphs" in str(w.message)]) == 1  # warned once
    assert engine.use_graphs is False and engine.stats.graph_steps == 0
    assert [s.output_ids for s in seqs] == [s.output_ids for s in eager]
    assert engine.stats.decode_steps == max(new) - 1
    assert engine.cache.num_free_blocks == 16


@pytest.mark.parametrize("fail_at", ["init", "capture", "run"])
def test_required_graphs_raise_a_clear_error(tiny, monkeypatch, fail_at):
    engine = graph_engine(tiny, monkeypatch, True, fail_at)
    for p in ([1, 17, 42], [1, 5]):
        engine.add_request(p, SamplingParams(max_new_tokens=4))
    engine.step()  # prefill: always eager
    with pytest.raises(RuntimeError, match=r"graphs=True: \w+ a decode graph failed on ROCm/HIP "
                                           r".*pass graphs=None to fall back") as info:
        engine.step()
    assert "operation not supported" in str(info.value.__cause__)


def test_fallback_message_names_cuda_off_hip(tiny, monkeypatch):
    engine = graph_engine(tiny, monkeypatch, None, "capture", hip=False)
    with pytest.warns(RuntimeWarning, match="failed on CUDA"):
        generate(engine, [[1, 2]], [3])


# --- goal: no bfloat16 probe on ROCm -----------------------------------------------------------

BF16 = runtime.DTYPES["bfloat16"]


def forbid_probe(monkeypatch):
    def probe(dtype):
        raise AssertionError(f"probed {dtype} (on HIP this would abort the process)")
    monkeypatch.setattr(runtime, "_probe_gpu_dtype", probe)


def test_hip_decides_bfloat16_without_running_it(monkeypatch, capsys):
    monkeypatch.setattr(blas, "gpu_is_hip", lambda: True)
    forbid_probe(monkeypatch)
    assert runtime._gpu_handles(BF16) is False
    assert runtime.compute_dtype("gpu", "bfloat16") == np.float32
    assert "ROCm/HIP" in capsys.readouterr().err
    assert runtime.compute_dtype("gpu", "torch.float32", "bfloat16") == np.float32
    # float16 and float32 are not probed anywhere; they stay as asked.
    assert runtime.compute_dtype("gpu", "float16") == np.float16
    assert runtime.compute_dtype("gpu", "bfloat16", "float16") == np.float16


@pytest.mark.parametrize("cupy_has_bf16", [True, False])
def test_cuda_still_probes_bfloat16(monkeypatch, capsys, cupy_has_bf16):
    monkeypatch.setattr(blas, "gpu_is_hip", lambda: False)
    probed = []
    monkeypatch.setattr(runtime, "_probe_gpu_dtype",
                        lambda dtype: probed.append(np.dtype(dtype)) or cupy_has_bf16)
    want = BF16 if cupy_has_bf16 else np.dtype(np.float32)
    assert runtime.compute_dtype("gpu", "bfloat16") == want
    assert probed == [BF16]
    assert ("no bfloat16 matmul" in capsys.readouterr().err) is not cupy_has_bf16

"""Decode steps replayed from captured CUDA / HIP graphs (cupy stream capture + cupa.plan_decode).

A decode step launches a few dozen small kernels per layer; launched one by one from Python the
host, not the GPU, sets the step time. Here each batch-size bucket's whole step (embedding, every
layer with its cache writes and paged attention, LM head, greedy argmax) is captured once as a
CUDA graph and replayed: per step the host only packs the inputs, makes one upload and one
launch, and reads back the chosen ids (or the logits when sampling).

How it fits together:
- Buckets: a step with b running sequences runs the graph of the smallest bucket >= b; rows past
  b are padding (token 0 at position 0, cache slot -1, which cache.write skips, and length 0,
  for which cupa.decode writes zeros), and their outputs are sliced off.
- Static inputs: one device byte buffer holds token ids, positions and cache slots (int64) and
  sequence lengths and block tables (int32), laid out for the largest bucket; each bucket's graph
  reads views of its leading rows. A pinned host twin is filled and uploaded in one copy.
  Tables have a fixed width: the blocks of the model's longest sequence, or of the whole cache if
  that is smaller.
- Attention: one `cupa.plan_decode` per bucket, planned for that table width, run once outside
  the capture (which compiles its kernels) and then captured; its output buffer is reused by
  every layer (stream order makes that safe: the output projection reads it before the next
  layer's attention writes it).
- Memory: everything the captured forward allocates comes from a memory pool used only while
  capturing, so no allocation of eager code can ever take memory a graph writes to. Graphs run
  one at a time on one stream, so their intermediates may share that pool; each graph's outputs
  (logits, argmax) stay referenced and are therefore never handed out again.
- Capture may not read device memory on the host, upload from numpy, or synchronise: the
  captured code (model.forward, cache.write with device slots, DecodePlan.run) does none of
  these; constants such as fp8 scales were uploaded when the cache and plans were made, and a
  warm-up run of the same step before the capture compiles every kernel. cupy refuses to record
  its cuBLAS calls, so the captured forward's matmuls go to cublasGemmEx directly (cublas.py).
- Tensor parallel: the model's `reduce` hook (its all-reduces, collectives.NcclGroup) runs on
  the current stream, which during the warm-up and the capture is self.stream, so the NCCL
  all-reduces are recorded in the graph and every replay runs them; every rank captures and
  replays the same buckets at the same steps, so the ranks' collectives pair up. Written for
  NCCL / RCCL, not run on two GPUs.
- ROCm: cupy's docstrings call stream capture CUDA-only, but cupy-rocm's runtime forwards
  cudaStreamBeginCapture / EndCapture / GraphInstantiate / GraphLaunch to their HIP twins, so the
  same code runs there with hipblasGemmEx for the matmuls (hipblas.py; blas.graph_gemm_type
  picks the library). Written for ROCm, not run on AMD hardware: should a capture fail there,
  the engine's default falls back to eager steps with a warning.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass

import numpy as np

import cupa

from .blas import graph_gemm_type
from .step_attention import decode_query, layer_caches, paged_decode_formats, write_then_attend

# Batch-size buckets: fine steps where batches are small (the padding would be a large share),
# coarser ones above. Padding rows cost little: decode matmuls read the weights once whatever the
# row count, and padded rows read no KV.
_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
_BUCKET_STEPS = ((128, 16), (256, 32))  # (up to, step) after the small ones; then steps of 64
_SECTION_ALIGN = 256  # bytes; each input array starts on such a boundary


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Graph batch sizes for an engine that runs at most `max_batch` sequences at once: the
    standard sizes below max_batch, then max_batch itself (no graph larger than needed)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) \
            or max_batch < 1:
        raise ValueError(f"max_batch: must be a positive int, got {max_batch!r}")
    sizes, size = list(_SMALL_BUCKETS), _SMALL_BUCKETS[-1]
    for limit, step in _BUCKET_STEPS:
        while size + step <= limit:
            size += step
            sizes.append(size)
    while size < max_batch:
        size += 64
        sizes.append(size)
    return tuple(s for s in sizes if s < max_batch) + (int(max_batch),)


def bucket_for(batch: int, buckets) -> int:
    """The smallest bucket that holds `batch` rows."""
    if batch >= 1:
        for size in buckets:
            if size >= batch:
                return size
    raise ValueError(f"batch of {batch} sequences: must be from 1 to the largest graph bucket "
                     f"({buckets[-1]})")


def table_width(max_seq_len: int, block_size: int, num_blocks: int) -> int:
    """Block-table columns every graph uses: enough for the longest sequence the model allows,
    and never more than the cache has blocks (a sequence cannot hold more)."""
    return max(1, min(math.ceil(max_seq_len / block_size), num_blocks))


def graph_blocker(on_gpu: bool, attention: str) -> str | None:
    """Why decode steps cannot be graph-captured in this setting, or None when they can (on
    CUDA and on ROCm alike: whether a capture works on a platform shows only when it runs, and
    the engine falls back to eager steps, or raises with graphs=True, if it does not)."""
    if not on_gpu:
        return "CUDA graphs need the GPU backend (this engine runs on numpy)"
    if attention != "paged":
        return (f"attention={attention!r} changes its array shapes every step; only 'paged' "
                f"decode can be captured")
    return None


def resolve_graphs(requested, blocker: str | None) -> bool:
    """The engine's `graphs` option: None = on wherever possible; True = required."""
    if requested is None:
        return blocker is None
    if not isinstance(requested, bool):
        raise ValueError(f"graphs: must be True, False or None, got {requested!r}")
    if requested and blocker is not None:
        raise ValueError(f"graphs=True: {blocker}; pass graphs=False (or None to decide "
                         f"automatically)")
    return requested


# --- static inputs -------------------------------------------------------------------------------

@dataclass
class StepArrays:
    """One bucket's input arrays (views of the static buffer; numpy on the host, cupy on the
    device)."""

    token_ids: object     # int64 [bucket]
    positions: object     # int64 [bucket]
    slots: object         # int64 [bucket], -1 = padding (not written)
    seq_lens: object      # int32 [bucket], 0 = padding (zero attention output)
    block_tables: object  # int32 [bucket, width], -1 = unused column


def _aligned(offset: int) -> int:
    return -(-offset // _SECTION_ALIGN) * _SECTION_ALIGN


@dataclass(frozen=True)
class StepLayout:
    """Byte layout of the static inputs for up to `max_batch` rows and `width` table columns:
    [token ids | positions | slots] int64, then seq_lens int32, then block tables int32 (rows
    contiguous, so a bucket's tables are a prefix and one upload covers a step)."""

    max_batch: int
    width: int

    @property
    def lens_offset(self) -> int:
        return _aligned(3 * self.max_batch * 8)

    @property
    def tables_offset(self) -> int:
        return _aligned(self.lens_offset + self.max_batch * 4)

    @property
    def nbytes(self) -> int:
        return self.tables_offset + self.max_batch * self.width * 4

    def upload_bytes(self, bucket: int) -> int:
        """Bytes from the start of the buffer that hold everything a `bucket` step reads."""
        return self.tables_offset + bucket * self.width * 4

    def views(self, buffer, bucket: int) -> StepArrays:
        """`bucket`-row views of a uint8 buffer of nbytes (numpy or cupy)."""
        if not 1 <= bucket <= self.max_batch:
            raise ValueError(f"bucket: must be from 1 to {self.max_batch}, got {bucket}")
        ints = buffer[:3 * self.max_batch * 8].view(np.int64).reshape(3, self.max_batch)
        lens = buffer[self.lens_offset:self.lens_offset + self.max_batch * 4].view(np.int32)
        tables = buffer[self.tables_offset:self.upload_bytes(bucket)].view(np.int32)
        return StepArrays(token_ids=ints[0, :bucket], positions=ints[1, :bucket],
                          slots=ints[2, :bucket], seq_lens=lens[:bucket],
                          block_tables=tables.reshape(bucket, self.width))


@dataclass
class StepRows:
    """The host inputs of one decode step, one row per running sequence."""

    token_ids: list
    positions: list
    slots: np.ndarray   # int64, from cache.extend
    seq_lens: list
    tables: list        # int32 block ids per sequence

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def gather(cls, seqs, slots, cache) -> "StepRows":
        """Rows of `seqs` (objects with seq_id, last_token, num_tokens) after `slots` were
        reserved for their newest tokens by cache.extend."""
        return cls(token_ids=[s.last_token for s in seqs],
                   positions=[s.num_tokens - 1 for s in seqs],
                   slots=np.asarray(slots, dtype=np.int64),
                   seq_lens=[cache.seq_len(s.seq_id) for s in seqs],
                   tables=[cache.block_table(s.seq_id) for s in seqs])

    @classmethod
    def padding(cls) -> "StepRows":
        """No sequences: every row of a bucket becomes padding."""
        return cls([], [], np.empty(0, dtype=np.int64), [], [])

    def pack_into(self, arrays: StepArrays) -> None:
        """Write the rows, then padding up to the bucket, into host views."""
        b, bucket = len(self), arrays.token_ids.shape[0]
        width = arrays.block_tables.shape[1]
        if b > bucket:
            raise ValueError(f"{b} rows do not fit a bucket of {bucket}")
        for name, values, pad in (("token_ids", self.token_ids, 0),
                                  ("positions", self.positions, 0),
                                  ("slots", self.slots, -1), ("seq_lens", self.seq_lens, 0)):
            target = getattr(arrays, name)
            target[:b] = values
            target[b:] = pad
        arrays.block_tables.fill(-1)
        for row, table in enumerate(self.tables):
            if len(table) > width:
                raise ValueError(f"sequence in row {row} holds {len(table)} blocks, more than "
                                 f"the graphs' table width {width}")
            arrays.block_tables[row, :len(table)] = table


# --- capture and replay --------------------------------------------------------------------------

@dataclass
class CapturedStep:
    """One bucket's graph and what it reads and writes."""

    bucket: int
    graph: object
    plan: object       # cupa.DecodePlan
    inputs: StepArrays
    logits: object     # float32 [bucket, vocab]
    argmax: object     # int64 [bucket]


class DecodeGraphs:
    """Graph-captured decode steps of `model` over `cache`, one graph per batch bucket, captured
    the first time a bucket is needed. GPU only (CUDA; ROCm written for, not yet run)."""

    def __init__(self, model, cache, *, max_batch: int):
        import cupy
        self._cupy = cupy
        self.model, self.cache = model, cache
        self.buckets = batch_buckets(max_batch)
        self.width = table_width(model.config.max_seq_len, cache.block_size, cache.num_blocks)
        self.layout = StepLayout(self.buckets[-1], self.width)
        self.kv_dtype, self.query_dtype, self.fp8 = paged_decode_formats(model, cache)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # cupy will not record its own BLAS calls; this one (cuBLAS or hipBLAS) is bound to
        # self.stream.
        self.gemm = graph_gemm_type()(self.stream)
        self.gemm.check(model.dtype)
        self.pool = cupy.cuda.MemoryPool()  # only for allocations made while capturing
        self.host = _pinned_bytes(self.layout.nbytes)
        self.device = cupy.empty(self.layout.nbytes, dtype=np.uint8)  # filled per upload
        self.steps: dict[int, CapturedStep] = {}
        self.capture_seconds = 0.0
        self._uploaded = None  # event: the last upload has read the host buffer
        self._replay_events = None  # (before, after) the latest launch

    def run(self, rows: StepRows):
        """Replay the step for `rows` (capturing its bucket first if needed). Returns device
        views (logits [b, vocab], argmax [b]) of the graph's outputs, valid until the next run;
        read them on `self.stream`."""
        step = self.capture(bucket_for(len(rows), self.buckets))
        self._follow_current_stream()
        self._upload(rows, step.bucket)
        started = self.stream.record()
        step.graph.launch(self.stream)
        self._replay_events = (started, self.stream.record())
        return step.logits[:len(rows)], step.argmax[:len(rows)]

    def last_replay_seconds(self) -> float:
        """GPU time of the latest replay (CUDA events around the launch; waits for its end)."""
        started, ended = self._replay_events
        ended.synchronize()
        return self._cupy.cuda.get_elapsed_time(started, ended) / 1e3

    def capture(self, bucket: int) -> CapturedStep:
        """Capture (or return) the graph of one bucket."""
        if bucket in self.steps:
            return self.steps[bucket]
        cupy, start = self._cupy, time.perf_counter()
        inputs = self.layout.views(self.device, bucket)
        plan = self._plan(inputs, bucket)
        self._follow_current_stream()  # after the plan: it may initialise buffers on that stream
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self._upload(StepRows.padding(), bucket)
            # Warm-up on all-padding rows: compiles every kernel and initialises cuBLAS on this
            # stream, while writing nothing to the cache (slots -1) and reading no KV (length 0).
            self._forward(inputs, plan)
            # No garbage collection inside the capture: collecting, say, an old engine's pool
            # would free device memory (cudaFree synchronises, which a capture cannot).
            gc.collect()
            was_enabled = gc.isenabled()
            gc.disable()
            self.stream.begin_capture()
            try:
                logits, argmax = self._forward(inputs, plan)
            except BaseException:
                self._abandon_capture()
                raise
            finally:
                if was_enabled:
                    gc.enable()
            graph = self.stream.end_capture()
        self.stream.synchronize()
        step = CapturedStep(bucket, graph, plan, inputs, logits, argmax)
        self.steps[bucket] = step
        self.capture_seconds += time.perf_counter() - start
        return step

    def _plan(self, inputs: StepArrays, bucket: int):
        """Bucket `bucket`'s attention plan: fixed grid for the full table width."""
        cfg = self.model.config
        query = self._cupy.empty((bucket, cfg.num_heads, cfg.head_dim), dtype=self.query_dtype)
        return cupa.plan_decode(query, self.cache.key_cache(0), self.cache.value_cache(0),
                                inputs.block_tables, inputs.seq_lens, scale=self.model.scale,
                                max_seq_len=self.width * self.cache.block_size, backend="gpu",
                                **self.fp8)

    def _forward(self, inputs: StepArrays, plan):
        """The captured step: forward over the static inputs, then the greedy choice."""
        cupy, cache, query_dtype = self._cupy, self.cache, self.query_dtype
        caches = layer_caches(cache)

        def attention(layer, q, k, v):
            return plan.run(decode_query(cupy, q, query_dtype), *caches[layer],
                            inputs.block_tables, inputs.seq_lens)

        attend = write_then_attend(cache, inputs.slots, self.kv_dtype, attention)
        logits = self.model.forward(inputs.token_ids, inputs.positions, attend,
                                    matmul=self.gemm)
        return logits, cupy.argmax(logits, axis=-1)

    def _follow_current_stream(self) -> None:
        """Order this stream after the work the caller queued so far (e.g. a prefill's cache
        writes on the default stream)."""
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record())

    def _upload(self, rows: StepRows, bucket: int) -> None:
        """Pack `rows` into the pinned host buffer and copy it to the device on self.stream."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous copy has read the host buffer
        rows.pack_into(self.layout.views(self.host, bucket))
        self.device.data.copy_from_host_async(self.host.ctypes.data,
                                              self.layout.upload_bytes(bucket), self.stream)
        self._uploaded = self.stream.record()

    def _abandon_capture(self) -> None:
        """End a capture that failed half-way, so the stream is usable again."""
        try:
            self.stream.end_capture()
        except Exception:  # the capture may already be invalidated; the original error matters
            pass


def _pinned_bytes(nbytes: int) -> np.ndarray:
    """A host byte buffer, page-locked when cupy can (the per-step upload is then asynchronous
    and cheaper)."""
    try:
        import cupyx
        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    except Exception:  # pinned memory is an optimisation only
        return np.empty(nbytes, dtype=np.uint8)

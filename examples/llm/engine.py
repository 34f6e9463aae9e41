"""Continuous batching over cupa's paged KV cache.

Each `step()` is either a prefill of newly admitted sequences or one decode step of every running
sequence (prefill first, so the batch refills as soon as blocks free up):

  waiting --admit (blocks reserved with cache.extend)--> running --EOS / max tokens--> finished
     ^                                                      |
     +------ preempted (blocks freed, recomputed later) ----+   when a decode step runs out of blocks

Preemption recomputes: a preempted sequence keeps its generated ids and is prefilled again over
prompt + output when readmitted, which reproduces the same cache contents (with an fp8 cache only
nearly: the recompute attends over unquantised K/V where the decode steps read fp8 codes).

On a GPU with paged attention, decode steps replay captured CUDA graphs (graphs.py; on ROCm HIP
graphs, written for but not yet run on AMD hardware), one per batch-size bucket; prefill, with its
varying shapes, always runs eagerly.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import cupa

from . import blas
from .baseline_attention import naive_decode_attention
from .graphs import DecodeGraphs, StepRows, bucket_for, graph_blocker, resolve_graphs
from .model import Model
from .sampling import SamplingParams, sample, sequence_rng
from .step_attention import decode_query, layer_caches, paged_decode_formats, write_then_attend
from .tensor_parallel import ROOT_RANK

from cupa import OutOfBlocksError

PLAN_HINT_STEP = 256  # tokens: the eager decode's max_seq_len hint moves in these steps

# Blocks the admission rule keeps free per running sequence: a sequence is admitted next to
# others only if, after its prompt's blocks, this many per running sequence (itself included)
# stay free, so that the next decode step, where each sequence may open a new block, does not
# have to preempt at once.
ADMISSION_RESERVE_BLOCKS = 1


class CacheTooSmallWarning(RuntimeWarning):
    """A sequence stopped (finish_reason 'cache_too_small') because the KV cache cannot hold it."""


def blocks_to_run_together(token_counts, block_size: int) -> int:
    """Cache blocks with which sequences growing to `token_counts` tokens are all admitted in
    one step (as far as max_batch and max_prefill_tokens allow) and then never preempted: each
    one's blocks at full length plus its admission reserve. Blocks at full length alone are not
    enough: the admission rule would then hold back the last prompts until others finish."""
    counts = list(token_counts)
    full_length = sum(math.ceil(n / block_size) for n in counts)
    return full_length + ADMISSION_RESERVE_BLOCKS * len(counts)


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    output_ids: list[int] = field(default_factory=list)
    # 'stop' (EOS), 'length' (max_new_tokens or the model's context), or 'cache_too_small' (the
    # KV cache cannot hold the prompt, or the sequence once it runs alone and fills every block)
    finish_reason: str | None = None
    preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """The newest token (the next decode step's input), without building token_ids."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_time: float = 0.0
    preemptions: int = 0
    generated_tokens: int = 0   # every sampled token, prefill's first ones included
    graph_steps: int = 0        # decode steps replayed from a CUDA graph
    graph_captures: int = 0     # graphs captured (one per batch bucket used)
    capture_time: float = 0.0   # seconds spent capturing (not counted in decode_time)
    graph_device_time: float = 0.0  # GPU seconds of the graph replays (decode_time: wall)


class Engine:
    """Runs requests to completion on `model` with KV stored in `cache` (a cupa.PagedKVCache).

    attention: 'paged' decodes with cupa.decode over the block tables; 'naive' gathers each
    sequence's KV into dense arrays and does matmul / softmax / matmul (the benchmark baseline).
    An fp8 cache (cache.kv_format set) stores codes and scales; both paths read it through them.
    on_token(seq, token_id) is called for every generated token (streaming).
    on_logits(seqs, logits) sees the float32 logits of every step before sampling (tests); one
    row per sequence in `seqs`, valid during the call (graph steps reuse the buffer).
    graphs: replay decode steps from captured CUDA / HIP graphs. None (default) = wherever
    possible (GPU, paged attention), falling back to eager steps with a RuntimeWarning if a
    capture fails on this platform; True = required (ValueError where impossible, RuntimeError if
    a capture fails); False = eager.
    group: the tensor-parallel process group (collectives.py) when `model` and `cache` are one
    rank's part (None: one GPU, no collectives). Every rank runs the same Engine on the same
    requests, so it makes the same scheduling decisions; rank 0 samples and broadcasts the
    chosen ids, so every rank appends the same tokens, sampled ones included. With a group a
    graph capture that fails raises (as with graphs=True): a rank falling back to eager steps
    alone could make collectives the other ranks do not.
    """

    def __init__(self, model: Model, cache, *, eos_ids=(), attention="paged", max_batch=256,
                 max_prefill_tokens=8192, on_token=None, on_logits=None, backend=None,
                 graphs: bool | None = None, group=None):
        if attention not in ("paged", "naive"):
            raise ValueError(f"attention must be 'paged' or 'naive', got {attention!r}")
        self.use_graphs = resolve_graphs(graphs, graph_blocker(
            on_gpu=model.xp is not np and cache.backend == "gpu", attention=attention))
        self.group = group if group is not None and group.world > 1 else None
        self._graphs_required = graphs is True
        self._graphs = None  # DecodeGraphs, made at the first graph step
        self._eager_gemms: dict = {}  # stream pointer -> the BLAS matmul of eager forwards
        self.model, self.cache, self.xp = model, cache, model.xp
        self.eos_ids = set(int(e) for e in eos_ids)
        self.attention = attention
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.on_token, self.on_logits = on_token, on_logits
        self.backend = backend
        self.block_size = cache.block_size
        self.total_blocks = cache.num_free_blocks  # the cache starts empty
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._next_id = 0
        self._ahead: dict = {}  # seq_id -> cache slot of its next decode step, reserved ahead
        self._layer_caches = layer_caches(cache)
        self._step_buffers = (0, None)  # (batch size, model.step_buffers of it) of eager steps
        self._eager_plans = (None, None)  # (shapes and hint, cupa.DecodePlan) of eager steps

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, prompt_ids, params: SamplingParams, *, seed: int = 0) -> Sequence:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(self._next_id, prompt_ids, params.check(), sequence_rng(seed, self._next_id))
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, prompts, params: SamplingParams, *, seed: int = 0) -> list[Sequence]:
        seqs = [self.add_request(p, params, seed=seed) for p in prompts]
        self.run()
        return seqs

    def prepare_graphs(self, batch_sizes) -> None:
        """Capture the decode graphs that steps of these batch sizes will use now, rather than
        at their first step (e.g. before timing). A no-op when graphs are off."""
        if not self.use_graphs:
            return
        for size in batch_sizes:
            if self._graphs_for(size) is None:
                return

    # -- scheduling ------------------------------------------------------------------------------

    def step(self) -> None:
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        elif self.running:
            self._decode()

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _admit(self) -> list[tuple[Sequence, object]]:
        """Move waiting sequences to running while their blocks fit, keeping
        ADMISSION_RESERVE_BLOCKS free per running sequence (blocks_to_run_together counts them)."""
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            need = self._blocks_for(seq.num_tokens)
            if need > self.total_blocks or seq.num_tokens >= self.model.config.max_seq_len:
                self.waiting.popleft()
                self._finish(seq, "cache_too_small" if need > self.total_blocks else "length")
                continue
            alone = not self.running and not admitted
            reserve = ADMISSION_RESERVE_BLOCKS * (len(self.running) + len(admitted) + 1)
            if not alone and (self.cache.num_free_blocks - need < reserve
                              or tokens + seq.num_tokens > self.max_prefill_tokens):
                break
            try:
                slots = self.cache.extend([seq.seq_id], [seq.num_tokens])
            except OutOfBlocksError:
                break
            self.waiting.popleft()
            admitted.append((seq, slots))
            tokens += seq.num_tokens
        return admitted

    def _reserve_decode_slots(self):
        """One slot per running sequence; preempts the newest sequences while blocks run out.
        Slots reserved ahead during the previous graph step (_reserve_ahead) are used as they
        are; only the other sequences are extended."""
        ahead, self._ahead = self._ahead, {}
        while True:
            missing = [s.seq_id for s in self.running if s.seq_id not in ahead]
            try:
                fresh = dict(zip(missing, self.cache.extend(missing, 1))) if missing else {}
                return np.array([ahead[s.seq_id] if s.seq_id in ahead else fresh[s.seq_id]
                                 for s in self.running], dtype=np.int64)
            except OutOfBlocksError:
                if len(self.running) == 1:
                    # Alone and still out of blocks: it holds every block of the cache, which
                    # cannot hold a longer sequence.
                    self._finish(self.running[0], "cache_too_small")
                    return None
                victim = self.running.pop()
                self.cache.free(victim.seq_id)
                victim.preemptions += 1
                self.stats.preemptions += 1
                self.waiting.appendleft(victim)

    # -- model steps -----------------------------------------------------------------------------

    def _prefill(self, admitted) -> None:
        xp, model = self.xp, self.model
        start = time.perf_counter()
        seqs = [seq for seq, _ in admitted]
        lengths = [seq.num_tokens for seq in seqs]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        # Uploaded once per step (on the GPU); the cache checks host slots on every write.
        slots = xp.asarray(np.concatenate([np.asarray(s).reshape(-1) for _, s in admitted]))
        tokens = xp.asarray(np.concatenate([seq.token_ids for seq in seqs]).astype(np.int64))
        positions = xp.asarray(np.concatenate([np.arange(n) for n in lengths]))
        groups = prefill_groups(lengths, model.config.num_heads)

        def prompt_attention(layer, q, k, v):
            # The prompt's own attention uses the unquantised K/V (as fp8 engines do); only later
            # decode steps read the codes cache.write stores.
            out = xp.empty(q.shape, dtype=np.float32)
            for first, count, length in groups:
                rows = slice(first, first + count * length)
                out[rows] = model.causal_attention(q[rows], k[rows], v[rows], num_seqs=count)
            return out

        attend = write_then_attend(self.cache, slots, model.dtype, prompt_attention)
        logits = model.forward(tokens, positions, attend, last_rows=xp.asarray(bounds[1:] - 1),
                               matmul=self._eager_matmul())
        self.running.extend(seqs)
        self._sample_and_append(seqs, logits)
        self.stats.prefill_tokens += int(bounds[-1])
        self.stats.prefill_time += time.perf_counter() - start

    def _decode(self) -> None:
        start, captured = time.perf_counter(), self.stats.capture_time
        slots = self._reserve_decode_slots()
        if slots is None:
            return
        seqs = list(self.running)
        if self.use_graphs:
            self._decode_graph(seqs, slots)
        else:
            self._decode_eager(seqs, slots)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        # A first step of a bucket also captured its graph: that time is capture_time's.
        self.stats.decode_time += (time.perf_counter() - start
                                   - (self.stats.capture_time - captured))

    def _decode_eager(self, seqs, slots) -> None:
        xp, model, cfg = self.xp, self.model, self.model.config
        ids = [s.seq_id for s in seqs]
        # The step's token ids, positions and cache slots: rows of one array, one upload.
        step = np.empty((3, len(seqs)), dtype=np.int64)
        step[0] = [s.last_token for s in seqs]
        step[1] = [s.num_tokens - 1 for s in seqs]
        step[2] = slots
        tokens, positions, slots = xp.asarray(step)
        max_len = max(s.num_tokens for s in seqs)  # = seq_len after extend; no device read
        # The planned length, rounded up so that one plan (and the tables' width) serves 256
        # steps: cupa's partitioning hint, and a width that the plan fixes (a hint only tunes
        # speed; the padding columns lie beyond every seq_len and are never read).
        hint = -(-max_len // PLAN_HINT_STEP) * PLAN_HINT_STEP
        kv_dtype, query_dtype, fp8 = paged_decode_formats(model, self.cache)
        caches = self._layer_caches

        if self.attention == "naive":
            block_tables, seq_lens = self.cache.tables(ids)
            def attention(layer, q, k, v):
                return naive_decode_attention(xp, q, *caches[layer], block_tables, seq_lens,
                                              max_len, model.scale, **fp8)
        else:
            # Tables are built and uploaded once per step, then every layer's attention uses
            # them (cache.decode(layer, ...) would rebuild them per layer).
            block_tables, seq_lens = self.cache.tables(ids, max_blocks=hint // self.block_size)
            # One output for every layer's attention: the output projection reads it before the
            # next layer's attention writes it (one stream on the GPU orders them). It stays in
            # the query dtype: the output projection casts it to the weight dtype anyway (a
            # float16 -> float32 -> float16 round trip would be exact, and two more kernels).
            out = xp.empty((len(seqs), cfg.num_heads, cfg.head_dim), dtype=query_dtype)
            plan = self._eager_plan(out, block_tables, seq_lens, hint, fp8)
            if xp is np:
                def attention(layer, q, k, v):
                    return plan.run(decode_query(xp, q, query_dtype), *caches[layer],
                                    block_tables, seq_lens, out=out)
            else:
                # Every layer's arrays match the plan (same shapes, dtypes and layout as
                # layer 0's, which it was made with): run_matched skips cupa's checks of them.
                def attention(layer, q, k, v):
                    q = decode_query(xp, q, query_dtype)
                    return plan.run_matched((q, *caches[layer], block_tables, seq_lens,
                                             None, None, None), out)

        attend = write_then_attend(self.cache, slots, kv_dtype, attention)
        logits = model.forward(tokens, positions, attend, matmul=self._eager_matmul(),
                               buffers=self._buffers_for(len(seqs)))
        self._sample_and_append(seqs, logits)

    def _eager_plan(self, query, block_tables, seq_lens, hint: int, fp8: dict):
        """The decode plan of eager steps of this batch size and planned length, kept for the
        latest pair (they change every PLAN_HINT_STEP steps, or when sequences join or leave):
        made once, like a serving engine's plan() before a run of steps."""
        key = (query.shape, block_tables.shape, hint)
        if self._eager_plans[0] != key:
            plan = cupa.plan_decode(query, *self._layer_caches[0], block_tables, seq_lens,
                                    scale=self.model.scale, max_seq_len=hint,
                                    backend=self.backend, **fp8)
            self._eager_plans = (key, plan)
        return self._eager_plans[1]

    def _buffers_for(self, batch: int):
        """The model's step buffers for eager decode steps of `batch` sequences, kept for the
        latest batch size (it changes only when sequences join or leave); None on numpy."""
        if self._step_buffers[0] != batch:
            self._step_buffers = (batch, self.model.step_buffers(batch))
        return self._step_buffers[1]

    def _eager_matmul(self):
        """On the GPU, the graph steps' BLAS matmul for eager forwards too: one GemmEx call
        (float32 out) where cupy's `@` adds a cast each way and its own dispatch, ~3 kernels
        and ~30 us of host time per linear (docs/performance.md, host cost). Bound to the
        stream the forward runs on; None on the CPU, or where the library is missing."""
        if self.xp is np:
            return None
        import cupy
        stream = cupy.cuda.get_current_stream()
        if stream.ptr not in self._eager_gemms:
            try:
                gemm = blas.graph_gemm_type()(stream)
                gemm.check(self.model.dtype)
            except (blas.BlasError, TypeError) as exc:
                warnings.warn(f"eager forwards use cupy's matmul: {exc}", RuntimeWarning)
                gemm = None
            self._eager_gemms[stream.ptr] = gemm
        return self._eager_gemms[stream.ptr]

    def _decode_graph(self, seqs, slots) -> None:
        """One decode step replayed from the graph of its batch bucket."""
        runner = self._graphs_for(len(seqs))
        if runner is None:  # graphs were only wanted where possible, and are not possible
            self._decode_eager(seqs, slots)
            return
        try:
            logits, argmax = runner.run(StepRows.gather(seqs, slots, self.cache))
        except Exception as e:
            # A replay that fails (say, a launch this platform refuses) runs the step eagerly:
            # its cache writes, if any happened, are the ones the eager step makes again.
            self._graphs_failed(e, "replaying")
            self._decode_eager(seqs, slots)
            return
        self._reserve_ahead(seqs)  # host work while the GPU replays the step
        with runner.stream:  # the reads below (and on_logits) queue after the replay
            self._sample_and_append(seqs, logits, argmax)
        self.stats.graph_steps += 1
        self.stats.graph_device_time += runner.last_replay_seconds()

    def _reserve_ahead(self, seqs) -> None:
        """Reserve the next decode step's cache slots now, while the GPU is busy, for the
        sequences that will still run whatever token they get (a sequence that then stops at
        EOS releases its slot with its other blocks). cache.extend is most of a step's host
        time, so this takes it off the critical path. Only when nothing waits for admission
        (which would otherwise see those blocks taken a step early) and when the blocks suffice
        (else the next step reserves, and preempts, as it always does): the engine's scheduling
        is unchanged."""
        if self.waiting:
            return
        max_len = self.model.config.max_seq_len
        going_on = [s.seq_id for s in seqs if not s.finished
                    and len(s.output_ids) + 1 < s.params.max_new_tokens
                    and s.num_tokens + 1 < max_len]
        try:
            slots = self.cache.extend(going_on, 1) if going_on else []
        except OutOfBlocksError:
            return
        self._ahead = dict(zip(going_on, slots))

    def _graphs_for(self, batch: int) -> DecodeGraphs | None:
        """The graph runner with the bucket of `batch` captured, or None when that failed (say,
        this cupy's BLAS cannot be reached, or this platform cannot capture a step) and graphs
        were not required (see _graphs_failed)."""
        try:
            if self._graphs is None:
                self._graphs = DecodeGraphs(self.model, self.cache, max_batch=self.max_batch)
            self._capture(self._graphs, bucket_for(batch, self._graphs.buckets))
            return self._graphs
        except Exception as e:
            self._graphs_failed(e, "capturing")
            return None

    def _graphs_failed(self, error: Exception, doing: str) -> None:
        """graphs=True (or tensor parallel) raises; the default (None) warns once and turns
        graphs off, so the step and the ones after it run eagerly."""
        platform = "ROCm/HIP" if blas.gpu_is_hip() else "CUDA"
        what = f"{doing} a decode graph failed on {platform} ({type(error).__name__}: {error})"
        if self.group is not None:
            raise RuntimeError(f"rank {self.group.rank} of {self.group.world}: {what}; tensor "
                               f"parallel cannot fall back to eager steps on one rank alone: "
                               f"pass graphs=False (--no-graphs) on every rank") from error
        if self._graphs_required:
            raise RuntimeError(f"graphs=True: {what}; pass graphs=None to fall back to eager "
                               f"decode steps, or graphs=False") from error
        warnings.warn(f"decode graphs turned off, decoding eagerly: {what}", RuntimeWarning,
                      stacklevel=3)
        self.use_graphs, self._graphs = False, None

    def _capture(self, runner: DecodeGraphs, bucket: int) -> None:
        """Capture a bucket's graph if it is new, counting it in the stats."""
        if bucket in runner.steps:
            return
        before = runner.capture_seconds
        runner.capture(bucket)
        self.stats.graph_captures += 1
        self.stats.capture_time += runner.capture_seconds - before

    def _sample_and_append(self, seqs, logits, argmax=None) -> None:
        """argmax: the rows' argmax when already computed (graph steps)."""
        if self.on_logits is not None:
            self.on_logits(seqs, logits)
        if self.group is None:
            chosen = self._choose(seqs, logits, argmax)
        else:
            chosen = self._root_choice(seqs, logits, argmax)
        for seq, token in zip(seqs, chosen):
            seq.output_ids.append(int(token))
            self.stats.generated_tokens += 1
            if self.on_token is not None:
                self.on_token(seq, int(token))
            if token in self.eos_ids and not seq.params.ignore_eos:
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= seq.params.max_new_tokens:
                self._finish(seq, "length")
            elif seq.num_tokens >= self.model.config.max_seq_len:
                self._finish(seq, "length")

    def _choose(self, seqs, logits, argmax) -> list[int]:
        """The next token of every sequence: greedy, or sampled on the host."""
        if all(s.params.greedy for s in seqs):
            # Only the ids cross to the host (the sync also makes step timings honest).
            if argmax is None:
                argmax = self.xp.argmax(logits, axis=-1)
            return _to_host(argmax).tolist()
        host = _to_host(logits)
        return [sample(host[i], s.params, s.rng) for i, s in enumerate(seqs)]

    def _root_choice(self, seqs, logits, argmax) -> list[int]:
        """Rank 0's choice on every rank (tensor parallel): the other ranks' logits are the
        same all-reduced sums, but only a broadcast makes their tokens the same for certain,
        sampled ones included."""
        group = self.group
        ids = np.zeros(len(seqs), dtype=np.int64)
        if group.rank == ROOT_RANK:
            ids[:] = self._choose(seqs, logits, argmax)
        return _to_host(group.broadcast(group.xp.asarray(ids), root=ROOT_RANK)).tolist()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        if reason == "cache_too_small":
            warnings.warn(self._cache_too_small_message(seq), CacheTooSmallWarning,
                          stacklevel=2)
            if self.on_token is not None:
                self.on_token(seq, None)

    def _cache_too_small_message(self, seq: Sequence) -> str:
        wanted = len(seq.prompt_ids) + seq.params.max_new_tokens
        return (f"sequence {seq.seq_id} stopped after {len(seq.output_ids)} of "
                f"{seq.params.max_new_tokens} new tokens ({len(seq.prompt_ids)}-token prompt): "
                f"the KV cache is too small ({self.total_blocks} blocks of {self.block_size} "
                f"tokens); raise num_blocks (generate.py: --num-blocks) to at least "
                f"{self._blocks_for(wanted)}, or the block size")


# Most float32 attention scores (heads x length^2 per sequence) one batched prefill attention
# may hold: 128 Mi elements, 512 MiB.
PREFILL_SCORES_BUDGET = 1 << 27


def prefill_groups(lengths, num_heads: int, budget: int = PREFILL_SCORES_BUDGET):
    """(first row, sequences, length) for prefill attention: consecutive prompts of one length
    go together (one batched attention instead of one per prompt: far fewer kernel launches),
    as many as keep their scores within `budget` elements."""
    groups, row, i = [], 0, 0
    while i < len(lengths):
        length = lengths[i]
        most = max(1, budget // (num_heads * length * length))
        count = 1
        while i + count < len(lengths) and lengths[i + count] == length and count < most:
            count += 1
        groups.append((row, count, length))
        row += count * length
        i += count
    return groups


def _to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)

"""Continuous batching over cupa's paged KV cache.

Each `step()` is either a prefill of newly admitted sequences or one decode step of every running
sequence (prefill first, so the batch refills as soon as blocks free up):

  waiting --admit (blocks reserved with cache.extend)--> running --EOS / max tokens--> finished
     ^                                                      |
     +------ preempted (blocks freed, recomputed later) ----+   when a decode step runs out of blocks

Preemption recomputes: a preempted sequence keeps its generated ids and is prefilled again over
prompt + output when readmitted, which reproduces the same cache contents (with an fp8 cache only
nearly: the recompute attends over unquantised K/V where the decode steps read fp8 codes).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import cupa

from .model import Model, causal_attention
from .sampling import SamplingParams, sample, sequence_rng

from cupa import OutOfBlocksError


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # 'stop' (EOS), 'length', or 'cache_too_small'
    preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

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


class Engine:
    """Runs requests to completion on `model` with KV stored in `cache` (a cupa.PagedKVCache).

    attention: 'paged' decodes with cupa.decode over the block tables; 'naive' gathers each
    sequence's KV into dense arrays and does matmul / softmax / matmul (the benchmark baseline).
    An fp8 cache (cache.kv_format set) stores codes and scales; both paths read it through them.
    on_token(seq, token_id) is called for every generated token (streaming).
    on_logits(seqs, logits) sees the float32 logits of every step before sampling (tests).
    """

    def __init__(self, model: Model, cache, *, eos_ids=(), attention="paged", max_batch=256,
                 max_prefill_tokens=8192, on_token=None, on_logits=None, backend=None):
        if attention not in ("paged", "naive"):
            raise ValueError(f"attention must be 'paged' or 'naive', got {attention!r}")
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
        """Move waiting sequences to running while their blocks fit, keeping one spare block per
        running sequence so the next decode step does not have to preempt at once."""
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            need = self._blocks_for(seq.num_tokens)
            if need > self.total_blocks or seq.num_tokens >= self.model.config.max_seq_len:
                self.waiting.popleft()
                self._finish(seq, "cache_too_small" if need > self.total_blocks else "length")
                continue
            alone = not self.running and not admitted
            reserve = len(self.running) + len(admitted) + 1
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
        """One slot per running sequence; preempts the newest sequences while blocks run out."""
        while True:
            try:
                return self.cache.extend([s.seq_id for s in self.running], 1)
            except OutOfBlocksError:
                if len(self.running) == 1:
                    # Alone and still out of blocks: the cache cannot hold a longer sequence.
                    self._finish(self.running[0], "length")
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
        kv_dtype = model.dtype

        def attend(layer, q, k, v):
            # cache.write quantises when the cache is fp8; the prompt's own attention below uses
            # the unquantised K/V (as fp8 engines do), only later decode steps read the codes.
            self.cache.write(layer, slots, k.astype(kv_dtype), v.astype(kv_dtype))
            out = xp.empty(q.shape, dtype=np.float32)
            for a, b in zip(bounds[:-1], bounds[1:]):
                out[a:b] = causal_attention(xp, q[a:b], k[a:b], v[a:b], model.scale)
            return out

        logits = model.forward(tokens, positions, attend, last_rows=xp.asarray(bounds[1:] - 1))
        self.running.extend(seqs)
        self._sample_and_append(seqs, logits)
        self.stats.prefill_tokens += int(bounds[-1])
        self.stats.prefill_time += time.perf_counter() - start

    def _decode(self) -> None:
        xp, model = self.xp, self.model
        start = time.perf_counter()
        slots = self._reserve_decode_slots()
        if slots is None:
            return
        slots = xp.asarray(slots)
        seqs = list(self.running)
        ids = [s.seq_id for s in seqs]
        tokens = xp.asarray(np.array([s.token_ids[-1] for s in seqs], dtype=np.int64))
        positions = xp.asarray(np.array([s.num_tokens - 1 for s in seqs], dtype=np.int64))
        # Tables are built and uploaded once per step, then every layer's cupa.decode uses them
        # (cache.decode(layer, ...) would rebuild them per layer).
        block_tables, seq_lens = self.cache.tables(ids)
        max_len = max(s.num_tokens for s in seqs)  # = seq_len after extend; no device read
        kv_dtype = query_dtype = model.dtype
        fp8 = {}
        if self.cache.kv_format:  # uint8 codes: cupa.decode needs the format and scales
            fp8 = dict(kv_format=self.cache.kv_format, k_scale=self.cache.k_scale,
                       v_scale=self.cache.v_scale)
            if query_dtype == np.float32:  # fp8 decode takes float16 / bfloat16 queries only
                query_dtype = np.dtype(np.float16)

        def attend(layer, q, k, v):
            self.cache.write(layer, slots, k.astype(kv_dtype), v.astype(kv_dtype))
            key_cache, value_cache = self.cache.key_cache(layer), self.cache.value_cache(layer)
            if self.attention == "naive":
                return naive_decode_attention(xp, q, key_cache, value_cache, block_tables,
                                              seq_lens, max_len, model.scale, **fp8)
            out = cupa.decode(q.astype(query_dtype), key_cache, value_cache, block_tables,
                              seq_lens, scale=model.scale, max_seq_len=max_len,
                              backend=self.backend, **fp8)
            return out.astype(np.float32)

        logits = model.forward(tokens, positions, attend)
        self._sample_and_append(seqs, logits)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        self.stats.decode_time += time.perf_counter() - start

    def _sample_and_append(self, seqs, logits) -> None:
        if self.on_logits is not None:
            self.on_logits(seqs, logits)
        if all(s.params.greedy for s in seqs):
            # Only the ids cross to the host (the sync also makes step timings honest).
            chosen = _to_host(self.xp.argmax(logits, axis=-1)).tolist()
        else:
            host = _to_host(logits)
            chosen = [sample(host[i], s.params, s.rng) for i, s in enumerate(seqs)]
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

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        if self.on_token is not None and reason == "cache_too_small":
            self.on_token(seq, None)


def naive_decode_attention(xp, q, key_cache, value_cache, block_tables, seq_lens, max_len, scale,
                           kv_format=None, k_scale=None, v_scale=None):
    """Decode attention without a paged kernel: gather every sequence's blocks into dense
    [seqs, kv_heads, max_len, d] arrays, then matmul, masked softmax, matmul (float32).
    With an fp8 kv_format the caches hold codes, dequantised with k_scale / v_scale
    (float32 [kv_heads]) after the gather."""
    num_seqs, heads, dim = q.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    # Unused table entries are -1; clamp them to a real block (its rows are masked out below).
    blocks = xp.maximum(block_tables[:, :math.ceil(max_len / block_size)], 0)

    def gather(cache, kv_scale):  # [seqs, nb, KV, bs, d] -> [seqs, KV, nb * bs, d]
        dense = cache[blocks].transpose(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, -1, dim)
        if kv_format:
            return cupa.dequantize_fp8(dense, kv_format, kv_scale[:, None, None])
        return dense.astype(np.float32)

    keys, values = gather(key_cache, k_scale), gather(value_cache, v_scale)
    qg = q.astype(np.float32).reshape(num_seqs, kv_heads, group, dim)
    scores = (qg @ keys.transpose(0, 1, 3, 2)) * np.float32(scale)    # [seqs, KV, group, L]
    valid = xp.arange(keys.shape[2])[None, :] < seq_lens[:, None]
    scores = xp.where(valid[:, None, None, :], scores, np.float32(-np.inf))
    scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return (probs @ values).reshape(num_seqs, heads, dim)


def _to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)

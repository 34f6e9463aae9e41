"""The Llama / Mistral / Qwen2 decoder forward pass, written once for numpy and cupy (`xp`).

Numerics: the residual stream, norms, rotary embedding, softmax and SiLU run in float32; matmuls
take their inputs in the weight dtype (float32 on the CPU path, the checkpoint's fp16/bf16 on the
GPU, where cuBLAS accumulates in float32) and return float32.

Attention is not done here: `forward` calls `attend(layer, q, k, v)` for each layer, so the same
model runs prefill (dense causal attention + cache writes), paged decode (cupa) and the naive
gather-based decode of the benchmark.

Tensor parallelism (tensor_parallel.py) needs one hook: `reduce`, applied to the attention's
output projection and to the MLP's down projection before their residual adds. A rank's model
holds its heads and MLP units only, so those two outputs are partial sums; `reduce` all-reduces
them (collectives.py). Without it (one GPU) nothing changes.

On the GPU the elementwise chains (RMS norm, rotary embedding, SiLU) run as fused kernels
(fused.py) with the same float32 arithmetic: a decode step is mostly kernel launches otherwise.
The array expressions below remain the numpy path and the definition of what they compute.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig, rope_inv_freq
from .fused import FusedOps
from .weights import ModelWeights


class Model:
    def __init__(self, config: ModelConfig, weights: ModelWeights, xp, dtype, *, fused=None,
                 reduce=None):
        """fused: use the fused GPU kernels (default: on for cupy; numpy has none).
        reduce(y) -> y summed over the tensor-parallel ranks (in place or not), for the float32
        [T, hidden] outputs of every layer's o and down projections; None: a single rank."""
        self.config, self.weights, self.xp = config, weights, xp
        self.reduce = reduce
        self.dtype = np.dtype(dtype)                       # weight / KV-cache dtype
        self.inv_freq = xp.asarray(rope_inv_freq(config))  # float32 [head_dim // 2]
        self.scale = config.head_dim ** -0.5
        if fused and xp is np:
            raise ValueError("fused=True: the fused kernels need cupy (the GPU backend)")
        self.fused = None
        if fused or (fused is None and xp is not np):
            self.fused = self._checked_fused_ops(required=bool(fused))

    def _checked_fused_ops(self, required: bool):
        """FusedOps once each kernel has matched the array expressions on a few random rows.
        The kernels are compiled at run time: a compile error or a wrong result falls back to
        the expressions with a warning (or raises, when fused=True was asked for)."""
        ops = FusedOps(self.dtype)
        try:
            problem = self._fused_mismatch(ops)
        except Exception as e:  # typically a kernel that does not compile on this setup
            problem = f"{type(e).__name__}: {e}"
        if problem is None:
            return ops
        if required:
            raise RuntimeError(f"fused GPU kernels failed their check: {problem}")
        warnings.warn(f"fused GPU kernels disabled ({problem}); running the plain cupy "
                      f"expressions instead", RuntimeWarning)
        return None

    def _fused_mismatch(self, ops: FusedOps) -> str | None:
        """Which fused kernel disagrees with the array expressions (self.fused must be None)."""
        cfg, xp = self.config, self.xp
        rng = np.random.default_rng(0)

        def rows(width):
            return xp.asarray(rng.standard_normal((3, width), dtype=np.float32))

        x, y = rows(cfg.hidden_size), rows(cfg.hidden_size)
        gate_up = rows(2 * cfg.intermediate_size)
        qkv = rows((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
        positions = xp.asarray(np.array([0, 7, 1000], dtype=np.int64))
        weight, eps = self.weights.norm, cfg.rms_norm_eps
        pairs = [("rms_norm", self.rms_norm(x, weight), ops.rms_norm(x, weight, eps)),
                 ("silu_mul", self.silu_mul(gate_up), ops.silu_mul(gate_up))]
        pairs += [(f"add_rms_norm ({i})", want, got) for i, (want, got) in enumerate(
            zip(self.add_rms_norm(x, y, weight), ops.add_rms_norm(x, y, weight, eps)))]
        # Two 5-token sequences: the fused softmax against the array expressions.
        q = xp.asarray(rng.standard_normal((10, cfg.num_heads, cfg.head_dim), dtype=np.float32))
        k, v = (xp.asarray(rng.standard_normal((10, cfg.num_kv_heads, cfg.head_dim),
                                               dtype=np.float32)) for _ in range(2))
        pairs.append(("causal_softmax", causal_attention(xp, q, k, v, self.scale, 2),
                      causal_attention(xp, q, k, v, self.scale, 2, ops.causal_softmax)))
        bias = xp.asarray(rng.standard_normal(qkv.shape[1], dtype=np.float32))
        fused_rope = ops.rope_tables(positions, self.inv_freq)
        for label, add in (("", None), (" + bias", bias)):
            fused_qkv = ops.split_qkv(qkv, fused_rope, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.head_dim, bias=add)
            plain = qkv if add is None else qkv + add
            pairs += [(f"split_qkv{label} ({name})", want, got) for name, want, got in
                      zip("qkv", self.split_qkv(plain, self.rotary(positions)), fused_qkv)]
        for name, want, got in pairs:
            # float16 outputs are rounded (2^-11 relative); float32 ones may differ by fused
            # multiply-adds only.
            bound = 1e-5 if got.dtype == np.float32 else 2e-3
            want, got = want.astype(np.float32), got.astype(np.float32)
            error = float(xp.abs(got - want).max() / max(float(xp.abs(want).max()), 1e-30))
            if got.shape != want.shape or not error <= bound:
                return f"{name} differs from the array expression by {error:.1e}"
        return None

    # -- building blocks -------------------------------------------------------------------------

    def linear(self, x, weight, bias=None, matmul=None, out=None):
        """x [T, in] (float32 or the weight dtype) times weight [out, in] (+ bias) -> float32
        [T, out]. matmul(x, weight) -> float32 x @ weight.T replaces the array operator (the
        graph-captured decode step passes cuBLAS or hipBLAS called directly, see blas.py);
        `out` (float32 [T, out]) is where matmul(x, weight, out=out) writes, when given."""
        if matmul is not None:
            y = matmul(x, weight) if out is None else matmul(x, weight, out=out)
        else:
            y = (x.astype(weight.dtype, copy=False) @ weight.T).astype(np.float32, copy=False)
        if bias is not None:  # the fused path casts each bias once, not at every call
            y = y + (self.fused.as_float32(bias) if self.fused is not None
                     else bias.astype(np.float32, copy=False))
        return y

    def rms_norm(self, x, weight):
        """float32 x [T, H] -> normalised x times weight: float32, or on the fused GPU path the
        matmul input dtype (the linear that follows needs no cast then)."""
        if self.fused is not None:
            return self.fused.rms_norm(x, weight, self.config.rms_norm_eps)
        xp = self.xp
        variance = (x * x).mean(axis=-1, keepdims=True)
        normed = x * (1.0 / xp.sqrt(variance + np.float32(self.config.rms_norm_eps)))
        return normed * weight.astype(np.float32, copy=False)

    def rotary(self, positions):
        """(cos, sin), each float32 [T, 1, head_dim], for the 'rotate half' convention (fused
        GPU path: [T, head_dim / 2], what its kernel reads)."""
        if self.fused is not None:
            return self.fused.rope_tables(positions, self.inv_freq)
        xp = self.xp
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        angles = xp.concatenate([freqs, freqs], axis=-1)[:, None, :]
        return xp.cos(angles), xp.sin(angles)

    def apply_rotary(self, x, cos, sin):
        """x [T, heads, head_dim]: first and second halves rotate as pairs (x_i, x_{i + d/2})."""
        half = x.shape[-1] // 2
        rotated = self.xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def split_qkv(self, qkv, rope):
        """Fused projection float32 [T, (H + 2 KV) * d] -> q [T, H, d], k and v [T, KV, d],
        rotary applied to q and k; `rope` is rotary(positions). float32, except on the fused GPU
        path: the model dtype (what the cache stores and paged decode reads), q contiguous."""
        cfg = self.config
        if self.fused is not None:
            return self.fused.split_qkv(qkv, rope, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim)
        n = qkv.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        cos, sin = rope
        q = qkv[:, :q_size].reshape(n, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        return (self.apply_rotary(q, cos, sin), self.apply_rotary(k, cos, sin),
                self.xp.ascontiguousarray(v))

    def attention_inputs(self, h, layer, rope, matmul=None, buffers=None):
        """A layer's q, k, v (split_qkv's) from the normed hidden state h: the fused projection,
        its bias and the rotary embedding. The fused GPU path adds the bias in split_qkv's
        kernel instead of with launches of its own, and writes into `buffers` when given."""
        if self.fused is None:
            return self.split_qkv(self.linear(h, layer.qkv, layer.qkv_bias, matmul), rope)
        cfg = self.config
        qkv = self.linear(h, layer.qkv, matmul=matmul, out=buffers and buffers.qkv)
        return self.fused.split_qkv(qkv, rope, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    bias=layer.qkv_bias, out=buffers and buffers.split)

    def add_rms_norm(self, x, y, weight, out=None):
        """The residual add and the norm after it: (x + y, rms_norm(x + y)) (one pass on the
        fused GPU path, into the arrays `out` when given)."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, y, weight, self.config.rms_norm_eps, out=out)
        x = x + y
        return x, self.rms_norm(x, weight)

    def causal_attention(self, q, k, v, num_seqs=1):
        """Prefill attention of equal-length sequences (see the module function)."""
        softmax = self.fused.causal_softmax if self.fused is not None else None
        return causal_attention(self.xp, q, k, v, self.scale, num_seqs, softmax)

    def silu_mul(self, gate_up, out=None):
        """float32 [T, 2 * inter] (gate, then up) -> SiLU(gate) * up [T, inter] (float32, or
        the matmul input dtype on the fused GPU path, into `out` when given)."""
        if self.fused is not None:
            return self.fused.silu_mul(gate_up, out=out)
        inter = self.config.intermediate_size
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return gate / (1.0 + self.xp.exp(-gate)) * up

    # -- the network -----------------------------------------------------------------------------

    def step_buffers(self, rows: int) -> "StepBuffers | None":
        """The layers' output arrays for forwards of `rows` tokens (fused GPU path; None on
        the array path, which allocates as numpy does)."""
        if self.fused is None:
            return None
        cfg, xp = self.config, self.xp
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        out_dtype = self.fused.out_dtype

        def floats(width, dtype=np.float32):
            return xp.empty((rows, width), dtype=dtype)

        return StepBuffers(rows, qkv=floats(qkv_width),
                           split=xp.empty(rows * qkv_width, dtype=out_dtype),
                           o=floats(cfg.hidden_size),
                           residual=(floats(cfg.hidden_size), floats(cfg.hidden_size)),
                           h=floats(cfg.hidden_size, out_dtype),
                           gate_up=floats(2 * cfg.intermediate_size),
                           act=floats(cfg.intermediate_size, out_dtype),
                           down=floats(cfg.hidden_size))

    def forward(self, token_ids, positions, attend, last_rows=None, matmul=None, buffers=None):
        """Logits (float32 [rows, vocab]) for tokens `token_ids` at `positions` (xp int arrays).

        attend(layer, q, k, v) gets q [T, heads, d], k and v [T, kv_heads, d] as split_qkv
        returns them (rotary applied) and returns [T, heads, d] in float32 or the model dtype
        (the output projection casts to the weight dtype either way). `last_rows` picks the rows
        whose logits are wanted (default: all), so prefill computes the LM head only for each
        prompt's last token. matmul: see `linear`. buffers: step_buffers(T), where every layer
        writes its outputs instead of allocating them (q, k and v are then views of one of
        them, valid until the next layer: attend must be done with them by its return).
        """
        w = self.weights
        n = token_ids.shape[0]
        b = buffers
        if b is not None and b.rows != n:  # the kernels write as many rows as they are given
            raise ValueError(f"buffers: made for {b.rows} rows, the forward has {n}")
        rope = self.rotary(positions)
        x = w.embed[token_ids].astype(np.float32)
        # Every residual add goes with the norm after it: the layer's post-attention norm, the
        # next layer's input norm, or after the last layer the final norm.
        next_norms = [layer.input_norm for layer in w.layers[1:]] + [w.norm]
        h = self.rms_norm(x, w.layers[0].input_norm if w.layers else w.norm)
        # With buffers (`b and b.name` is None without) the residual stream alternates between
        # two arrays, so that an add never writes the array it reads; every other buffer is
        # read by the next operation before the next layer writes it (one stream orders them
        # on the GPU).
        for index, (layer, next_norm) in enumerate(zip(w.layers, next_norms)):
            q, k, v = self.attention_inputs(h, layer, rope, matmul, b)
            attn = attend(index, q, k, v)
            o = self.linear(attn.reshape(n, -1), layer.o, layer.o_bias, matmul, b and b.o)
            if self.reduce is not None:  # the ranks' heads' partial sums (o_bias: rank 0 only)
                o = self.reduce(o)
            x, h = self.add_rms_norm(x, o, layer.post_norm, b and (b.residual[0], b.h))

            gate_up = self.linear(h, layer.gate_up, layer.gate_up_bias, matmul, b and b.gate_up)
            act = self.silu_mul(gate_up, b and b.act)
            down = self.linear(act, layer.down, layer.down_bias, matmul, b and b.down)
            if self.reduce is not None:
                down = self.reduce(down)
            x, h = self.add_rms_norm(x, down, next_norm, b and (b.residual[1], b.h))
        if last_rows is not None:
            h = h[last_rows]
        return self.linear(h, w.lm_head, matmul=matmul)


@dataclass
class StepBuffers:
    """Where the layers of a forward of `rows` tokens write their outputs (Model.step_buffers):
    allocated once and used by every layer and by later forwards of as many rows, so that a
    decode step allocates nothing per layer."""

    rows: int
    qkv: object        # float32 [rows, (H + 2 KV) * d]: the fused projection
    split: object      # [rows * (H + 2 KV) * d] of FusedOps.out_dtype: q, then k and v
    o: object          # float32 [rows, hidden]: the attention's output projection
    residual: tuple    # two float32 [rows, hidden]: the residual stream, written in turn
    h: object          # [rows, hidden] of out_dtype: the normed hidden state
    gate_up: object    # float32 [rows, 2 * intermediate]
    act: object        # [rows, intermediate] of out_dtype: SiLU(gate) * up
    down: object       # float32 [rows, hidden]


def causal_attention(xp, q, k, v, scale, num_seqs=1, softmax=None):
    """Dense causal attention of `num_seqs` sequences of one length L, laid end to end:
    q [num_seqs * L, H, d], k/v [num_seqs * L, KV, d] -> [num_seqs * L, H, d] float32.

    Grouped-query heads are handled by viewing the query heads as [KV, group] instead of copying
    K and V per query head. softmax(scores, L, scale): a fused in-place causal softmax of float32
    scores [..., L] (the GPU's, fused.py); None computes it with array expressions.
    """
    rows, heads, dim = q.shape
    length = rows // num_seqs
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.astype(np.float32).reshape(num_seqs, length, kv_heads, group, dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, group * length, dim)
    k = k.astype(np.float32).reshape(num_seqs, length, kv_heads, dim).transpose(0, 2, 3, 1)
    v = v.astype(np.float32).reshape(num_seqs, length, kv_heads, dim).transpose(0, 2, 1, 3)
    scores = q @ k                                          # [S, KV, group * L, L]
    if softmax is not None:
        probs = softmax(xp.ascontiguousarray(scores), length, scale)
    else:
        scores = scores.reshape(num_seqs, kv_heads, group, length, length) * np.float32(scale)
        future = xp.triu(xp.ones((length, length), dtype=bool), k=1)
        scores = xp.where(future, np.float32(-np.inf), scores)
        scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
    out = probs.reshape(num_seqs, kv_heads, group * length, length) @ v  # [S, KV, group * L, d]
    out = out.reshape(num_seqs, kv_heads, group, length, dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(rows, heads, dim)

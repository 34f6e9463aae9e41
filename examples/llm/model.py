"""The Llama / Mistral / Qwen2 decoder forward pass, written once for numpy and cupy (`xp`).

Numerics: the residual stream, norms, rotary embedding, softmax and SiLU run in float32; matmuls
take their inputs in the weight dtype (float32 on the CPU path, the checkpoint's fp16/bf16 on the
GPU, where cuBLAS accumulates in float32) and return float32.

Attention is not done here: `forward` calls `attend(layer, q, k, v)` for each layer, so the same
model runs prefill (dense causal attention + cache writes), paged decode (cupa) and the naive
gather-based decode of the benchmark.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig, rope_inv_freq
from .weights import ModelWeights


class Model:
    def __init__(self, config: ModelConfig, weights: ModelWeights, xp, dtype):
        self.config, self.weights, self.xp = config, weights, xp
        self.dtype = np.dtype(dtype)                       # weight / KV-cache dtype
        self.inv_freq = xp.asarray(rope_inv_freq(config))  # float32 [head_dim // 2]
        self.scale = config.head_dim ** -0.5

    # -- building blocks -------------------------------------------------------------------------

    def linear(self, x, weight, bias=None):
        """float32 x [T, in] times weight [out, in] (+ bias) -> float32 [T, out]."""
        y = (x.astype(weight.dtype, copy=False) @ weight.T).astype(np.float32, copy=False)
        if bias is not None:
            y = y + bias.astype(np.float32, copy=False)
        return y

    def rms_norm(self, x, weight):
        xp = self.xp
        variance = (x * x).mean(axis=-1, keepdims=True)
        normed = x * (1.0 / xp.sqrt(variance + np.float32(self.config.rms_norm_eps)))
        return normed * weight.astype(np.float32, copy=False)

    def rotary(self, positions):
        """(cos, sin), each float32 [T, 1, head_dim], for the 'rotate half' convention."""
        xp = self.xp
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        angles = xp.concatenate([freqs, freqs], axis=-1)[:, None, :]
        return xp.cos(angles), xp.sin(angles)

    def apply_rotary(self, x, cos, sin):
        """x [T, heads, head_dim]: first and second halves rotate as pairs (x_i, x_{i + d/2})."""
        half = x.shape[-1] // 2
        rotated = self.xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    # -- the network -----------------------------------------------------------------------------

    def forward(self, token_ids, positions, attend, last_rows=None):
        """Logits (float32 [rows, vocab]) for tokens `token_ids` at `positions` (xp int arrays).

        attend(layer, q, k, v) gets float32 q [T, heads, d], k and v [T, kv_heads, d] (rotary
        applied) and returns float32 [T, heads, d]. `last_rows` picks the rows whose logits are
        wanted (default: all), so prefill computes the LM head only for each prompt's last token.
        """
        cfg, w, xp = self.config, self.weights, self.xp
        n = token_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        cos, sin = self.rotary(positions)
        x = w.embed[token_ids].astype(np.float32)
        for index, layer in enumerate(w.layers):
            h = self.rms_norm(x, layer.input_norm)
            qkv = self.linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].reshape(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(n, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
            q = self.apply_rotary(q, cos, sin)
            k = self.apply_rotary(k, cos, sin)
            attn = attend(index, q, k, xp.ascontiguousarray(v))
            x = x + self.linear(attn.reshape(n, q_size), layer.o, layer.o_bias)

            h = self.rms_norm(x, layer.post_norm)
            gate_up = self.linear(h, layer.gate_up, layer.gate_up_bias)
            gate, up = gate_up[:, :cfg.intermediate_size], gate_up[:, cfg.intermediate_size:]
            act = gate / (1.0 + xp.exp(-gate)) * up          # SiLU(gate) * up
            x = x + self.linear(act, layer.down, layer.down_bias)
        if last_rows is not None:
            x = x[last_rows]
        return self.linear(self.rms_norm(x, w.norm), w.lm_head)


def causal_attention(xp, q, k, v, scale):
    """Dense causal attention of one sequence: q [L, H, d], k/v [L, KV, d] -> [L, H, d] float32.

    Grouped-query heads are handled by viewing the query heads as [KV, group] instead of copying
    K and V per query head.
    """
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.astype(np.float32).reshape(length, kv_heads, group, dim).transpose(1, 2, 0, 3)
    k = k.astype(np.float32).transpose(1, 2, 0)            # [KV, d, L]
    v = v.astype(np.float32).transpose(1, 0, 2)            # [KV, L, d]
    scores = (q.reshape(kv_heads, group * length, dim) @ k) * np.float32(scale)
    scores = scores.reshape(kv_heads, group, length, length)
    future = xp.triu(xp.ones((length, length), dtype=bool), k=1)
    scores = xp.where(future, np.float32(-np.inf), scores)
    scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = probs.reshape(kv_heads, group * length, length) @ v   # [KV, group * L, d]
    return out.reshape(kv_heads, group, length, dim).transpose(2, 0, 1, 3).reshape(length, heads, dim)

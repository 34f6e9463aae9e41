"""Fused kernels for the GPU forward pass (cupy only).

Written with plain array expressions, a decoder layer is some fifty small kernels: the RMS norm
alone is seven (square, mean, add, sqrt, reciprocal, two products) plus a cast for the matmul
that follows, rotary embedding is six per tensor, and a prefill's masked softmax is eight passes
over a [heads, length, length] array. At decode batch sizes each kernel moves a few kilobytes, so
their count, not their bytes, sets the step time (on the host when launched one by one, and still
a few microseconds each inside a CUDA graph). The kernels here do each chain in one or two
launches with the same float32 arithmetic in the same order; only the rounding of fused
multiply-adds (and of exp) may differ in the last bit. The numpy path keeps the array
expressions (model.py), which stay the readable definition of what these compute, and
Model checks every kernel against them once at start-up.
"""

from __future__ import annotations

import functools

import numpy as np

# Matmul input dtypes the kernels write directly (the cast the matmul would otherwise launch).
# bfloat16 is left to cupy's own cast: its support in user kernels varies by cupy version.
DIRECT_OUTPUT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))

# Threads per row of the row kernels (a power of two: the tree reductions halve it).
_ROW_THREADS = 256

# Row kernels: one workgroup per row; each thread takes a strided share of the row and a
# shared-memory tree combines the shares. (Raw kernels: cupy's ReductionKernel goes through
# CUB's block reduce, whose template does not compile for user kernels with cupy 14.2.)
_ROW_SOURCE = r"""
__device__ float block_reduce(float value, float* partial, const bool take_max) {
    partial[threadIdx.x] = value;
    __syncthreads();
    for (int stride = ROW_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float other = partial[threadIdx.x + stride];
            partial[threadIdx.x] = take_max ? fmaxf(partial[threadIdx.x], other)
                                            : partial[threadIdx.x] + other;
        }
        __syncthreads();
    }
    const float result = partial[0];
    __syncthreads();  // `partial` may be reused right away
    return result;
}

// ss[row] = sum of x[row, :]^2 (x: float32 [rows, cols]).
extern "C" __global__ void llm_row_sum_squares(const float* __restrict__ x,
                                               float* __restrict__ ss, const int cols) {
    __shared__ float partial[ROW_THREADS];
    const float* row = x + (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float v = row[c];
        sum += v * v;
    }
    sum = block_reduce(sum, partial, false);
    if (threadIdx.x == 0) ss[blockIdx.x] = sum;
}

// The residual add followed by the next norm's sum of squares: out = x + y, ss = sum(out^2).
extern "C" __global__ void llm_add_row_sum_squares(const float* __restrict__ x,
                                                   const float* __restrict__ y,
                                                   float* __restrict__ out,
                                                   float* __restrict__ ss, const int cols) {
    __shared__ float partial[ROW_THREADS];
    const long long start = (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float v = x[start + c] + y[start + c];
        out[start + c] = v;
        sum += v * v;
    }
    sum = block_reduce(sum, partial, false);
    if (threadIdx.x == 0) ss[blockIdx.x] = sum;
}

// Causal softmax in place over rows of scores [..., length] whose query position is
// row % length: p = exp(s * scale - max) / sum over keys 0..position, 0 after it.
extern "C" __global__ void llm_causal_softmax(float* __restrict__ scores, const int length,
                                              const float scale) {
    __shared__ float partial[ROW_THREADS];
    float* row = scores + (long long)blockIdx.x * length;
    const int last = (int)(blockIdx.x % (unsigned int)length);
    float top = -3.402823466e+38f;
    for (int j = threadIdx.x; j <= last; j += ROW_THREADS) top = fmaxf(top, row[j] * scale);
    top = block_reduce(top, partial, true);
    float sum = 0.0f;
    for (int j = threadIdx.x; j <= last; j += ROW_THREADS) sum += expf(row[j] * scale - top);
    sum = block_reduce(sum, partial, false);
    for (int j = threadIdx.x; j < length; j += ROW_THREADS)
        row[j] = j <= last ? expf(row[j] * scale - top) / sum : 0.0f;
}
""".replace("ROW_THREADS", str(_ROW_THREADS))


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    module = cupy.RawModule(code=_ROW_SOURCE)
    rows = {name: module.get_function(name) for name in
            ("llm_row_sum_squares", "llm_add_row_sum_squares", "llm_causal_softmax")}
    # variance = sum / cols, then x * (1 / sqrt(variance + eps)) * weight: model.rms_norm's
    # order. (`n` is reserved in elementwise kernels, hence `cols`.)
    rms_scale = cupy.ElementwiseKernel(
        "float32 x, float32 ss, float32 w, float32 cols, float32 eps", "O y",
        "y = O(x * (1.0f / sqrtf(ss / cols + eps)) * w);", "llm_rms_scale")
    # qkv [tokens, heads * dim] (query heads, then key heads, then value heads) -> one flat
    # output: q [tokens, num_heads, dim] first (contiguous, as paged decode wants its query),
    # then k and v together [tokens, heads - num_heads, dim]. The first `rot_heads` heads (query
    # and key) are rotated in pairs (x_d, x_{d + dim/2}): first half x * cos - partner * sin,
    # second half x * cos + partner * sin (rotate-half); value heads are copied.
    rope_qkv = cupy.ElementwiseKernel(
        "raw float32 qkv, raw float32 cos_t, raw float32 sin_t, int32 num_heads, int32 heads, "
        "int32 rot_heads, int32 dim, int64 q_size", "O out",
        """
        const long long idx = i;
        const long long d = idx % dim;
        long long t, head;
        if (idx < q_size) {
            t = idx / ((long long)num_heads * dim);
            head = (idx / dim) % num_heads;
        } else {
            const long long rest = idx - q_size;
            const long long kv_heads = heads - num_heads;
            t = rest / (kv_heads * dim);
            head = num_heads + (rest / dim) % kv_heads;
        }
        const long long src = (t * heads + head) * dim + d;
        const float x = qkv[src];
        float value = x;
        if (head < rot_heads) {
            const long long half_dim = dim / 2;
            const long long j = d < half_dim ? d : d - half_dim;
            const float c = cos_t[t * half_dim + j];
            const float s = sin_t[t * half_dim + j];
            value = d < half_dim ? x * c - qkv[src + half_dim] * s
                                 : x * c + qkv[src - half_dim] * s;
        }
        out = O(value);
        """, "llm_rope_qkv")
    # gate_up [tokens, 2 * inter] -> SiLU(gate) * up [tokens, inter], as gate / (1 + exp(-gate))
    # * up (model.silu_mul's expression).
    silu_mul = cupy.ElementwiseKernel(
        "raw float32 gate_up, int32 inter", "O out",
        """
        const long long idx = i;
        const long long t = idx / inter;
        const long long j = idx - t * inter;
        const float g = gate_up[t * 2 * inter + j];
        const float u = gate_up[t * 2 * inter + inter + j];
        out = O(g / (1.0f + expf(-g)) * u);
        """, "llm_silu_mul")
    return cupy, rows, rms_scale, rope_qkv, silu_mul


class FusedOps:
    """The GPU implementations of Model's elementwise chains.

    out_dtype: what rms_norm, split_qkv and silu_mul write: the weight dtype when the kernels can
    write it (so the following matmul, cache write or paged decode needs no cast), else float32.
    """

    def __init__(self, weight_dtype):
        weight_dtype = np.dtype(weight_dtype)
        self.out_dtype = (weight_dtype if weight_dtype in DIRECT_OUTPUT_DTYPES
                          else np.dtype(np.float32))
        self._float32 = {}  # id(weight) -> (weight, float32 copy): norm weights, cast once

    def _as_float32(self, weight):
        if weight.dtype == np.float32:
            return weight
        entry = self._float32.get(id(weight))
        if entry is None or entry[0] is not weight:
            # The weight itself is kept in the entry so its id cannot be reused by another array.
            entry = self._float32[id(weight)] = (weight, weight.astype(np.float32))
        return entry[1]

    def rms_norm(self, x, weight, eps: float):
        """x float32 [T, H] -> normalised x times weight, [T, H] of out_dtype."""
        cupy, rows, _, _, _ = _kernels()
        x = cupy.ascontiguousarray(x.astype(np.float32, copy=False))
        ss = cupy.empty((x.shape[0], 1), dtype=np.float32)
        if x.shape[0]:
            rows["llm_row_sum_squares"]((x.shape[0],), (_ROW_THREADS,),
                                        (x, ss, np.int32(x.shape[-1])))
        return self._scale(x, ss, weight, eps)

    def add_rms_norm(self, x, y, weight, eps: float):
        """(x + y, rms_norm(x + y)) for float32 x, y [T, H], with the sum and the norm's sum of
        squares in one pass."""
        cupy, rows, _, _, _ = _kernels()
        x = cupy.ascontiguousarray(x.astype(np.float32, copy=False))
        y = cupy.ascontiguousarray(y.astype(np.float32, copy=False))
        total = cupy.empty(x.shape, dtype=np.float32)
        ss = cupy.empty((x.shape[0], 1), dtype=np.float32)
        if x.shape[0]:
            rows["llm_add_row_sum_squares"]((x.shape[0],), (_ROW_THREADS,),
                                            (x, y, total, ss, np.int32(x.shape[-1])))
        return total, self._scale(total, ss, weight, eps)

    def _scale(self, x, ss, weight, eps):
        cupy, _, rms_scale, _, _ = _kernels()
        y = cupy.empty(x.shape, dtype=self.out_dtype)
        rms_scale(x, ss, self._as_float32(weight), np.float32(x.shape[-1]), np.float32(eps), y)
        return y

    @staticmethod
    def rope_tables(positions, inv_freq):
        """(cos, sin), each float32 [T, head_dim / 2], of positions x inverse frequencies."""
        cupy = _kernels()[0]
        freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
        return cupy.cos(freqs), cupy.sin(freqs)

    def split_qkv(self, qkv, rope, num_heads, num_kv_heads, head_dim):
        """Fused projection output float32 [T, (H + 2 KV) * d] -> q [T, H, d] (contiguous), k and
        v [T, KV, d] (views), of out_dtype, rotary applied to q and k."""
        cupy, _, _, rope_qkv, _ = _kernels()
        qkv = cupy.ascontiguousarray(qkv)
        tokens, heads = qkv.shape[0], num_heads + 2 * num_kv_heads
        q_size = tokens * num_heads * head_dim
        out = cupy.empty(tokens * heads * head_dim, dtype=self.out_dtype)
        cos, sin = rope
        rope_qkv(qkv, cos, sin, np.int32(num_heads), np.int32(heads),
                 np.int32(num_heads + num_kv_heads), np.int32(head_dim), np.int64(q_size), out)
        q = out[:q_size].reshape(tokens, num_heads, head_dim)
        kv = out[q_size:].reshape(tokens, 2 * num_kv_heads, head_dim)
        return q, kv[:, :num_kv_heads], kv[:, num_kv_heads:]

    def silu_mul(self, gate_up):
        """float32 [T, 2 * inter] (gate, then up) -> SiLU(gate) * up, [T, inter] of out_dtype."""
        cupy, _, _, _, silu_mul = _kernels()
        gate_up = cupy.ascontiguousarray(gate_up)
        inter = gate_up.shape[-1] // 2
        out = cupy.empty((gate_up.shape[0], inter), dtype=self.out_dtype)
        silu_mul(gate_up, np.int32(inter), out)
        return out

    @staticmethod
    def causal_softmax(scores, length: int, scale: float):
        """In place: float32 scores [..., length] (contiguous; row r is query position
        r % length) -> causal softmax(scale * scores). Returns scores."""
        _, rows, _, _, _ = _kernels()
        count = scores.size // length
        if count:
            rows["llm_causal_softmax"]((count,), (_ROW_THREADS,),
                                       (scores, np.int32(length), np.float32(scale)))
        return scores

"""Fused kernels for the GPU forward pass (cupy only).

Written with plain array expressions, a decoder layer is some fifty small kernels: the RMS norm
alone is seven (square, mean, add, sqrt, reciprocal, two products) plus a cast for the matmul
that follows, rotary embedding is six per tensor, and a prefill's masked softmax is eight passes
over a [heads, length, length] array. At decode batch sizes each kernel moves a few kilobytes, so
their count, not their bytes, sets the step time (on the host when launched one by one, and still
a few microseconds each inside a CUDA graph). The kernels here do each chain in one launch (the
residual add with the norm after it, the projection's bias with the rotary embedding) with the
same float32 arithmetic in the same order; only the rounding of fused multiply-adds (and of exp,
cos, sin) may differ in the last bit. The numpy path keeps the array expressions (model.py),
which stay the readable definition of what these compute, and Model checks every kernel against
them once at start-up. Every op can write into arrays it is given (`out`), so that a decode step
allocates nothing per layer (model.StepBuffers). tests/unit/test_fused_kernels_cpu.py runs these
kernels on the CPU (tests/helpers/cuda_on_cpu.py), tests/offline/test_fused_offline.py compiles
them for NVIDIA and AMD targets.
"""

from __future__ import annotations

import functools

import numpy as np

# Matmul input dtypes the kernels write directly (the cast the matmul would otherwise launch),
# and the suffix of their kernels' names. bfloat16 is left to cupy's own cast.
OUTPUT_KERNEL_SUFFIX = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}

# Threads per row of the row kernels (a power of two: the tree reductions halve it), and per
# workgroup of the elementwise ones, which stride over their outputs from a grid of at most
# _MAX_GRID workgroups.
_ROW_THREADS = 256
_ELEMENT_THREADS = 256
_MAX_GRID = 4096

# Every kernel is a raw kernel: a cupy ElementwiseKernel call costs several times a raw launch on
# the host (argument typing, broadcasting), and a decode step is host-bound at small batches.
# Row kernels: one workgroup per row; each thread takes a strided share of the row and a
# shared-memory tree combines the shares. (cupy's ReductionKernel goes through CUB's block
# reduce, whose template does not compile for user kernels with cupy 14.2.) Outputs of float16
# are stored as their bits, rounded to nearest even as a cast does, so that no fp16 header is
# needed (NVRTC finds none without the CUDA toolkit's headers).
_SOURCE = r"""
#if defined(__HIP__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
__device__ inline unsigned short half_bits(float v) {
    return __builtin_bit_cast(unsigned short, (_Float16)v);
}
#else
__device__ inline unsigned short half_bits(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
#endif
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(unsigned short* p, float v) { *p = half_bits(v); }

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

// y[row] = x[row] * (1 / sqrt(sum(x[row]^2) / cols + eps)) * w: model.rms_norm's order.
template <typename Out>
__device__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                         Out* __restrict__ y, const int cols, const float eps) {
    __shared__ float partial[ROW_THREADS];
    const long long start = (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float v = x[start + c];
        sum += v * v;
    }
    sum = block_reduce(sum, partial, false);
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS)
        store(y + start + c, x[start + c] * inv * w[c]);
}

// The residual add and the norm after it: total = x + y, h = rms_norm(total). Each thread reads
// back only the elements of `total` it wrote itself.
template <typename Out>
__device__ void add_rms_norm(const float* __restrict__ x, const float* __restrict__ y,
                             const float* __restrict__ w, float* __restrict__ total,
                             Out* __restrict__ h, const int cols, const float eps) {
    __shared__ float partial[ROW_THREADS];
    const long long start = (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float v = x[start + c] + y[start + c];
        total[start + c] = v;
        sum += v * v;
    }
    sum = block_reduce(sum, partial, false);
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS)
        store(h + start + c, total[start + c] * inv * w[c]);
}

// qkv [tokens, heads * dim] (query heads, then key heads, then value heads), plus `bias`
// [heads * dim] where not null -> one flat output: q [tokens, num_heads, dim] first
// (contiguous, as paged decode wants its query), then k and v together [tokens, heads -
// num_heads, dim]. The first `rot_heads` heads (query and key) are rotated in pairs (x_d,
// x_{d + dim/2}): first half x * cos - partner * sin, second half x * cos + partner * sin
// (rotate-half); value heads are copied. cos_t, sin_t: [tokens, dim / 2].
template <typename Out>
__device__ void rope_qkv(const float* __restrict__ qkv, const float* __restrict__ bias,
                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                         Out* __restrict__ out, const int num_heads, const int heads,
                         const int rot_heads, const int dim, const long long q_size,
                         const long long total) {
    const long long half_dim = dim / 2;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
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
        const long long column = head * dim + d;
        const float* row = qkv + t * heads * dim;
        float x = row[column];
        if (bias) x += bias[column];
        float value = x;
        if (head < rot_heads) {
            const long long j = d < half_dim ? d : d - half_dim;
            const float c = cos_t[t * half_dim + j];
            const float s = sin_t[t * half_dim + j];
            const long long other = d < half_dim ? column + half_dim : column - half_dim;
            float partner = row[other];
            if (bias) partner += bias[other];
            value = d < half_dim ? x * c - partner * s : x * c + partner * s;
        }
        store(out + idx, value);
    }
}

// gate_up [tokens, 2 * inter] -> SiLU(gate) * up [tokens, inter], as gate / (1 + exp(-gate)) * up
// (model.silu_mul's expression).
template <typename Out>
__device__ void silu_mul(const float* __restrict__ gate_up, Out* __restrict__ out,
                         const long long inter, const long long total) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / inter;
        const long long j = idx - t * inter;
        const float g = gate_up[t * 2 * inter + j];
        const float u = gate_up[t * 2 * inter + inter + j];
        store(out + idx, g / (1.0f + expf(-g)) * u);
    }
}

#define OUTPUT_KERNELS(SUFFIX, OUT)                                                             \
extern "C" __global__ void llm_rms_norm_##SUFFIX(const float* x, const float* w, OUT* y,        \
                                                 const int cols, const float eps) {             \
    rms_norm(x, w, y, cols, eps);                                                              \
}                                                                                              \
extern "C" __global__ void llm_add_rms_norm_##SUFFIX(const float* x, const float* y,            \
                                                     const float* w, float* total, OUT* h,      \
                                                     const int cols, const float eps) {         \
    add_rms_norm(x, y, w, total, h, cols, eps);                                                \
}                                                                                              \
extern "C" __global__ void llm_rope_qkv_##SUFFIX(                                               \
        const float* qkv, const float* bias, const float* cos_t, const float* sin_t, OUT* out, \
        const int num_heads, const int heads, const int rot_heads, const int dim,              \
        const long long q_size, const long long total) {                                       \
    rope_qkv(qkv, bias, cos_t, sin_t, out, num_heads, heads, rot_heads, dim, q_size, total);   \
}                                                                                              \
extern "C" __global__ void llm_silu_mul_##SUFFIX(const float* gate_up, OUT* out,                \
                                                 const long long inter, const long long total) {\
    silu_mul(gate_up, out, inter, total);                                                      \
}

OUTPUT_KERNELS(f32, float)
OUTPUT_KERNELS(f16, unsigned short)

// cos and sin [tokens, half] of positions x inverse frequencies: model.rotary's float32
// product (the position rounded to float32 first), then cosf / sinf.
extern "C" __global__ void llm_rope_tables(const long long* __restrict__ positions,
                                           const float* __restrict__ inv_freq,
                                           float* __restrict__ cos_t, float* __restrict__ sin_t,
                                           const int half, const long long total) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / half;
        const float angle = (float)positions[t] * inv_freq[idx - t * half];
        cos_t[idx] = cosf(angle);
        sin_t[idx] = sinf(angle);
    }
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

KERNEL_NAMES = ("llm_rope_tables", "llm_causal_softmax") + tuple(
    f"llm_{op}_{suffix}" for op in ("rms_norm", "add_rms_norm", "rope_qkv", "silu_mul")
    for suffix in OUTPUT_KERNEL_SUFFIX.values())

NO_BIAS = np.uint64(0)  # a null pointer argument (split_qkv without a bias)


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    module = cupy.RawModule(code=_SOURCE)
    return cupy, {name: module.get_function(name) for name in KERNEL_NAMES}


def _float32_rows(cupy, x):
    """x as a C-contiguous float32 array: x itself when it is one, as the step buffers are
    (two attribute reads cost less host time than a conversion call that returns x)."""
    if x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    return cupy.ascontiguousarray(x, dtype=np.float32)


def _element_grid(count: int) -> tuple:
    return (min(-(-count // _ELEMENT_THREADS), _MAX_GRID),)


class FusedOps:
    """The GPU implementations of Model's elementwise chains.

    out_dtype: what rms_norm, split_qkv and silu_mul write: the weight dtype when the kernels can
    write it (so the following matmul, cache write or paged decode needs no cast), else float32.
    """

    def __init__(self, weight_dtype):
        weight_dtype = np.dtype(weight_dtype)
        self.out_dtype = (weight_dtype if weight_dtype in OUTPUT_KERNEL_SUFFIX
                          else np.dtype(np.float32))
        self._suffix = OUTPUT_KERNEL_SUFFIX[self.out_dtype]
        self._float32 = {}  # id(array) -> (array, float32 copy): norm weights, biases, cast once
        # split_qkv's latest (out, problem, (q, k, v) views of out): a decode step's layers all
        # split into one buffer, and making four views a layer cost ~1.3 L of host time (a bare
        # launch's; docs/perf-log.md v20).
        self._split_views = (None, None, None)

    def as_float32(self, weight):
        """A float32 copy of a weight (norm weights, biases), made at its first use and kept."""
        if weight.dtype == np.float32 and weight.flags.c_contiguous:
            return weight
        entry = self._float32.get(id(weight))
        if entry is None or entry[0] is not weight:
            # The weight itself is kept in the entry so its id cannot be reused by another array.
            entry = self._float32[id(weight)] = (weight, weight.astype(np.float32, order="C"))
        return entry[1]

    def _kernel(self, op: str):
        """This output dtype's kernel of `op` (and the cupy module)."""
        cupy, kernels = _kernels()
        return cupy, kernels[f"llm_{op}_{self._suffix}"]

    def rms_norm(self, x, weight, eps: float):
        """x float32 [T, H] -> normalised x times weight, [T, H] of out_dtype (one launch)."""
        cupy, kernel = self._kernel("rms_norm")
        x = _float32_rows(cupy, x)
        y = cupy.empty(x.shape, dtype=self.out_dtype)
        if x.shape[0]:
            kernel((x.shape[0],), (_ROW_THREADS,), (x, self.as_float32(weight), y,
                                                    np.int32(x.shape[-1]), np.float32(eps)))
        return y

    def add_rms_norm(self, x, y, weight, eps: float, out=None):
        """(x + y, rms_norm(x + y)) for float32 x, y [T, H]: the sum, its norm's sum of squares
        and the norm in one launch. out: (float32 [T, H], [T, H] of out_dtype) to write them
        into (neither may be x or y), else new arrays."""
        cupy, kernel = self._kernel("add_rms_norm")
        x, y = _float32_rows(cupy, x), _float32_rows(cupy, y)
        if out is None:
            out = cupy.empty(x.shape, dtype=np.float32), cupy.empty(x.shape, dtype=self.out_dtype)
        total, normed = out
        if x.shape[0]:
            kernel((x.shape[0],), (_ROW_THREADS,),
                   (x, y, self.as_float32(weight), total, normed, np.int32(x.shape[-1]),
                    np.float32(eps)))
        return total, normed

    @staticmethod
    def rope_tables(positions, inv_freq):
        """(cos, sin), each float32 [T, head_dim / 2], of positions x inverse frequencies (one
        launch)."""
        cupy, kernels = _kernels()
        positions = cupy.ascontiguousarray(positions, dtype=np.int64)
        half = inv_freq.shape[0]
        cos = cupy.empty((positions.shape[0], half), dtype=np.float32)
        sin = cupy.empty_like(cos)
        if cos.size:
            kernels["llm_rope_tables"](_element_grid(cos.size), (_ELEMENT_THREADS,),
                                       (positions, cupy.ascontiguousarray(inv_freq), cos, sin,
                                        np.int32(half), np.int64(cos.size)))
        return cos, sin

    def split_qkv(self, qkv, rope, num_heads, num_kv_heads, head_dim, bias=None, out=None):
        """Fused projection output float32 [T, (H + 2 KV) * d] (+ bias [(H + 2 KV) * d], the
        projection's, added here rather than by its own launch) -> q [T, H, d] (contiguous), k
        and v [T, KV, d] (views), of out_dtype, rotary applied to q and k; all three are views
        of `out` (flat, of out_dtype) when given."""
        cupy, kernel = self._kernel("rope_qkv")
        qkv = _float32_rows(cupy, qkv)
        tokens, heads = qkv.shape[0], num_heads + 2 * num_kv_heads
        q_size = tokens * num_heads * head_dim
        given = out is not None
        if not given:
            out = cupy.empty(tokens * heads * head_dim, dtype=self.out_dtype)
        cos, sin = rope
        if out.size:
            kernel(_element_grid(out.size), (_ELEMENT_THREADS,),
                   (qkv, NO_BIAS if bias is None else self.as_float32(bias), cos, sin, out,
                    np.int32(num_heads), np.int32(heads), np.int32(num_heads + num_kv_heads),
                    np.int32(head_dim), np.int64(q_size), np.int64(out.size)))
        problem = (tokens, num_heads, num_kv_heads, head_dim)
        kept_out, kept_problem, views = self._split_views
        if kept_out is not out or kept_problem != problem:
            q = out[:q_size].reshape(tokens, num_heads, head_dim)
            kv = out[q_size:].reshape(tokens, 2 * num_kv_heads, head_dim)
            views = q, kv[:, :num_kv_heads], kv[:, num_kv_heads:]
            if given:
                self._split_views = (out, problem, views)
        return views

    def silu_mul(self, gate_up, out=None):
        """float32 [T, 2 * inter] (gate, then up) -> SiLU(gate) * up, [T, inter] of out_dtype
        (into `out` when given)."""
        cupy, kernel = self._kernel("silu_mul")
        gate_up = _float32_rows(cupy, gate_up)
        inter = gate_up.shape[-1] // 2
        if out is None:
            out = cupy.empty((gate_up.shape[0], inter), dtype=self.out_dtype)
        if out.size:
            kernel(_element_grid(out.size), (_ELEMENT_THREADS,),
                   (gate_up, out, np.int64(inter), np.int64(out.size)))
        return out

    @staticmethod
    def causal_softmax(scores, length: int, scale: float):
        """In place: float32 scores [..., length] (contiguous; row r is query position
        r % length) -> causal softmax(scale * scores). Returns scores."""
        _, kernels = _kernels()
        count = scores.size // length
        if count:
            kernels["llm_causal_softmax"]((count,), (_ROW_THREADS,),
                                          (scores, np.int32(length), np.float32(scale)))
        return scores

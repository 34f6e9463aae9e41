// Writing new tokens' K and V rows into the paged cache (the reshape_and_cache role).
//
// One workgroup per token. Its threads stride over the token's 16-byte vectors, K first, then V:
// num_kv_heads * head_size / VEC vectors each. The copy is raw bits, never widened, so the cache
// holds exactly what the caller passed (the GPU write is bit-identical to the numpy one).
//
// slots[token] = block * block_size + offset. A negative slot is a padding token (skipped), and so
// is a slot past the cache: device slots are not checked on the host, and a bad one must not turn
// into an out-of-bounds store.
//
// key/value may be strided views (e.g. slices of a fused QKV projection): rows are addressed with
// element strides per token and per head; the host guarantees 16-byte alignment of every row.
//
// fp8 caches (cache_write_fp8) hold one uint8 code per element instead: each thread reads the
// 16 source elements of one 16-byte vector of codes, widens them to float and stores
// fp8_encode(x * inv_scale[head]) (fp8.cuh). The format is a runtime argument.
#include "common.cuh"
#include "fp8.cuh"

namespace cupa {

// The part of a write both forms share: which slot a token goes to, and for vector i of the
// token (K vectors first, then V; `elems` elements each) its source and its place in the cache.
struct TokenWrite {
    i64 token, block, offset;
    i32 num_kv_heads, head_size, block_size;

    // False for a padding slot (negative) or one past the cache: nothing is written.
    CUPA_FN bool init(const i64* slots, i64 num_slots, i32 heads, i32 size, i32 bs) {
        token = blockIdx.x;
        const i64 slot = slots[token];
        if (slot < 0 || slot >= num_slots) return false;
        block = slot / bs;
        offset = slot - block * bs;
        num_kv_heads = heads;
        head_size = size;
        block_size = bs;
        return true;
    }
    CUPA_FN int vectors(int elems) const { return 2 * num_kv_heads * (head_size / elems); }

    template <typename T>
    CUPA_FN void vector(int i, int elems, const T* key, const T* value, i64 key_token_stride,
                        i64 key_head_stride, i64 value_token_stride, i64 value_head_stride,
                        bool& is_value, int& head, const T*& src, i64& dst) const {
        const int per_head = head_size / elems;
        const int per_tensor = num_kv_heads * per_head;
        is_value = i >= per_tensor;
        const int v = is_value ? i - per_tensor : i;
        head = v / per_head;
        const int d = (v - head * per_head) * elems;
        src = (is_value ? value + token * value_token_stride + head * value_head_stride
                        : key + token * key_token_stride + head * key_head_stride) + d;
        dst = ((block * num_kv_heads + head) * block_size + offset) * head_size + d;
    }
};

template <typename T>
CUPA_FN void cache_write(const T* __restrict__ key, const T* __restrict__ value,
                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                         const i64* __restrict__ slots, i32 num_kv_heads, i32 head_size,
                         i32 block_size, i64 num_slots, i64 key_token_stride,
                         i64 key_head_stride, i64 value_token_stride, i64 value_head_stride) {
    constexpr int VEC = Elem<T>::VEC;
    TokenWrite w;
    if (!w.init(slots, num_slots, num_kv_heads, head_size, block_size)) return;
    for (int i = threadIdx.x; i < w.vectors(VEC); i += blockDim.x) {
        bool is_value;
        int head;
        const T* src;
        i64 dst;
        w.vector(i, VEC, key, value, key_token_stride, key_head_stride, value_token_stride,
                 value_head_stride, is_value, head, src, dst);
        store16((is_value ? value_cache : key_cache) + dst, load16(src));
    }
}

// Sign bit of element j of a 16-byte vector of T, from the raw bits.
template <typename T>
CUPA_FN u32 raw_sign(const cupa_u32x4& r, int j) {
    const int top = (j + 1) * 8 * (int)sizeof(T) - 1;  // bit index of the sign in the vector
    const u32 word = (top >> 5) == 0 ? r.x : (top >> 5) == 1 ? r.y : (top >> 5) == 2 ? r.z : r.w;
    return (word >> (top & 31)) & 1u;
}

template <typename T>
CUPA_FN void cache_write_fp8(const T* __restrict__ key, const T* __restrict__ value,
                             u8* __restrict__ key_cache, u8* __restrict__ value_cache,
                             const i64* __restrict__ slots, i32 num_kv_heads, i32 head_size,
                             i32 block_size, i64 num_slots, i64 key_token_stride,
                             i64 key_head_stride, i64 value_token_stride, i64 value_head_stride,
                             const float* __restrict__ inv_k_scale,
                             const float* __restrict__ inv_v_scale, i32 kv_format) {
    constexpr int VEC = Elem<T>::VEC;  // source elements per 16-byte load
    constexpr int CODES = 16;          // codes per 16-byte store
    TokenWrite w;
    if (!w.init(slots, num_slots, num_kv_heads, head_size, block_size)) return;
    for (int i = threadIdx.x; i < w.vectors(CODES); i += blockDim.x) {
        bool is_value;
        int head;
        const T* src;
        i64 dst;
        w.vector(i, CODES, key, value, key_token_stride, key_head_stride, value_token_stride,
                 value_head_stride, is_value, head, src, dst);
        const float inv_scale = is_value ? inv_v_scale[head] : inv_k_scale[head];
        u32 words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int l = 0; l < CODES / VEC; ++l) {
            const cupa_u32x4 raw = load16(src + l * VEC);
            float f[VEC];
            Elem<T>::widen(raw, f);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                // A NaN takes its sign from the source bits: on NVIDIA the widening conversion
                // and the multiply may both return a canonical (positive) NaN.
                const int k = l * VEC + j;
                const u8 code = fp8_float_is_nan(f[j])
                                    ? fp8_nan_code(raw_sign<T>(raw, j), kv_format)
                                    : fp8_encode(f[j] * inv_scale, kv_format);
                words[k / 4] |= (u32)code << (8 * (k % 4));
            }
        }
        cupa_u32x4 out;
        out.x = words[0]; out.y = words[1]; out.z = words[2]; out.w = words[3];
        store16((is_value ? value_cache : key_cache) + dst, out);
    }
}

}  // namespace cupa

// One extern "C" entry point per dtype; head size and block size are runtime arguments.
#define CUPA_CACHE_WRITE_VARIANT(NAME, T)                                                       \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS) NAME(                            \
        const T* key, const T* value, T* key_cache, T* value_cache, const i64* slots,            \
        i32 num_kv_heads, i32 head_size, i32 block_size, i64 num_slots, i64 key_token_stride,    \
        i64 key_head_stride, i64 value_token_stride, i64 value_head_stride) {                    \
        cupa::cache_write<T>(key, value, key_cache, value_cache, slots, num_kv_heads, head_size, \
                             block_size, num_slots, key_token_stride, key_head_stride,           \
                             value_token_stride, value_head_stride);                             \
    }

// The fp8 form: source rows of T, a cache of u8 codes; per-KV-head inverse scales (float32
// [num_kv_heads]) and the format's kernel_id (cupa.fp8.FP8_FORMATS) come last.
#define CUPA_CACHE_WRITE_FP8_VARIANT(NAME, T)                                                   \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS) NAME(                            \
        const T* key, const T* value, u8* key_cache, u8* value_cache, const i64* slots,          \
        i32 num_kv_heads, i32 head_size, i32 block_size, i64 num_slots, i64 key_token_stride,    \
        i64 key_head_stride, i64 value_token_stride, i64 value_head_stride,                      \
        const float* inv_k_scale, const float* inv_v_scale, i32 kv_format) {                     \
        cupa::cache_write_fp8<T>(key, value, key_cache, value_cache, slots, num_kv_heads,        \
                                 head_size, block_size, num_slots, key_token_stride,             \
                                 key_head_stride, value_token_stride, value_head_stride,         \
                                 inv_k_scale, inv_v_scale, kv_format);                           \
    }

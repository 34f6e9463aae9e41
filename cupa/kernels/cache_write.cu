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
#include "common.cuh"

namespace cupa {

template <typename T>
CUPA_FN void cache_write(const T* __restrict__ key, const T* __restrict__ value,
                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                         const i64* __restrict__ slots, i32 num_kv_heads, i32 head_size,
                         i32 block_size, i64 num_slots, i64 key_token_stride,
                         i64 key_head_stride, i64 value_token_stride, i64 value_head_stride) {
    constexpr int VEC = Elem<T>::VEC;
    const i64 token = blockIdx.x;
    const i64 slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    const i64 block = slot / block_size;
    const i64 offset = slot - block * block_size;

    const int vectors_per_head = head_size / VEC;
    const int vectors = num_kv_heads * vectors_per_head;  // per tensor (K or V)
    for (int i = threadIdx.x; i < 2 * vectors; i += blockDim.x) {
        const bool is_value = i >= vectors;
        const int v = is_value ? i - vectors : i;
        const int head = v / vectors_per_head;
        const int d = (v - head * vectors_per_head) * VEC;
        const T* src = is_value ? value + token * value_token_stride + head * value_head_stride
                                : key + token * key_token_stride + head * key_head_stride;
        T* cache = is_value ? value_cache : key_cache;
        const i64 row = ((block * num_kv_heads + head) * block_size + offset) * head_size;
        store16(cache + row + d, load16(src + d));
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

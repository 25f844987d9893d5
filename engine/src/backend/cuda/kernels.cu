// preheat CUDA kernels, compiled at run time with NVRTC (and cached per architecture and
// driver). Activations and the paged KV cache are f32, with the same layout as the CPU
// backend (engine/src/kv), so K/V moves between backends unchanged; weights stay in
// their stored dtype and go through cuBLAS. Sizes come in as arguments, never as
// compile-time constants, so one image serves every model.
//
// No headers: NVRTC has no CUDA toolkit include path on the machines that build this,
// so the bf16/f16 conversions are written out on the raw bits.

typedef unsigned int u32;
typedef unsigned short u16;

#define PH_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x40u);  // NaN stays NaN
    }
    // Round to nearest even.
    u32 rounding = 0x7fffu + ((x >> 16) & 1u);
    return (u16)((x + rounding) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024).
__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? shared[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) shared[0] = v;
    }
    __syncthreads();
    float r = shared[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? shared[threadIdx.x] : -PH_INF;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) shared[0] = v;
    }
    __syncthreads();
    float r = shared[0];
    __syncthreads();
    return r;
}

// Embedding rows of `tokens` widened to f32: out[t, h]. Grid: (t), block: any.
#define EMBED(NAME, T, CONV)                                                           \
    extern "C" __global__ void NAME(const T* table, const u32* tokens, float* out,     \
                                    int h) {                                           \
        const T* row = table + (size_t)tokens[blockIdx.x] * h;                         \
        float* o = out + (size_t)blockIdx.x * h;                                       \
        for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = CONV(row[i]);         \
    }
__device__ __forceinline__ float id_f32(float x) { return x; }
EMBED(embed_f32, float, id_f32)
EMBED(embed_f16, u16, f16_to_f32)
EMBED(embed_bf16, u16, bf16_to_f32)

// out[r] = w * x[r] / rms(x[r]). Grid: (rows), block: 256.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int h,
                                    float eps) {
    __shared__ float shared[32];
    const float* xr = x + (size_t)blockIdx.x * h;
    float* o = out + (size_t)blockIdx.x * h;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, shared);
    float scale = rsqrtf(ss / (float)h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = w[i] * (xr[i] * scale);
}

// Rotary embedding (rotate-half, as Hugging Face Llama) in place on x[t, heads, hd],
// with per-pair inverse frequencies (llama3 / linear scaling already folded in).
// Grid: (t, heads), block: hd / 2.
extern "C" __global__ void rope(float* x, const u32* positions, const float* inv_freq,
                                int heads, int hd) {
    int half = hd >> 1;
    int i = threadIdx.x;
    if (i >= half) return;
    float* head = x + ((size_t)blockIdx.x * heads + blockIdx.y) * hd;
    float s, c;
    sincosf((float)positions[blockIdx.x] * inv_freq[i], &s, &c);
    float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
}

// x[r, :] += b. Grid: (rows), block: any.
extern "C" __global__ void add_bias(float* x, const float* b, int n) {
    float* row = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] += b[i];
}

// x += y over n elements. Grid-stride.
extern "C" __global__ void add_inplace(float* x, const float* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] += y[i];
}

// gate = silu(gate) * up over n elements. Grid-stride.
extern "C" __global__ void silu_mul(float* gate, const float* up, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float g = gate[i];
        gate[i] = g / (1.0f + __expf(-g)) * up[i];
    }
}

// Activations narrowed for the tensor-core GEMMs. Grid-stride.
extern "C" __global__ void f32_to_bf16(const float* x, u16* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f32_to_bf16_bits(x[i]);
}

extern "C" __global__ void f32_to_f16(const float* x, u16* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f32_to_f16_bits(x[i]);
}

// Slot of a token: its sequence's block table (stride `bt_stride` entries per sequence)
// at position / block_size, times block_size, plus position % block_size.
__device__ __forceinline__ size_t slot_of(const u32* block_tables, int bt_stride, u32 seq,
                                          u32 pos, int bs) {
    return (size_t)block_tables[(size_t)seq * bt_stride + pos / bs] * bs + pos % bs;
}

// Writes each token's K and V (t × slot_elems) into its cache slot.
// Grid: (t), block: any.
extern "C" __global__ void kv_write(const float* k, const float* v, float* k_cache,
                                    float* v_cache, const u32* positions, const u32* seq_of,
                                    const u32* block_tables, int bt_stride, int bs,
                                    int slot_elems) {
    size_t slot = slot_of(block_tables, bt_stride, seq_of[blockIdx.x],
                          positions[blockIdx.x], bs);
    const float* ks = k + (size_t)blockIdx.x * slot_elems;
    const float* vs = v + (size_t)blockIdx.x * slot_elems;
    float* kd = k_cache + slot * slot_elems;
    float* vd = v_cache + slot * slot_elems;
    for (int i = threadIdx.x; i < slot_elems; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}

// Causal attention of every (token, head) over its own sequence, positions 0..=p, read
// from the paged cache through the sequence's block table: one kernel for prefill
// (many tokens per sequence) and decode (one). Online softmax over tiles of
// blockDim.x keys, so any context length fits in fixed shared memory.
// Grid: (t, nh), block: 128; dynamic shared memory: (hd + blockDim.x + 32) floats.
extern "C" __global__ void paged_attention(const float* q, const float* k_cache,
                                           const float* v_cache, float* out,
                                           const u32* positions, const u32* seq_of,
                                           const u32* block_tables, int bt_stride, int nh,
                                           int nkv, int hd, int bs, float scale) {
    extern __shared__ float smem[];
    float* qs = smem;                    // hd
    float* probs = smem + hd;            // blockDim.x
    float* red = probs + blockDim.x;     // 32
    int tok = blockIdx.x, head = blockIdx.y;
    int g = head / (nh / nkv);
    int slot_elems = nkv * hd;
    u32 p = positions[tok];
    u32 seq = seq_of[tok];
    const float* qh = q + ((size_t)tok * nh + head) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qh[d] * scale;
    __syncthreads();
    // Each thread owns output dims d = threadIdx.x + k * blockDim.x (hd <= 4 × 128).
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = -PH_INF, l = 0.0f;
    for (u32 base = 0; base <= p; base += blockDim.x) {
        u32 j = base + threadIdx.x;
        float s = -PH_INF;
        if (j <= p) {
            const float* kj = k_cache + slot_of(block_tables, bt_stride, seq, j, bs) * slot_elems + g * hd;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += qs[d] * kj[d];
            s = dot;
        }
        float tile_max = block_max(s, red);
        float m_new = fmaxf(m, tile_max);
        float e = (j <= p) ? __expf(s - m_new) : 0.0f;
        probs[threadIdx.x] = e;
        float tile_sum = block_sum(e, red);
        float correction = __expf(m - m_new);
        l = l * correction + tile_sum;
        u32 n = min((u32)blockDim.x, p + 1 - base);
        for (int k = 0; k < 4; k++) {
            int d = threadIdx.x + k * blockDim.x;
            if (d >= hd) break;
            float a = acc[k] * correction;
            for (u32 jj = 0; jj < n; jj++) {
                const float* vj = v_cache + slot_of(block_tables, bt_stride, seq, base + jj, bs) * slot_elems + g * hd;
                a += probs[jj] * vj[d];
            }
            acc[k] = a;
        }
        m = m_new;
        __syncthreads();
    }
    float* o = out + ((size_t)tok * nh + head) * hd;
    float inv = 1.0f / l;
    for (int k = 0; k < 4; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d < hd) o[d] = acc[k] * inv;
    }
}

// out[i, :] = x[rows[i], :]. Grid: (n_rows), block: any.
extern "C" __global__ void gather_rows(const float* x, const u32* rows, float* out, int h) {
    const float* src = x + (size_t)rows[blockIdx.x] * h;
    float* dst = out + (size_t)blockIdx.x * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) dst[i] = src[i];
}

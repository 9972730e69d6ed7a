// native-cuda kernels, compiled at load by NVRTC for the device's
// architecture. Activations are f32 on the device (values of f16 type are
// kept rounded to f16, exactly as native-cpu stores them); weights keep their
// storage (f32, f16, 4-bit blocks). Kernels that can meet bad input (an index
// out of range) set `*err` to a code the host turns into a typed error.

// No headers: NVRTC compiles this alone (f16 conversion through PTX cvt).
typedef unsigned short half_bits;

__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_bits float_to_half(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#define NEG_INF __int_as_float(0xff800000)

#define MAX_RANK 6

// Error codes (kept in step with `runner.rs`).
#define ERR_INDEX 1
#define ERR_POSITION 2

struct Broadcast {
    int rank;
    int out_dims[MAX_RANK];
    int a_strides[MAX_RANK];
    int b_strides[MAX_RANK];
};

struct Permute {
    int rank;
    int out_dims[MAX_RANK];
    int in_strides[MAX_RANK];
};

// A `[rows, heads, dim]` projection in one of attention's layouts, possibly
// packed in wider rows (`stride` elements per row, starting at `offset`).
struct Heads {
    int heads_first;
    int heads;
    int rows;
    int dim;
    int stride;
    int offset;
};

__device__ __forceinline__ long long heads_at(const Heads& h, int row, int head) {
    return h.heads_first ? ((long long)head * h.rows + row) * h.dim
                         : (long long)row * h.stride + h.offset + (long long)head * h.dim;
}

__device__ __forceinline__ float round_half(float x) {
    return half_to_float(float_to_half(x));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : NEG_INF;
        s = warp_max(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();
    return r;
}

// ---- elementwise ---------------------------------------------------------

extern "C" __global__ void binary(int op, const float* a, const float* b, float* out, int n, Broadcast bc,
                                  int round16) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int rest = i;
        long long ia = 0, ib = 0;
        for (int d = bc.rank - 1; d >= 0; --d) {
            const int c = rest % bc.out_dims[d];
            rest /= bc.out_dims[d];
            ia += (long long)c * bc.a_strides[d];
            ib += (long long)c * bc.b_strides[d];
        }
        const float x = a[ia], y = b[ib];
        float r;
        switch (op) {
            case 0: r = x + y; break;
            case 1: r = x - y; break;
            case 2: r = x * y; break;
            case 3: r = x / y; break;
            default: r = powf(x, y); break;
        }
        out[i] = round16 ? round_half(r) : r;
    }
}

// op: 0 neg, 1 sqrt, 2 reciprocal, 3 exp, 4 sigmoid, 5 tanh, 6 erf, 7 relu,
// 8 gelu (tanh form), 9 copy.
extern "C" __global__ void unary(int op, const float* x, float* out, int n, int round16) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        float r;
        switch (op) {
            case 0: r = -v; break;
            case 1: r = sqrtf(v); break;
            case 2: r = 1.0f / v; break;
            case 3: r = expf(v); break;
            case 4: r = 1.0f / (1.0f + expf(-v)); break;
            case 5: r = tanhf(v); break;
            case 6: r = erff(v); break;
            case 7: r = fmaxf(v, 0.0f); break;
            case 8: r = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))); break;
            default: r = v; break;
        }
        out[i] = round16 ? round_half(r) : r;
    }
}

extern "C" __global__ void permute(const float* x, float* out, int n, Permute p) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int rest = i;
        long long at = 0;
        for (int d = p.rank - 1; d >= 0; --d) {
            const int c = rest % p.out_dims[d];
            rest /= p.out_dims[d];
            at += (long long)c * p.in_strides[d];
        }
        out[i] = x[at];
    }
}

// ---- normalization -------------------------------------------------------

// One block per row: `sum = x (+ skip) (+ bias)`, written to `sum_out` when
// given; `out = sum / rms(sum) * gamma`.
extern "C" __global__ void rms_norm(const float* x, const float* skip, const float* bias, const float* gamma,
                                    float* out, float* sum_out, int d, float eps) {
    const long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = x[base + i];
        if (skip) v += skip[base + i];
        if (bias) v += bias[i];
        if (sum_out) sum_out[base + i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = x[base + i];
        if (skip) v += skip[base + i];
        if (bias) v += bias[i];
        out[base + i] = v * inv * gamma[i];
    }
}

extern "C" __global__ void layer_norm(const float* x, const float* gamma, const float* beta, float* out, int d,
                                      float eps) {
    const long long base = (long long)blockIdx.x * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += x[base + i];
    const float mean = block_sum(s) / (float)d;
    float var = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float c = x[base + i] - mean;
        var += c * c;
    }
    const float inv = 1.0f / sqrtf(block_sum(var) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        out[base + i] = (x[base + i] - mean) * inv * gamma[i] + (beta ? beta[i] : 0.0f);
    }
}

// ---- gathers -------------------------------------------------------------

// Rows of `table` ([rows, width]) picked by `ids` (negative ids count from
// the end, as ONNX Gather's do).
extern "C" __global__ void gather_rows(const float* table, const long long* ids, float* out, int nids, int width,
                                       int rows, int* err) {
    const int i = blockIdx.x;
    if (i >= nids) return;
    long long id = ids[i];
    if (id < 0) id += rows;
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) atomicCAS(err, 0, ERR_INDEX);
        return;
    }
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[(long long)i * width + c] = table[id * width + c];
}

// GatherBlockQuantized (4-bit, low nibble first): `(q - zero) * scale`.
extern "C" __global__ void gather_q4(const unsigned char* data, const long long* ids, const float* scales,
                                     const unsigned char* zeros, float* out, int nids, int bytes, int rows,
                                     int blocks, int block, int* err) {
    const int i = blockIdx.x;
    if (i >= nids) return;
    const long long id = ids[i];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) atomicCAS(err, 0, ERR_INDEX);
        return;
    }
    const int cols = bytes * 2;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const int b = c / block;
        const int zero = zeros ? (zeros[id * ((blocks + 1) / 2) + b / 2] >> (4 * (b % 2))) & 15 : 8;
        const int q = (data[id * bytes + c / 2] >> (4 * (c % 2))) & 15;
        out[(long long)i * cols + c] = (float)(q - zero) * scales[id * blocks + b];
    }
}

// Row `idx[i]` of `x` ([*, width]) to row `i` of `out`.
extern "C" __global__ void select_rows(const float* x, const int* idx, float* out, int width) {
    const long long src = (long long)idx[blockIdx.x] * width, dst = (long long)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[dst + c] = x[src + c];
}

// ---- rotary --------------------------------------------------------------

// Rotate-half rotary on every [head_dim] row of x. Cached: half-width
// [positions, half] tables indexed by position id; else full-width
// [seq, head_dim] tables already gathered per position.
extern "C" __global__ void rotary(const float* x, float* out, const float* cos_t, const float* sin_t,
                                  const long long* positions, int npos, int heads_first, int heads, int seq,
                                  int head_dim, int cached, int table_positions, int* err) {
    const int half = head_dim / 2;
    const long long total = (long long)heads * seq * half;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < total;
         j += (long long)gridDim.x * blockDim.x) {
        const int i = j % half;
        const int t = (j / half) % seq;
        const int h = j / ((long long)half * seq);
        const long long at = heads_first ? ((long long)h * seq + t) * head_dim : ((long long)t * heads + h) * head_dim;
        float c1, s1, c2, s2;
        if (cached) {
            const long long p = npos == 1 ? positions[0] + t : positions[t];
            if (p < 0 || p >= table_positions) {
                atomicCAS(err, 0, ERR_POSITION);
                return;
            }
            c1 = c2 = cos_t[p * half + i];
            s1 = s2 = sin_t[p * half + i];
        } else {
            c1 = cos_t[(long long)t * head_dim + i];
            s1 = sin_t[(long long)t * head_dim + i];
            c2 = cos_t[(long long)t * head_dim + i + half];
            s2 = sin_t[(long long)t * head_dim + i + half];
        }
        const float a = x[at + i], b = x[at + i + half];
        out[at + i] = a * c1 - b * s1;
        out[at + i + half] = b * c2 + a * s2;
    }
}

// ---- projections ---------------------------------------------------------
// y[m, n] = x[m, k] . W[n, :] (+ bias). One warp per output row; the m
// input rows are taken sixteen at a time.

#define ROWS_PER_PASS 16

__device__ __forceinline__ void store_rows(float (&acc)[ROWS_PER_PASS], float* y, const float* bias, int m0, int m,
                                           int n, int row) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < ROWS_PER_PASS; ++r) {
        if (m0 + r >= m) break;
        const float s = warp_sum(acc[r]);
        if (lane == 0) y[(long long)(m0 + r) * n + row] = s + (bias ? bias[row] : 0.0f);
    }
}

extern "C" __global__ void gemv_f16(const float* x, const half_bits* w, const float* bias, float* y, int m, int n,
                                    int k) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= n) return;
    const half_bits* wr = w + (long long)row * k;
    for (int m0 = 0; m0 < m; m0 += ROWS_PER_PASS) {
        float acc[ROWS_PER_PASS] = {};
        for (int j = lane; j < k; j += 32) {
            const float wv = half_to_float(wr[j]);
#pragma unroll
            for (int r = 0; r < ROWS_PER_PASS; ++r)
                if (m0 + r < m) acc[r] += wv * x[(long long)(m0 + r) * k + j];
        }
        store_rows(acc, y, bias, m0, m, n, row);
    }
}

__device__ __forceinline__ int q4_zero(const unsigned char* zeros, long long row, int blocks, int b) {
    return zeros ? (zeros[row * ((blocks + 1) / 2) + b / 2] >> (4 * (b % 2))) & 15 : 8;
}

// 4-bit rows (`blocks` blocks of `block` inputs, two per byte, low nibble
// first): w = (q - zero) * scale (+ offset). Each lane takes 4 bytes (8
// inputs) at a time, WORDS_PER_LANE words issued before any is used (a row
// is short: latency, not bandwidth, bounds a warp); `block` is a multiple of
// 8. `vec_x`: k is a multiple of 8, so inputs are read as float4.
#define WORDS_PER_LANE 4

extern "C" __global__ void gemv_q4(const float* x, const unsigned char* data, const float* scales,
                                   const unsigned char* zeros, const float* offsets, const float* bias, float* y,
                                   int m, int n, int k, int block, int blocks, int vec_x, int staged) {
    // `staged`: the block first copies its input rows (m <= ROWS_PER_PASS)
    // to shared memory, which its warps then read at shared-memory latency.
    extern __shared__ float xs_shared[];
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (staged) {
        const int count = m * k;
        if (vec_x) {
            for (int i = threadIdx.x; i < count / 4; i += blockDim.x)
                ((float4*)xs_shared)[i] = ((const float4*)x)[i];
        } else {
            for (int i = threadIdx.x; i < count; i += blockDim.x) xs_shared[i] = x[i];
        }
        __syncthreads();
        x = xs_shared;
    }
    if (row >= n) return;
    const int row_bytes = blocks * block / 2;
    const unsigned int* words = (const unsigned int*)(data + (long long)row * row_bytes);
    const float* row_scales = scales + (long long)row * blocks;
    const float* row_offsets = offsets ? offsets + (long long)row * blocks : 0;
    const int nwords = row_bytes / 4;
    for (int m0 = 0; m0 < m; m0 += ROWS_PER_PASS) {
        float acc[ROWS_PER_PASS] = {};
        for (int base = 0; base < nwords; base += 32 * WORDS_PER_LANE) {
            unsigned int w[WORDS_PER_LANE];
            float scale[WORDS_PER_LANE], zero[WORDS_PER_LANE], offset[WORDS_PER_LANE];
#pragma unroll
            for (int u = 0; u < WORDS_PER_LANE; ++u) {
                const int wi = base + u * 32 + lane;
                const bool in = wi < nwords;
                const int b = in ? wi * 8 / block : 0;
                w[u] = in ? words[wi] : 0u;
                scale[u] = in ? row_scales[b] : 0.0f;
                zero[u] = (float)q4_zero(zeros, row, blocks, b);
                offset[u] = row_offsets ? row_offsets[b] : 0.0f;
            }
            // Dequantize the lane's words once, then stream each input row
            // past them (a row's loads are independent: one latency each).
            float wv[WORDS_PER_LANE][8];
#pragma unroll
            for (int u = 0; u < WORDS_PER_LANE; ++u)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    wv[u][e] = ((float)((w[u] >> (4 * e)) & 15) - zero[u]) * scale[u] + offset[u];
#pragma unroll
            for (int r = 0; r < ROWS_PER_PASS; ++r) {
                if (m0 + r >= m) break;
                const float* xr = x + (long long)(m0 + r) * k;
                float sum = 0.0f;
#pragma unroll
                for (int u = 0; u < WORDS_PER_LANE; ++u) {
                    const int e0 = (base + u * 32 + lane) * 8;
                    if (vec_x && e0 + 8 <= k) {
                        const float4 a = *(const float4*)(xr + e0), c = *(const float4*)(xr + e0 + 4);
                        sum += wv[u][0] * a.x + wv[u][1] * a.y + wv[u][2] * a.z + wv[u][3] * a.w + wv[u][4] * c.x +
                               wv[u][5] * c.y + wv[u][6] * c.z + wv[u][7] * c.w;
                    } else {
                        for (int e = 0; e < 8; ++e)
                            if (e0 + e < k) sum += wv[u][e] * xr[e0 + e];
                    }
                }
                acc[r] += sum;
            }
        }
        store_rows(acc, y, bias, m0, m, n, row);
    }
}

// accuracy_level 4, as ONNX Runtime's CPU kernel computes it: each input
// block quantized to int8 (scale max|x| / 127, round to nearest even), exact
// integer block sums, scaled per block. One warp per (row, block) of x.
extern "C" __global__ void quantize_blocks(const float* x, signed char* xq, float* xs, int m, int k, int block,
                                           int blocks) {
    const int b = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    if (b >= blocks || r >= m) return;
    float amax = 0.0f;
    for (int j = lane; j < block; j += 32) {
        const int e = b * block + j;
        if (e < k) amax = fmaxf(amax, fabsf(x[(long long)r * k + e]));
    }
    amax = warp_max(amax);
    const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = lane; j < block; j += 32) {
        const int e = b * block + j;
        const float v = e < k ? x[(long long)r * k + e] : 0.0f;
        xq[(long long)r * blocks * block + e] = (signed char)__float2int_rn(v * inverse);
    }
    if (lane == 0) xs[(long long)r * blocks + b] = amax / 127.0f;
}

extern "C" __global__ void gemv_q4_int8(const signed char* xq, const float* xs, const unsigned char* data,
                                        const float* scales, const unsigned char* zeros, const float* bias,
                                        float* y, int m, int n, int block, int blocks) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= n) return;
    const int half = block / 2;
    const unsigned char* rd = data + (long long)row * blocks * half;
    const int padded = blocks * block;
    for (int m0 = 0; m0 < m; m0 += ROWS_PER_PASS) {
        float acc[ROWS_PER_PASS] = {};
        for (int b = lane; b < blocks; b += 32) {
            const int zero = q4_zero(zeros, row, blocks, b);
            const float ws = scales[(long long)row * blocks + b];
#pragma unroll
            for (int r = 0; r < ROWS_PER_PASS; ++r) {
                if (m0 + r >= m) break;
                const signed char* q = xq + (long long)(m0 + r) * padded + b * block;
                int sum = 0;
                for (int j = 0; j < half; ++j) {
                    const int byte = rd[b * half + j];
                    sum += (int)q[2 * j] * ((byte & 15) - zero) + (int)q[2 * j + 1] * ((byte >> 4) - zero);
                }
                acc[r] += (float)sum * (ws * xs[(long long)(m0 + r) * blocks + b]);
            }
        }
        store_rows(acc, y, bias, m0, m, n, row);
    }
}

// Row-form 4-bit or f16 weights widened to f32 rows [n, k] (prefill: the
// product then runs on cuBLAS).
extern "C" __global__ void dequant_q4(const unsigned char* data, const float* scales, const unsigned char* zeros,
                                      const float* offsets, float* w, int n, int k, int block, int blocks) {
    const long long total = (long long)n * k;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / k;
        const int c = i % k;
        const int b = c / block;
        const int q = (data[row * (blocks * block / 2) + c / 2] >> (4 * (c % 2))) & 15;
        const float offset = offsets ? offsets[row * blocks + b] : 0.0f;
        w[i] = ((float)q - (float)q4_zero(zeros, row, blocks, b)) * scales[row * blocks + b] + offset;
    }
}

extern "C" __global__ void widen_f16(const half_bits* w, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = half_to_float(w[i]);
}

extern "C" __global__ void add_bias(float* y, const float* bias, int m, int n) {
    const long long total = (long long)m * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % n];
}

// Gated MLP: both = [gate | up] per row; out = silu(gate) * up.
extern "C" __global__ void silu_mul(const float* both, float* out, int m, int half) {
    const long long total = (long long)m * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / half;
        const int j = i % half;
        const float g = both[r * 2 * half + j], u = both[r * 2 * half + half + j];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

// ---- attention -----------------------------------------------------------
// The KV cache of one sequence and layer is [capacity, kv_heads, head_dim]
// f32 (position-major, so growing it keeps the prefix in place); `kptrs` /
// `vptrs` give each segment's base for this layer. `row_seg[r]` and
// `row_pos[r]` give each row's sequence and absolute position.

__device__ __forceinline__ float rotated(const float* src, int d, int half, const float* cos_t, const float* sin_t,
                                         long long pos) {
    if (d < half) return src[d] * cos_t[pos * half + d] - src[d + half] * sin_t[pos * half + d];
    if (d < 2 * half) {
        const int i = d - half;
        return src[d] * cos_t[pos * half + i] + src[i] * sin_t[pos * half + i];
    }
    return src[d];
}

// One block per (row, KV head), one thread per element of the head.
extern "C" __global__ void kv_append(const float* k, Heads kd, const float* v, Heads vd,
                                     const unsigned long long* kptrs, const unsigned long long* vptrs,
                                     const int* row_seg, const int* row_pos, int kv_heads, int rot,
                                     const float* cos_t, const float* sin_t, int half, int table_positions,
                                     int round16, int* err) {
    const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= kd.dim) return;
    const int s = row_seg[r];
    const long long pos = row_pos[r];
    float* kc = (float*)kptrs[s];
    float* vc = (float*)vptrs[s];
    const long long dst = (pos * kv_heads + h) * kd.dim + d;
    const float* ksrc = k + heads_at(kd, r, h);
    float kv = ksrc[d];
    if (rot) {
        if (pos >= table_positions) {
            atomicCAS(err, 0, ERR_POSITION);
            return;
        }
        kv = rotated(ksrc, d, half, cos_t, sin_t, pos);
    }
    float vv = v[heads_at(vd, r, h) + d];
    if (round16) {
        kv = round_half(kv);
        vv = round_half(vv);
    }
    kc[dst] = kv;
    vc[dst] = vv;
}

// One block per (row, query head), ATTEND_THREADS threads: a thread per
// visible key for the scores (the key row read as float4 when head_dim
// allows), softmax over the block, then the weighted sum of the values with
// each output element's positions split over the threads that share it.
// Dynamic shared memory: head_dim + context + 4 * ATTEND_THREADS floats.
// bias_mode: 0 none (causal), 1 per query head, 2 grouped (a group's query
// heads stacked along rows).
#define ATTEND_THREADS 128

extern "C" __global__ void attend(const float* q, Heads qd, float* out, int out_heads_first, int rows,
                                  const unsigned long long* kptrs, const unsigned long long* vptrs,
                                  const int* row_seg, const int* row_pos, const int* seg_total, int heads,
                                  int kv_heads, float scale, int rot, const float* cos_t, const float* sin_t,
                                  int half, int table_positions, const float* bias, int bias_mode, int bias_shared,
                                  int context, int* err) {
    extern __shared__ float shared[];
    const int r = blockIdx.x, h = blockIdx.y;
    const int hd = qd.dim;
    const int n_rep = heads / kv_heads, g = h / n_rep;
    const int s = row_seg[r];
    const long long pos = row_pos[r];
    const int total = seg_total[s];
    const int visible = bias ? total : (int)pos + 1;
    float* qs = shared;
    float* p = shared + hd;
    float* partial = shared + hd + context;
    const float* kc = (const float*)kptrs[s];
    const float* vc = (const float*)vptrs[s];
    const float* qsrc = q + heads_at(qd, r, h);
    if ((rot && pos >= table_positions) || visible > context) {
        if (threadIdx.x == 0) atomicCAS(err, 0, ERR_POSITION);
        return;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = rot ? rotated(qsrc, d, half, cos_t, sin_t, pos) : qsrc[d];
    __syncthreads();
    // With a bias the step holds one sequence: row r is its r-th new row.
    const int seg_len = rows;
    const long long key_stride = (long long)kv_heads * hd;
    for (int t = threadIdx.x; t < visible; t += blockDim.x) {
        const float* key = kc + t * key_stride + (long long)g * hd;
        float dot = 0.0f;
        if ((hd & 3) == 0) {
            const float4* k4 = (const float4*)key;
            for (int d4 = 0; d4 < hd / 4; ++d4) {
                const float4 kv = k4[d4];
                dot += qs[4 * d4] * kv.x + qs[4 * d4 + 1] * kv.y + qs[4 * d4 + 2] * kv.z + qs[4 * d4 + 3] * kv.w;
            }
        } else {
            for (int d = 0; d < hd; ++d) dot += qs[d] * key[d];
        }
        float sc = dot * scale;
        if (bias) {
            int brow, group, nrows;
            if (bias_mode == 2) {
                brow = (h % n_rep) * seg_len + r;
                group = g;
                nrows = n_rep * seg_len;
            } else {
                brow = r;
                group = h;
                nrows = seg_len;
            }
            const long long base = bias_shared ? 0 : (long long)group * nrows * total;
            sc += bias[base + (long long)brow * total + t];
        }
        p[t] = sc;
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int t = threadIdx.x; t < visible; t += blockDim.x) mx = fmaxf(mx, p[t]);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < visible; t += blockDim.x) {
        const float e = expf(p[t] - mx);
        p[t] = e;
        sum += e;
    }
    sum = block_sum(sum);
    const float inv = 1.0f / sum;
    for (int t = threadIdx.x; t < visible; t += blockDim.x) p[t] *= inv;
    __syncthreads();
    const long long o = out_heads_first ? ((long long)h * rows + r) * hd : ((long long)r * heads + h) * hd;
    // Output: warp w sums positions w, w + warps, ...; its lanes cover the
    // head (OUT_PER_LANE elements each), then the warps' shares are added.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#define OUT_PER_LANE 4
    for (int d0 = 0; d0 < hd; d0 += 32 * OUT_PER_LANE) {
        float acc[OUT_PER_LANE] = {};
        const float* vbase = vc + (long long)g * hd + d0 + lane;
#pragma unroll 4
        for (int t = warp; t < visible; t += warps) {
            const float pt = p[t];
            const float* vrow = vbase + t * key_stride;
#pragma unroll
            for (int j = 0; j < OUT_PER_LANE; ++j)
                if (d0 + lane + 32 * j < hd) acc[j] += pt * vrow[32 * j];
        }
#pragma unroll
        for (int j = 0; j < OUT_PER_LANE; ++j) partial[warp * 32 * OUT_PER_LANE + 32 * j + lane] = acc[j];
        __syncthreads();
        for (int i = threadIdx.x; i < 32 * OUT_PER_LANE; i += blockDim.x) {
            if (d0 + i < hd) {
                float total_acc = 0.0f;
                for (int wi = 0; wi < warps; ++wi) total_acc += partial[wi * 32 * OUT_PER_LANE + i];
                out[o + d0 + i] = total_acc;
            }
        }
        __syncthreads();
    }
}


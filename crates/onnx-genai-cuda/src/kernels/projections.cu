// native-cuda kernels: the projections. Compiled after common.cu, as one
// program with it (device.rs).

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
    GRID_DEPEND();
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

// One lane's share of one pass over a 4-bit row: its words and their
// blocks' scales, zero points and offsets.
struct Q4Words {
    unsigned int w[WORDS_PER_LANE];
    float scale[WORDS_PER_LANE], zero[WORDS_PER_LANE], offset[WORDS_PER_LANE];
};

__device__ __forceinline__ void q4_load(Q4Words& q, const unsigned char* data, const float* scales,
                                        const unsigned char* zeros, const float* offsets, long long row,
                                        int blocks, int block, int base, int lane) {
    const int row_bytes = blocks * block / 2, nwords = row_bytes / 4;
    const unsigned int* words = (const unsigned int*)(data + row * row_bytes);
#pragma unroll
    for (int u = 0; u < WORDS_PER_LANE; ++u) {
        const int wi = base + u * 32 + lane;
        const bool in = wi < nwords;
        const int b = in ? wi * 8 / block : 0;
        q.w[u] = in ? words[wi] : 0u;
        q.scale[u] = in ? scales[row * blocks + b] : 0.0f;
        q.zero[u] = (float)q4_zero(zeros, row, blocks, b);
        q.offset[u] = offsets ? offsets[row * blocks + b] : 0.0f;
    }
}

// Input rows per warp of the 4-bit row kernel: a product of m rows takes
// ceil(m / ROWS_PER_WARP) warps per output, so that a warp's chain of
// dependent loads and multiply-adds stays short (one warp over 16 rows ran
// ~2,300 instructions at ~14.5 cycles each: 33 us for a 576x576 product).
#define ROWS_PER_WARP 4
// Outputs per block of the 4-bit row kernel (a block of 4 * groups warps).
#define OUTS_PER_BLOCK 4

// acc[r] += the pass's share of x[r] . w for `rows` (<= ROWS_PER_WARP)
// input rows: the lane's words dequantized once, each input row streamed
// past them (a row's loads are independent: one latency each). Words past
// the row's end are skipped (they would add nothing).
__device__ __forceinline__ void q4_accumulate(const Q4Words& q, const float* x, int rows, int k, int base, int lane,
                                              int vec_x, float (&acc)[ROWS_PER_WARP]) {
    float wv[WORDS_PER_LANE][8];
#pragma unroll
    for (int u = 0; u < WORDS_PER_LANE; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[u][e] = ((float)((q.w[u] >> (4 * e)) & 15) - q.zero[u]) * q.scale[u] + q.offset[u];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        if (r >= rows) break;
        const float* xr = x + (long long)r * k;
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < WORDS_PER_LANE; ++u) {
            const int e0 = (base + u * 32 + lane) * 8;
            if (e0 >= k) continue;
            if (vec_x) {
                const float4 a = *(const float4*)(xr + e0), c = *(const float4*)(xr + e0 + 4);
                sum += wv[u][0] * a.x + wv[u][1] * a.y + wv[u][2] * a.z + wv[u][3] * a.w + wv[u][4] * c.x +
                       wv[u][5] * c.y + wv[u][6] * c.z + wv[u][7] * c.w;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e0 + e < k) sum += wv[u][e] * xr[e0 + e];
            }
        }
        acc[r] += sum;
    }
}

// 16 bytes from global to shared memory without passing through registers,
// so that a thread has all of its copies in flight at once (sm_80+).
__device__ __forceinline__ void copy_async16(float* shared_dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int dst;
    asm volatile("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(dst) : "l"(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
    *(float4*)shared_dst = *(const float4*)src;
#endif
}

__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// y[m, n] = x[m, k] . W^T (+ bias) for m <= ROWS_PER_PASS: a block of
// OUTS_PER_BLOCK outputs, a warp per (output, group of ROWS_PER_WARP input
// rows). `gated` (kernel gemv_q4_gated): W holds the gate rows, then the
// up rows (n = 2 * half), and y[m, half] = silu(x . gate) * (x . up), each
// warp computing both rows of its output (the gated MLP in one kernel). `staged`: the block first
// copies x to shared memory, which its warps then read at shared-memory
// latency.
template <bool gated>
__device__ __forceinline__ void gemv_q4_body(const float* x, const unsigned char* data, const float* scales,
                                             const unsigned char* zeros, const float* offsets, const float* bias,
                                             float* y, int m, int n, int k, int block, int blocks, int vec_x,
                                             int staged) {
    extern __shared__ float xs_shared[];
    const int groups = (m + ROWS_PER_WARP - 1) / ROWS_PER_WARP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = warp % groups;
    const int outs = gated ? n / 2 : n;
    const int nwords = blocks * block / 8;
    // The weights do not depend on the kernel before this one: the first
    // output's first pass is requested before waiting for it to finish.
    Q4Words q[2];
    {
        const int first = blockIdx.x * OUTS_PER_BLOCK + warp / groups;
        if (first < outs) {
            q4_load(q[0], data, scales, zeros, offsets, first, blocks, block, 0, lane);
            if (gated) q4_load(q[1], data, scales, zeros, offsets, first + outs, blocks, block, 0, lane);
        }
    }
    GRID_DEPEND();
    if (staged) {
        const int count = m * k;
        if (vec_x) {
            for (int i = threadIdx.x; i < count / 4; i += blockDim.x) copy_async16(xs_shared + 4 * i, x + 4 * i);
            copy_async_wait();
        } else {
            for (int i = threadIdx.x; i < count; i += blockDim.x) xs_shared[i] = x[i];
        }
        __syncthreads();
        x = xs_shared;
    }
    const int r0 = group * ROWS_PER_WARP, rows = min(ROWS_PER_WARP, m - r0);
    const float* xg = x + (long long)r0 * k;
    // A grid smaller than the outputs (a large n: the logits head) takes
    // them in turns, so that x is staged once per block, not per output.
    for (int ob = blockIdx.x; ob * OUTS_PER_BLOCK < outs; ob += gridDim.x) {
        const int out = ob * OUTS_PER_BLOCK + warp / groups;
        if (out >= outs) break;
        float acc[2][ROWS_PER_WARP] = {};
        for (int base = 0; base < nwords; base += 32 * WORDS_PER_LANE) {
            if (base > 0 || ob != blockIdx.x) {
                q4_load(q[0], data, scales, zeros, offsets, out, blocks, block, base, lane);
                if (gated) q4_load(q[1], data, scales, zeros, offsets, out + outs, blocks, block, base, lane);
            }
            q4_accumulate(q[0], xg, rows, k, base, lane, vec_x, acc[0]);
            if (gated) q4_accumulate(q[1], xg, rows, k, base, lane, vec_x, acc[1]);
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            if (r >= rows) break;
            const float s = warp_sum(acc[0][r]);
            float v;
            if (gated) {
                const float u = warp_sum(acc[1][r]);
                v = s / (1.0f + expf(-s)) * u;
            } else {
                v = s + (bias ? bias[out] : 0.0f);
            }
            if (lane == 0) y[(long long)(r0 + r) * outs + out] = v;
        }
    }
}

#define GEMV_Q4_THREADS (32 * OUTS_PER_BLOCK * (ROWS_PER_PASS / ROWS_PER_WARP))

extern "C" __global__ void __launch_bounds__(GEMV_Q4_THREADS)
    gemv_q4(const float* x, const unsigned char* data, const float* scales, const unsigned char* zeros,
            const float* offsets, const float* bias, float* y, int m, int n, int k, int block, int blocks, int vec_x,
            int staged) {
    gemv_q4_body<false>(x, data, scales, zeros, offsets, bias, y, m, n, k, block, blocks, vec_x, staged);
}

extern "C" __global__ void __launch_bounds__(GEMV_Q4_THREADS)
    gemv_q4_gated(const float* x, const unsigned char* data, const float* scales, const unsigned char* zeros,
                  const float* offsets, const float* bias, float* y, int m, int n, int k, int block, int blocks,
                  int vec_x, int staged) {
    gemv_q4_body<true>(x, data, scales, zeros, offsets, bias, y, m, n, k, block, blocks, vec_x, staged);
}

// accuracy_level 4, as ONNX Runtime's CPU kernel computes it: each input
// block quantized to int8 (scale max|x| / 127, round to nearest even), exact
// integer block sums, scaled per block. One warp per (row, block) of x.
extern "C" __global__ void quantize_blocks(const float* x, signed char* xq, float* xs, int m, int k, int block,
                                           int blocks) {
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = half_to_float(w[i]);
}

extern "C" __global__ void add_bias(float* y, const float* bias, int m, int n) {
    GRID_DEPEND();
    const long long total = (long long)m * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % n];
}

// Gated MLP: both = [gate | up] per row; out = silu(gate) * up.
extern "C" __global__ void silu_mul(const float* both, float* out, int m, int half) {
    GRID_DEPEND();
    const long long total = (long long)m * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / half;
        const int j = i % half;
        const float g = both[r * 2 * half + j], u = both[r * 2 * half + half + j];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}


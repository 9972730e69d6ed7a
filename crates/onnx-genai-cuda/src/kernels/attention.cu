// native-cuda kernels: KV append and attention. Compiled after common.cu, as one
// program with it (device.rs).

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

// Element d of row r's new key (rotated at `pos` when `rot`) and value for
// KV head h, rounded to f16 when the cache holds f16 values.
__device__ __forceinline__ void new_kv(const float* k, const Heads& kd, const float* v, const Heads& vd, int r, int h,
                                       int d, int rot, const float* cos_t, const float* sin_t, int half, long long pos,
                                       int round16, float& kv, float& vv) {
    const float* ksrc = k + heads_at(kd, r, h);
    kv = rot ? rotated(ksrc, d, half, cos_t, sin_t, pos) : ksrc[d];
    vv = v[heads_at(vd, r, h) + d];
    if (round16) {
        kv = round_half(kv);
        vv = round_half(vv);
    }
}

// One block per (row, KV head), one thread per element of the head.
extern "C" __global__ void kv_append(const float* k, Heads kd, const float* v, Heads vd,
                                     const unsigned long long* kptrs, const unsigned long long* vptrs,
                                     const int* row_seg, const int* row_pos, int kv_heads, int rot,
                                     const float* cos_t, const float* sin_t, int half, int table_positions,
                                     int round16, int* err) {
    GRID_DEPEND();
    const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= kd.dim) return;
    const int s = row_seg[r];
    const long long pos = row_pos[r];
    float* kc = (float*)kptrs[s];
    float* vc = (float*)vptrs[s];
    const long long dst = (pos * kv_heads + h) * kd.dim + d;
    if (rot && pos >= table_positions) {
        atomicCAS(err, 0, ERR_POSITION);
        return;
    }
    float kv, vv;
    new_kv(k, kd, v, vd, r, h, d, rot, cos_t, sin_t, half, pos, round16, kv, vv);
    kc[dst] = kv;
    vc[dst] = vv;
}

// One block per (row, query head), ATTEND_THREADS threads: a thread per
// visible key for the scores (the key row read as float4 when head_dim
// allows), softmax over the block, then the weighted sum of the values with
// each output element's positions split over the threads that share it.
// Dynamic shared memory: head_dim + context + 4 * ATTEND_THREADS floats
// (rounded up to a multiple of 4), then 2 * head_dim.
// bias_mode: 0 none (causal), 1 per query head, 2 grouped (a group's query
// heads stacked along rows).
#define ATTEND_THREADS 128

extern "C" __global__ void attend(const float* q, Heads qd, float* out, int out_heads_first, int rows,
                                  const unsigned long long* kptrs, const unsigned long long* vptrs,
                                  const int* row_seg, const int* row_pos, const int* seg_total, int heads,
                                  int kv_heads, float scale, int rot, const float* cos_t, const float* sin_t,
                                  int half, int table_positions, const float* bias, int bias_mode, int bias_shared,
                                  int context, int* err, const float* k, Heads kd, const float* v, Heads vd,
                                  int round16, int append) {
    GRID_DEPEND();
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
    // `append` (decode: each sequence has one new row): this row's key and
    // value are computed here, kept in shared memory for its own position,
    // and written to the cache by the group's first head (no other block
    // reads that position in this step) — kv_append's work without its
    // launch.
    float* ks = shared + ((hd + context + 4 * ATTEND_THREADS + 3) & ~3);
    float* vs = ks + hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        qs[d] = rot ? rotated(qsrc, d, half, cos_t, sin_t, pos) : qsrc[d];
        if (append) {
            float kv, vv;
            new_kv(k, kd, v, vd, r, g, d, rot, cos_t, sin_t, half, pos, round16, kv, vv);
            ks[d] = kv;
            vs[d] = vv;
            if (h % n_rep == 0) {
                const long long dst = (pos * kv_heads + g) * hd + d;
                ((float*)kc)[dst] = kv;
                ((float*)vc)[dst] = vv;
            }
        }
    }
    __syncthreads();
    // With a bias the step holds one sequence: row r is its r-th new row.
    const int seg_len = rows;
    const long long key_stride = (long long)kv_heads * hd;
    for (int t = threadIdx.x; t < visible; t += blockDim.x) {
        const float* key = append && t == pos ? ks : kc + t * key_stride + (long long)g * hd;
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
            const float* vrow = append && t == pos ? vs + d0 + lane : vbase + t * key_stride;
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


// native-cuda kernels: elementwise math, normalization, gathers and rotary. Compiled after common.cu, as one
// program with it (device.rs).

// ---- elementwise ---------------------------------------------------------

extern "C" __global__ void binary(int op, const float* a, const float* b, float* out, int n, Broadcast bc,
                                  int round16) {
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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
    GRID_DEPEND();
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


// native-cuda kernels, compiled at load by NVRTC for the device's
// architecture. Activations are f32 on the device (values of f16 type are
// kept rounded to f16, exactly as native-cpu stores them); weights keep their
// storage (f32, f16, 4-bit blocks). Kernels that can meet bad input (an index
// out of range) set `*err` to a code the host turns into a typed error.

// The source is one NVRTC program: this file, then pointwise.cu,
// projections.cu and attention.cu, concatenated in that order
// (`kernel_source` in device.rs). No headers: NVRTC compiles it alone (f16
// conversion through PTX cvt).
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

// Programmatic dependent launch (sm_90+): a kernel may be launched while the
// one before it in the stream still runs; `GRID_WAIT` holds it until that
// one has finished and its writes are visible, `GRID_RELEASE` lets the next
// kernel launch. Every kernel waits before it reads anything another kernel
// wrote and before any of its threads may return (a grid that ended without
// waiting would let the kernel after it overtake the one before), and
// releases right after. Both are no-ops for a kernel launched without the
// attribute, and compile to nothing before sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define GRID_RELEASE() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define GRID_WAIT()
#define GRID_RELEASE()
#endif
#define GRID_DEPEND() \
    do {              \
        GRID_WAIT();  \
        GRID_RELEASE(); \
    } while (0)

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


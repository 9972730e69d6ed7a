//! Projection weights on the device, in the row form the compiler hands
//! over (`[N, K]` f32, f16 or 4-bit blocks), and the products over them:
//! a warp per output row for a few input rows (decode), cuBLAS over
//! widened weights for many (prefill).

use cudarc::cublas::sys::cublasOperation_t;
use onnx_genai_native::kernels::weights::{Packed, Weight};

use crate::device::{grid, grown, launch, DBuf, Device};
use crate::error::CudaError;

/// Up to this many input rows a product runs in the row kernels; beyond, on
/// cuBLAS over the weight widened to f32. `gemv_f16` and `gemv_q4_int8` hold
/// this many rows' sums per lane (`ROWS_PER_PASS` in kernels/); `gemv_q4`
/// spreads them over warps of `GEMV_Q4_ROWS_PER_WARP` rows, at most
/// `ROWS_PER_PASS / ROWS_PER_WARP` warps per output (its launch bound).
const GEMV_MAX_ROWS: usize = 16;

/// Warps (output rows) per block of the row kernels.
const ROWS_PER_BLOCK: u32 = 4;

/// `gemv_q4`'s outputs per block and input rows per warp (`OUTS_PER_BLOCK`
/// and `ROWS_PER_WARP` in kernels/).
const GEMV_Q4_OUTS_PER_BLOCK: u32 = 4;
const GEMV_Q4_ROWS_PER_WARP: usize = 4;

// gemv_q4's blocks stay within its launch bound of 512 threads.
const _: () = assert!(GEMV_MAX_ROWS.div_ceil(GEMV_Q4_ROWS_PER_WARP) * GEMV_Q4_OUTS_PER_BLOCK as usize * 32 <= 512);

enum Storage {
    F32(DBuf),
    F16(DBuf),
    Q4 {
        data: DBuf,
        scales: DBuf,
        zeros: Option<DBuf>,
        offsets: Option<DBuf>,
        block: usize,
        blocks: usize,
        /// accuracy_level 4: inputs quantized to int8 per block.
        int8: bool,
    },
}

/// Buffers products borrow: a widened weight, quantized inputs.
#[derive(Default)]
pub(crate) struct Scratch {
    wide: Option<DBuf>,
    quantized: Option<DBuf>,
    input_scales: Option<DBuf>,
    /// The gated MLP's gate and up products where they are not fused.
    both: Option<DBuf>,
}

/// `x @ W^T + b` on the device.
pub(crate) struct Projection {
    pub n: usize,
    pub k: usize,
    storage: Storage,
    bias: Option<DBuf>,
}

fn i32_of(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("{what} {v} does not fit the kernels' 32-bit sizes")))
}

impl Projection {
    pub fn upload(dev: &Device, w: &Weight, bias: Option<&[f32]>) -> Result<Self, CudaError> {
        let storage = match &w.packed {
            Packed::F32(rows) => Storage::F32(dev.upload(rows)?),
            Packed::F16(rows) => {
                let bits: Vec<u16> = rows.iter().map(|h| h.to_bits()).collect();
                Storage::F16(dev.upload(&bits)?)
            }
            Packed::Q4 { data, scales, zeros, offsets, block, blocks, int8 } => {
                if *int8 && offsets.is_some() {
                    return Err(CudaError::Unsupported("int8-input 4-bit weights with block offsets".into()));
                }
                Storage::Q4 {
                    data: dev.upload(data)?,
                    scales: dev.upload(scales)?,
                    zeros: zeros.as_deref().map(|z| dev.upload(z)).transpose()?,
                    offsets: offsets.as_deref().map(|o| dev.upload(o)).transpose()?,
                    block: *block,
                    blocks: *blocks,
                    int8: *int8,
                }
            }
            other => {
                return Err(CudaError::Unsupported(format!(
                    "a projection weight in {} form (native-cuda takes row-form weights)",
                    match other {
                        Packed::Q8 { .. } => "8-bit",
                        _ => "tiled",
                    }
                )))
            }
        };
        let bias = bias.map(|b| dev.upload(b)).transpose()?;
        Ok(Self { n: w.n, k: w.k, storage, bias })
    }

    /// Bytes one pass over the weight reads.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(w) | Storage::F16(w) => w.bytes(),
            Storage::Q4 { data, scales, zeros, offsets, .. } => {
                data.bytes()
                    + scales.bytes()
                    + zeros.as_ref().map_or(0, DBuf::bytes)
                    + offsets.as_ref().map_or(0, DBuf::bytes)
            }
        }
    }

    /// `y[m, n] = x[m, k] . W[n, :] (+ bias)`; `x` and `y` are device
    /// addresses of f32 rows.
    pub fn run(&self, dev: &Device, x: u64, m: usize, y: u64, scratch: &mut Scratch) -> Result<(), CudaError> {
        if m == 0 {
            return Ok(());
        }
        if self.gemv_q4_takes(m) {
            return self.gemv_q4(dev, x, m, y, false);
        }
        self.product(dev, x, m, y, scratch)
    }

    /// The gated MLP over this weight (its gate rows, then its up rows):
    /// `y[m, n / 2] = silu(x . gate) * (x . up)`. In one kernel where the
    /// 4-bit row kernel takes the product, else the product then `silu_mul`.
    pub fn run_gated(&self, dev: &Device, x: u64, m: usize, y: u64, scratch: &mut Scratch) -> Result<(), CudaError> {
        if m == 0 {
            return Ok(());
        }
        // The fused kernel adds no bias (a gated MLP's weight has none).
        if self.gemv_q4_takes(m) && self.bias.is_none() {
            return self.gemv_q4(dev, x, m, y, true);
        }
        let both = grown(dev, &mut scratch.both, m * self.n * 4)?.ptr();
        self.product(dev, x, m, both, scratch)?;
        let half = self.n / 2;
        let (mi, hi) = (i32_of(m, "rows")?, i32_of(half, "outputs")?);
        launch!(dev, "silu_mul", grid(m * half, 256), both, y, mi, hi)
    }

    /// Whether `gemv_q4` takes a product of `m` rows: 4-bit weights with
    /// f32 inputs, blocks of whole words, few rows.
    fn gemv_q4_takes(&self, m: usize) -> bool {
        matches!(&self.storage, Storage::Q4 { int8: false, block, .. } if block.is_multiple_of(8)) && m <= GEMV_MAX_ROWS
    }

    /// The 4-bit row kernel (`gated`: the gated MLP's fused form, a warp per
    /// gate/up pair).
    fn gemv_q4(&self, dev: &Device, x: u64, m: usize, y: u64, gated: bool) -> Result<(), CudaError> {
        let Storage::Q4 { data, scales, zeros, offsets, block, blocks, .. } = &self.storage else {
            return Err(CudaError::Unsupported("gemv_q4 over a weight that is not 4-bit".into()));
        };
        let (dp, sp) = (data.ptr(), scales.ptr());
        let zp = zeros.as_ref().map_or(0u64, DBuf::ptr);
        let op = offsets.as_ref().map_or(0u64, DBuf::ptr);
        let bias = self.bias.as_ref().map_or(0u64, DBuf::ptr);
        let (mi, ni, ki) = (i32_of(m, "rows")?, i32_of(self.n, "outputs")?, i32_of(self.k, "inputs")?);
        let (bi, bsi) = (i32_of(*block, "block")?, i32_of(*blocks, "blocks")?);
        let vec_x = i32::from(self.k.is_multiple_of(8));
        // The block's warps share its input rows: staged in shared memory
        // when they fit.
        let staged_bytes = m * self.k * 4;
        let staged = i32::from(staged_bytes <= dev.max_shared);
        let outs = if gated { self.n / 2 } else { self.n };
        // A warp per output and group of input rows (kernels/projections.cu:
        // OUTS_PER_BLOCK, ROWS_PER_WARP).
        let groups = m.div_ceil(GEMV_Q4_ROWS_PER_WARP) as u32;
        let threads = GEMV_Q4_OUTS_PER_BLOCK * groups * 32;
        // Two waves of the blocks an SM holds (the kernel takes up to 128
        // registers a thread: 512 threads a block fill an SM's 64 Ki); a
        // larger product loops, staging x once per block.
        let resident = (512 / threads).max(1) as usize;
        let cap = (2 * dev.sm_count * resident) as u32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: ((outs as u32).div_ceil(GEMV_Q4_OUTS_PER_BLOCK).min(cap), 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: if staged == 1 { staged_bytes as u32 } else { 0 },
        };
        if gated {
            launch!(dev, "gemv_q4_gated", cfg, x, dp, sp, zp, op, bias, y, mi, ni, ki, bi, bsi, vec_x, staged)
        } else {
            launch!(dev, "gemv_q4", cfg, x, dp, sp, zp, op, bias, y, mi, ni, ki, bi, bsi, vec_x, staged)
        }
    }

    /// Every product but `gemv_q4`'s: the f16 and 8-bit-input row kernels,
    /// and cuBLAS over the weight (widened to f32 where it is not).
    fn product(&self, dev: &Device, x: u64, m: usize, y: u64, scratch: &mut Scratch) -> Result<(), CudaError> {
        let (mi, ni, ki) = (i32_of(m, "rows")?, i32_of(self.n, "outputs")?, i32_of(self.k, "inputs")?);
        let bias = self.bias.as_ref().map_or(0u64, DBuf::ptr);
        let rows_cfg = cudarc::driver::LaunchConfig {
            grid_dim: ((self.n as u32).div_ceil(ROWS_PER_BLOCK), 1, 1),
            block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        match &self.storage {
            Storage::F32(w) => {
                self.sgemm(dev, w.ptr(), x, m, y)?;
                self.add_bias(dev, y, mi, ni)
            }
            Storage::F16(w) if m <= GEMV_MAX_ROWS => {
                let wp = w.ptr();
                launch!(dev, "gemv_f16", rows_cfg, x, wp, bias, y, mi, ni, ki)
            }
            Storage::F16(w) => {
                let count = self.n * self.k;
                let wide = grown(dev, &mut scratch.wide, count * 4)?.ptr();
                let (wp, count) = (w.ptr(), count as i64);
                launch!(dev, "widen_f16", grid(self.n * self.k, 256), wp, wide, count)?;
                self.sgemm(dev, wide, x, m, y)?;
                self.add_bias(dev, y, mi, ni)
            }
            Storage::Q4 { data, scales, zeros, offsets, block, blocks, int8 } => {
                let (dp, sp) = (data.ptr(), scales.ptr());
                let zp = zeros.as_ref().map_or(0u64, DBuf::ptr);
                let op = offsets.as_ref().map_or(0u64, DBuf::ptr);
                let (bi, bsi) = (i32_of(*block, "block")?, i32_of(*blocks, "blocks")?);
                if *int8 {
                    let padded = blocks * block;
                    let xq = grown(dev, &mut scratch.quantized, m * padded)?.ptr();
                    let xs = grown(dev, &mut scratch.input_scales, m * blocks * 4)?.ptr();
                    let qcfg = cudarc::driver::LaunchConfig {
                        grid_dim: (*blocks as u32, m as u32, 1),
                        block_dim: (32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    launch!(dev, "quantize_blocks", qcfg, x, xq, xs, mi, ki, bi, bsi)?;
                    return launch!(dev, "gemv_q4_int8", rows_cfg, xq, xs, dp, sp, zp, bias, y, mi, ni, bi, bsi);
                }
                let wide = grown(dev, &mut scratch.wide, self.n * self.k * 4)?.ptr();
                launch!(dev, "dequant_q4", grid(self.n * self.k, 256), dp, sp, zp, op, wide, ni, ki, bi, bsi)?;
                self.sgemm(dev, wide, x, m, y)?;
                self.add_bias(dev, y, mi, ni)
            }
        }
    }

    fn add_bias(&self, dev: &Device, y: u64, m: i32, n: i32) -> Result<(), CudaError> {
        let Some(b) = &self.bias else { return Ok(()) };
        let bp = b.ptr();
        launch!(dev, "add_bias", grid(self.n * m as usize, 256), y, bp, m, n)
    }

    /// Row-major `y[m, n] = x[m, k] . w[n, k]^T` through cuBLAS (column
    /// major: `y^T = w^T' . x^T`, i.e. op(A) = T on the `[k, n]` view of w).
    fn sgemm(&self, dev: &Device, w: u64, x: u64, m: usize, y: u64) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (n, k) = (i32_of(self.n, "outputs")?, i32_of(self.k, "inputs")?);
        let m = i32_of(m, "rows")?;
        // SAFETY: w holds n*k, x m*k and y m*n f32 values on this device;
        // the handle runs on the device's stream.
        unsafe {
            cudarc::cublas::result::sgemm(
                *dev.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha,
                w as *const f32,
                k,
                x as *const f32,
                k,
                &beta,
                y as *mut f32,
                n,
            )?;
        }
        Ok(())
    }
}

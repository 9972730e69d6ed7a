//! The device form of the plan's ops other than attention: projections,
//! elementwise math, layout copies, gathers, normalization, rotary.

use onnx_genai_native::kernels::attention::Layout;
use onnx_genai_native::kernels::elementwise::{broadcast_shape, BinOp, UnOp};
use onnx_genai_native::kernels::layout as ly;
use onnx_genai_native::value::{DType, Shape};
use onnx_genai_native::{Op, Ref};

use super::{check_width, elem_bytes, i32_of, unsupported, Broadcast, DTensor, Permute, Runner, MAX_RANK};
use crate::device::{grid, launch, DBuf};
use crate::error::CudaError;

/// `shape` with its last axis set to `n`.
fn with_last(mut shape: Shape, n: usize) -> Shape {
    if let Some(l) = shape.last_mut() {
        *l = n;
    }
    shape
}

impl Runner {
    /// A projection (`gated`: the gated MLP, `silu(x Wg) * (x Wu)`).
    pub(super) fn linear(&mut self, index: usize, x: Ref, out: usize, gated: bool) -> Result<(), CudaError> {
        if gated {
            return self.gated(index, x, out);
        }
        let (x, shape, m, n) = self.projection_input(index, x)?;
        let buf = self.out_buf(out, m * n * 4)?;
        let proj = self.projections[index].as_ref().ok_or_else(|| unsupported("projection not uploaded"))?;
        proj.run(&self.device, x, m, buf.ptr(), &mut self.scratch)?;
        self.put(out, with_last(shape, n), DType::F32, buf);
        Ok(())
    }

    /// The device address of a projection's input, its shape, its rows and
    /// the projection's outputs.
    fn projection_input(&mut self, index: usize, x: Ref) -> Result<(u64, Shape, usize, usize), CudaError> {
        let (x, shape, _) = self.device_input(x)?;
        let proj = self.projections[index].as_ref().ok_or_else(|| unsupported("projection not uploaded"))?;
        let (k, n) = (proj.k, proj.n);
        if shape.last() != Some(&k) {
            return Err(unsupported(format!("input {shape:?} does not end in the weight's {k} inputs")));
        }
        let m = shape.iter().product::<usize>() / k.max(1);
        Ok((x, shape, m, n))
    }

    fn gated(&mut self, index: usize, x: Ref, out: usize) -> Result<(), CudaError> {
        let (x, shape, m, n) = self.projection_input(index, x)?;
        let half = n / 2;
        let buf = self.out_buf(out, m * half * 4)?;
        let proj = self.projections[index].as_ref().ok_or_else(|| unsupported("projection not uploaded"))?;
        proj.run_gated(&self.device, x, m, buf.ptr(), &mut self.scratch)?;
        self.put(out, with_last(shape, half), DType::F32, buf);
        Ok(())
    }

    /// Identity, Reshape, Squeeze, Unsqueeze of a device value: a copy
    /// under the new shape.
    pub(super) fn relayout(&mut self, op: &Op, inputs: &[Option<Ref>], out: usize) -> Result<(), CudaError> {
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        let (x, shape, dt) = self.device_input(input(0)?)?;
        let target: Shape =
            match op {
                Op::Identity => shape.clone(),
                Op::Reshape => ly::reshape_target(&shape, &self.host_ints(inputs.get(1).copied().flatten())?)
                    .map_err(unsupported)?,
                Op::Unsqueeze(Some(a)) => ly::unsqueeze_target(&shape, a).map_err(unsupported)?,
                Op::Unsqueeze(None) => ly::unsqueeze_target(&shape, &self.host_ints(inputs.get(1).copied().flatten())?)
                    .map_err(unsupported)?,
                Op::Squeeze(Some(a)) => ly::squeeze_target(&shape, Some(a)).map_err(unsupported)?,
                _ => match inputs.get(1).copied().flatten() {
                    Some(r) => ly::squeeze_target(&shape, Some(&self.host_ints(Some(r))?)).map_err(unsupported)?,
                    None => ly::squeeze_target(&shape, None).map_err(unsupported)?,
                },
            };
        let bytes = shape.iter().product::<usize>() * elem_bytes(dt);
        let buf = self.out_buf(out, bytes)?;
        self.device.copy(buf.ptr(), x, bytes)?;
        self.put(out, target, dt, buf);
        Ok(())
    }

    pub(super) fn transpose(&mut self, perm: Option<&[i64]>, x: Ref, out: usize) -> Result<(), CudaError> {
        let (x, shape, dt) = self.device_input(x)?;
        let rank = shape.len();
        let perm: Vec<usize> = match perm {
            Some(p) => p.iter().map(|a| ly::axis(*a, rank)).collect::<Result<_, _>>().map_err(unsupported)?,
            None => (0..rank).rev().collect(),
        };
        if rank > MAX_RANK || perm.len() != rank {
            return Err(unsupported(format!("transpose of rank {rank} with perm {perm:?}")));
        }
        let mut strides = vec![1usize; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let mut p = Permute { rank: rank as i32, ..Permute::default() };
        let mut oshape = Shape::new();
        for (j, &a) in perm.iter().enumerate() {
            p.out_dims[j] = i32_of(shape[a]).map_err(unsupported)?;
            p.in_strides[j] = i32_of(strides[a]).map_err(unsupported)?;
            oshape.push(shape[a]);
        }
        let n = shape.iter().product::<usize>();
        let buf = self.out_buf(out, n * 4)?;
        let (y, ni) = (buf.ptr(), n as i32);
        let dev = self.device.clone();
        launch!(dev, "permute", grid(n, 256), x, y, ni, p)?;
        self.put(out, oshape, dt, buf);
        Ok(())
    }

    /// Gather along axis 0 (rows of a table).
    pub(super) fn gather(&mut self, table: Ref, ids: Ref, out: usize) -> Result<(), CudaError> {
        let (table, tshape, dt) = self.device_input(table)?;
        let (ids, ishape, _) = self.device_input(ids)?;
        let rows_t = *tshape.first().ok_or_else(|| unsupported("gather from a scalar"))?;
        let width: usize = tshape[1..].iter().product();
        let nids: usize = ishape.iter().product();
        let mut oshape = ishape.clone();
        oshape.extend_from_slice(&tshape[1..]);
        let buf = self.out_buf(out, nids * width * 4)?;
        let (y, ni, wi, ri, err) = (buf.ptr(), nids as i32, width as i32, rows_t as i32, self.err.ptr());
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (nids.max(1) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let dev = self.device.clone();
        if nids > 0 {
            launch!(dev, "gather_rows", cfg, table, ids, y, ni, wi, ri, err)?;
        }
        self.put(out, oshape, dt, buf);
        Ok(())
    }

    pub(super) fn binary(&mut self, b: BinOp, a: Ref, c: Ref, out: usize) -> Result<(), CudaError> {
        let (ap, ashape, dt) = self.device_input(a)?;
        let (bp, bshape, _) = self.device_input(c)?;
        let oshape = broadcast_shape(&ashape, &bshape)
            .ok_or_else(|| unsupported(format!("shapes {ashape:?} and {bshape:?} do not broadcast")))?;
        let rank = oshape.len();
        if rank > MAX_RANK {
            return Err(unsupported(format!("broadcast of rank {rank}")));
        }
        let mut bc = Broadcast { rank: rank.max(1) as i32, ..Broadcast::default() };
        let strides = |shape: &[usize]| -> Vec<i32> {
            // Right-aligned; a broadcast axis has stride 0.
            let mut st = vec![0i32; rank];
            let mut acc = 1usize;
            for j in (0..shape.len()).rev() {
                let o = rank - shape.len() + j;
                st[o] = if shape[j] == 1 { 0 } else { acc as i32 };
                acc *= shape[j];
            }
            st
        };
        let (sa, sb) = (strides(&ashape), strides(&bshape));
        for j in 0..rank {
            bc.out_dims[j] = i32_of(oshape[j]).map_err(unsupported)?;
            bc.a_strides[j] = sa[j];
            bc.b_strides[j] = sb[j];
        }
        if rank == 0 {
            bc.out_dims[0] = 1;
        }
        let n: usize = oshape.iter().product();
        let buf = self.out_buf(out, n * 4)?;
        let code = binary_code(b).ok_or_else(|| unsupported(format!("{b:?} has no device kernel")))?;
        let (y, ni, round) = (buf.ptr(), n as i32, i32::from(dt == DType::F16));
        let dev = self.device.clone();
        launch!(dev, "binary", grid(n, 256), code, ap, bp, y, ni, bc, round)?;
        self.put(out, oshape, dt, buf);
        Ok(())
    }

    /// An elementwise map (unary op `code`; 9 copies), optionally to type
    /// `to` (rounding to f16 when that is the result's type).
    pub(super) fn map(&mut self, code: i32, x: Ref, out: usize, to: Option<DType>) -> Result<(), CudaError> {
        let (xp, shape, dt) = self.device_input(x)?;
        let to = to.unwrap_or(dt);
        let n: usize = shape.iter().product();
        let buf = self.out_buf(out, n * 4)?;
        let (y, ni, round) = (buf.ptr(), n as i32, i32::from(to == DType::F16));
        let dev = self.device.clone();
        launch!(dev, "unary", grid(n, 256), code, xp, y, ni, round)?;
        self.put(out, shape, to, buf);
        Ok(())
    }

    pub(super) fn gather_q4(&mut self, block: usize, inputs: &[Option<Ref>], out: usize) -> Result<(), CudaError> {
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        let data_ref = input(0)?;
        let Ref::Const(dc) = data_ref else { return Err(unsupported("GatherBlockQuantized data must be constant")) };
        let data = self.plan.constant(dc);
        let (&[rows, bytes], Some(scales_ref)) = (data.shape.as_slice(), inputs.get(2).copied().flatten()) else {
            return Err(unsupported(format!("data {:?} must be 2-D with scales", data.shape)));
        };
        let Ref::Const(sc) = scales_ref else {
            return Err(unsupported("GatherBlockQuantized scales must be constant"));
        };
        let blocks = (bytes * 2).div_ceil(block.max(1));
        if self.consts[dc].is_none() {
            let d = data.as_u8().map_err(unsupported)?;
            self.consts[dc] =
                Some(DTensor { shape: data.shape.clone(), dtype: DType::U8, buf: self.device.upload(d)? });
        }
        let zeros = match inputs.get(3).copied().flatten() {
            Some(Ref::Const(zc)) => {
                if self.consts[zc].is_none() {
                    let z = self.plan.constant(zc);
                    let zb = z.as_u8().map_err(unsupported)?;
                    self.consts[zc] =
                        Some(DTensor { shape: z.shape.clone(), dtype: DType::U8, buf: self.device.upload(zb)? });
                }
                self.consts[zc].as_ref().map_or(0, |t| t.buf.ptr())
            }
            Some(_) => return Err(unsupported("GatherBlockQuantized zero points must be constant")),
            None => 0,
        };
        let (sp, _, _) = self.device_input(Ref::Const(sc))?;
        let dp = self.consts[dc].as_ref().map_or(0, |t| t.buf.ptr());
        let (ids, ishape, _) = self.device_input(input(1)?)?;
        let nids: usize = ishape.iter().product();
        let cols = bytes * 2;
        let mut oshape = ishape.clone();
        oshape.push(cols);
        let buf = self.out_buf(out, nids * cols * 4)?;
        let (y, ni, bi, ri, bsi, bl, err) =
            (buf.ptr(), nids as i32, bytes as i32, rows as i32, blocks as i32, block as i32, self.err.ptr());
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (nids.max(1) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let dev = self.device.clone();
        if nids > 0 {
            launch!(dev, "gather_q4", cfg, dp, ids, sp, zeros, y, ni, bi, ri, bsi, bl, err)?;
        }
        self.put(out, oshape, DType::F32, buf);
        Ok(())
    }

    pub(super) fn norm(
        &mut self,
        op: &Op,
        eps: f32,
        inputs: &[Option<Ref>],
        outputs: &[usize],
    ) -> Result<(), CudaError> {
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        let (x, shape, _) = self.device_input(input(0)?)?;
        let d = *shape.last().ok_or_else(|| unsupported("normalizing a scalar"))?;
        let rows = shape.iter().product::<usize>() / d.max(1);
        let out = *outputs.first().ok_or_else(|| unsupported("no output"))?;
        let dev = self.device.clone();
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let di = d as i32;
        match op {
            Op::LayerNorm { .. } => {
                let (gamma, gshape, _) = self.device_input(input(1)?)?;
                let beta = match inputs.get(2).copied().flatten() {
                    Some(r) => self.device_input(r)?.0,
                    None => 0,
                };
                check_width(&gshape, d)?;
                let buf = self.out_buf(out, rows * d * 4)?;
                let y = buf.ptr();
                if rows > 0 {
                    launch!(dev, "layer_norm", cfg, x, gamma, beta, y, di, eps)?;
                }
                self.put(out, shape, DType::F32, buf);
            }
            Op::RmsNorm { .. } => {
                let (gamma, gshape, _) = self.device_input(input(1)?)?;
                check_width(&gshape, d)?;
                let buf = self.out_buf(out, rows * d * 4)?;
                let (y, none) = (buf.ptr(), 0u64);
                if rows > 0 {
                    launch!(dev, "rms_norm", cfg, x, none, none, gamma, y, none, di, eps)?;
                }
                self.put(out, shape, DType::F32, buf);
            }
            _ => {
                let (skip, sshape, _) = self.device_input(input(1)?)?;
                if sshape != shape {
                    return Err(unsupported(format!("input {shape:?} and skip {sshape:?} differ")));
                }
                let (gamma, gshape, _) = self.device_input(input(2)?)?;
                check_width(&gshape, d)?;
                let bias = match inputs.get(3).copied().flatten() {
                    Some(r) => self.device_input(r)?.0,
                    None => 0,
                };
                let buf = self.out_buf(out, rows * d * 4)?;
                let sum_slot = outputs.get(3).copied();
                let sum_buf = match sum_slot {
                    Some(s) => Some(self.out_buf(s, rows * d * 4)?),
                    None => None,
                };
                let (y, sum) = (buf.ptr(), sum_buf.as_ref().map_or(0, DBuf::ptr));
                if rows > 0 {
                    launch!(dev, "rms_norm", cfg, x, skip, bias, gamma, y, sum, di, eps)?;
                }
                self.put(out, shape.clone(), DType::F32, buf);
                if let (Some(s), Some(b)) = (sum_slot, sum_buf) {
                    self.put(s, shape, DType::F32, b);
                }
            }
        }
        Ok(())
    }

    pub(super) fn rotary(
        &mut self,
        layout: Layout,
        cached: bool,
        spec_layout: bool,
        inputs: &[Option<Ref>],
        out: usize,
    ) -> Result<(), CudaError> {
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        let (x, shape, _) = self.device_input(input(0)?)?;
        // A RotaryEmbedding node's 4-D input is heads first (see the op).
        let layout = if spec_layout && shape.len() == 4 { Layout::HeadsFirst } else { layout };
        let (positions, npos, cos_i, sin_i) = if cached {
            let (p, pshape, _) = self.device_input(input(1)?)?;
            (p, pshape.iter().product::<usize>(), 2, 3)
        } else {
            (0, 0, 1, 2)
        };
        let (cos, cshape, _) = self.device_input(input(cos_i)?)?;
        let (sin, _, _) = self.device_input(input(sin_i)?)?;
        let last = *cshape.last().ok_or_else(|| unsupported("cos has no axes"))?;
        let head_dim = if cached { 2 * last } else { last };
        if head_dim == 0 {
            return Err(unsupported("rotary head_dim is 0"));
        }
        let heads = match (layout, shape.as_slice()) {
            (Layout::HeadsFirst, [_, h, _, _]) | (Layout::SeqFirst, [_, _, h, _]) => *h,
            (Layout::SeqFirst, [_, _, hidden]) if hidden % head_dim == 0 => hidden / head_dim,
            _ => return Err(unsupported(format!("input {shape:?} does not fit {layout:?} rows of {head_dim}"))),
        };
        let seq = layout.seq_len(&shape, heads, head_dim).map_err(unsupported)?;
        if cached && npos != seq && npos != 1 {
            return Err(unsupported(format!("{npos} position ids for {seq} positions")));
        }
        let table_positions = cshape.iter().product::<usize>() / last.max(1);
        let n: usize = shape.iter().product();
        let buf = self.out_buf(out, n * 4)?;
        let half = head_dim / 2;
        let (y, np, hf, hi, si, hdi, ci, tp, err) = (
            buf.ptr(),
            npos as i32,
            i32::from(layout == Layout::HeadsFirst),
            heads as i32,
            seq as i32,
            head_dim as i32,
            i32::from(cached),
            table_positions as i32,
            self.err.ptr(),
        );
        let dev = self.device.clone();
        launch!(
            dev,
            "rotary",
            grid(heads * seq * half, 256),
            x,
            y,
            cos,
            sin,
            positions,
            np,
            hf,
            hi,
            si,
            hdi,
            ci,
            tp,
            err
        )?;
        self.put(out, shape, DType::F32, buf);
        Ok(())
    }
}

/// The `binary` kernel's code for `b`; `None` runs the step on the host.
pub(super) fn binary_code(b: BinOp) -> Option<i32> {
    Some(match b {
        BinOp::Add => 0,
        BinOp::Sub => 1,
        BinOp::Mul => 2,
        BinOp::Div => 3,
        BinOp::Pow => 4,
        _ => return None,
    })
}

/// The `map` kernel's code for `u`; `None` runs the step on the host.
pub(super) fn unary_code(u: UnOp) -> Option<i32> {
    Some(match u {
        UnOp::Neg => 0,
        UnOp::Sqrt => 1,
        UnOp::Reciprocal => 2,
        UnOp::Exp => 3,
        UnOp::Sigmoid => 4,
        UnOp::Tanh => 5,
        UnOp::Erf => 6,
        UnOp::Relu => 7,
        UnOp::GeluTanh => 8,
        _ => return None,
    })
}

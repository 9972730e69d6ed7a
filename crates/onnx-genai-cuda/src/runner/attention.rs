//! Attention on the device: each sequence's new keys and values appended
//! to its cache, then every query row attends over its sequence's
//! positions; and the logits projection on each sequence's last row.

use onnx_genai_native::kernels::attention::{Bias, Layout};
use onnx_genai_native::value::{DType, Shape};
use onnx_genai_native::{PartialAttention, Ref};

use super::{unsupported, Heads, Runner, Segment};
use crate::device::{grid, grown, launch, DBuf};
use crate::error::CudaError;

impl Runner {
    pub(super) fn attention(
        &mut self,
        partial: &PartialAttention,
        layer: Option<usize>,
        inputs: &[Option<Ref>],
        out: usize,
        segments: &[Segment],
        rows_total: usize,
    ) -> Result<(), CudaError> {
        let (Some(spec), Some(layer)) = (&partial.resolved, layer) else {
            return Err(unsupported("attention is not bound to a KV cache layer"));
        };
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        if kvh == 0 || heads % kvh != 0 || hd == 0 || hd > 1024 {
            return Err(unsupported(format!("{heads} query heads over {kvh} KV heads of {hd}")));
        }
        let geometry = self.plan.binding.layers.get(layer).map(|l| (l.kv_heads, l.head_dim));
        if geometry != Some((kvh, hd)) {
            return Err(unsupported(format!(
                "KV cache layer {layer} is {geometry:?}, the attention needs {kvh} x {hd}"
            )));
        }
        let (q, qshape, qtype) = self.device_input(input(0)?)?;
        let plain = |layout: Layout, h: usize, rows: usize| Heads {
            heads_first: i32::from(layout == Layout::HeadsFirst),
            heads: h as i32,
            rows: rows as i32,
            dim: hd as i32,
            stride: (h * hd) as i32,
            offset: 0,
        };
        let (qd, k, kd, v, vd, rows) = if partial.packed_qkv {
            let width = (heads + 2 * kvh) * hd;
            let rows = spec
                .q_layout
                .seq_len(&qshape, heads + 2 * kvh, hd)
                .map_err(|e| unsupported(format!("packed QKV: {e}")))?;
            let part = |offset: usize, h: usize| Heads {
                heads_first: 0,
                heads: h as i32,
                rows: rows as i32,
                dim: hd as i32,
                stride: width as i32,
                offset: offset as i32,
            };
            (part(0, heads), q, part(heads * hd, kvh), q, part((heads + kvh) * hd, kvh), rows)
        } else {
            let rows = spec.q_layout.seq_len(&qshape, heads, hd).map_err(|e| unsupported(format!("query: {e}")))?;
            let (k, kshape, _) = self.device_input(input(1)?)?;
            let (v, vshape, _) = self.device_input(input(2)?)?;
            for (name, s) in [("key", &kshape), ("value", &vshape)] {
                let n = spec.kv_layout.seq_len(s, kvh, hd).map_err(|e| unsupported(format!("{name}: {e}")))?;
                if n != rows {
                    return Err(unsupported(format!("{name} has {n} new positions, the query {rows}")));
                }
            }
            (
                plain(spec.q_layout, heads, rows),
                k,
                plain(spec.kv_layout, kvh, rows),
                v,
                plain(spec.kv_layout, kvh, rows),
                rows,
            )
        };
        if rows != rows_total {
            return Err(unsupported(format!(
                "the step has {rows} rows but its sequences hold {rows_total} new positions"
            )));
        }
        let (rot, cos, sin, half, table_positions) = if partial.rotary {
            let (cos, cshape, _) = self.device_input(input(4)?)?;
            let (sin, _, _) = self.device_input(input(5)?)?;
            let half = *cshape.last().ok_or_else(|| unsupported("cos cache has no axes"))?;
            let positions = cshape.iter().product::<usize>() / half.max(1);
            (1i32, cos, sin, half as i32, positions as i32)
        } else {
            (0i32, 0u64, 0u64, 0i32, 0i32)
        };
        let (bias, bias_mode, bias_shared) = match (inputs.get(3).copied().flatten(), spec.bias) {
            (None, Bias::Causal) => (0u64, 0i32, 0i32),
            (Some(b), mode @ (Bias::PerQuery | Bias::Grouped)) => {
                let [seg] = segments else {
                    return Err(unsupported("an additive attention bias takes one sequence at a time"));
                };
                let total = seg.past + seg.len;
                let n_rep = heads / kvh;
                let per_head = if mode == Bias::Grouped { n_rep * seg.len * total } else { seg.len * total };
                let groups = if mode == Bias::Grouped { kvh } else { heads };
                let (bp, bshape, _) = self.device_input(b)?;
                let len: usize = bshape.iter().product();
                if bshape.last() != Some(&total) || (len != per_head && len != per_head * groups) {
                    return Err(unsupported(format!(
                        "attention bias {bshape:?} does not fit {rows} query rows x {total} positions"
                    )));
                }
                (bp, if mode == Bias::Grouped { 2 } else { 1 }, i32::from(len == per_head))
            }
            _ => return Err(unsupported("attention bias input does not match the compiled form")),
        };
        let n_seg = segments.len();
        let table = self.kv_table.as_ref().map_or(0, DBuf::ptr);
        let layers = self.plan.binding.layers.len();
        let kptrs = table + (layer * n_seg * 8) as u64;
        let vptrs = table + ((layers + layer) * n_seg * 8) as u64;
        let row_seg = self.row_seg.as_ref().map_or(0, DBuf::ptr);
        let row_pos = self.row_pos.as_ref().map_or(0, DBuf::ptr);
        let seg_total = self.seg_total.as_ref().map_or(0, DBuf::ptr);
        let round16 = i32::from(self.plan.binding.kv_f16);
        let (kvh_i, err) = (kvh as i32, self.err.ptr());
        let dev = self.device.clone();
        let append = cudarc::driver::LaunchConfig {
            grid_dim: (rows as u32, kvh as u32, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // Decode (one new row per sequence): attend appends the rows' keys
        // and values itself, one launch fewer per layer.
        let fused_append = segments.iter().all(|s| s.len == 1);
        if !fused_append {
            launch!(
                dev,
                "kv_append",
                append,
                k,
                kd,
                v,
                vd,
                kptrs,
                vptrs,
                row_seg,
                row_pos,
                kvh_i,
                rot,
                cos,
                sin,
                half,
                table_positions,
                round16,
                err
            )?;
        }
        // Scores for the whole context when that fits, so that a captured
        // step's launch stays valid as the sequences grow.
        const ATTEND_THREADS: usize = 128;
        let visible = segments.iter().map(|s| s.past + s.len).max().unwrap_or(0);
        let bytes = |positions: usize| ((hd + positions + 4 * ATTEND_THREADS).next_multiple_of(4) + 2 * hd) * 4;
        let context = self.plan.binding.max_sequence_length;
        let held = if bytes(context) <= dev.max_shared {
            context
        } else {
            self.capturable = false;
            visible
        };
        let shared = bytes(held);
        if shared > dev.max_shared {
            return Err(unsupported(format!(
                "attention over {visible} positions needs {shared} bytes of shared memory; the device offers {}",
                dev.max_shared
            )));
        }
        let buf = self.out_buf(out, rows * heads * hd * 4)?;
        let (y, ohf, ri, hi, scale) =
            (buf.ptr(), i32::from(spec.out_layout == Layout::HeadsFirst), rows as i32, heads as i32, spec.scale);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows as u32, heads as u32, 1),
            block_dim: (ATTEND_THREADS as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (held, fused) = (held as i32, i32::from(fused_append));
        launch!(
            dev,
            "attend",
            cfg,
            q,
            qd,
            y,
            ohf,
            ri,
            kptrs,
            vptrs,
            row_seg,
            row_pos,
            seg_total,
            hi,
            kvh_i,
            scale,
            rot,
            cos,
            sin,
            half,
            table_positions,
            bias,
            bias_mode,
            bias_shared,
            held,
            err,
            k,
            kd,
            v,
            vd,
            round16,
            fused
        )?;
        let shape: Shape = match spec.out_layout {
            Layout::HeadsFirst => [1, heads, rows, hd].into_iter().collect(),
            Layout::SeqFirst => [1, rows, heads * hd].into_iter().collect(),
        };
        if qtype == DType::F16 {
            // Rounded back to the query's type, as native-cpu does.
            let (code, n, round) = (9i32, (rows * heads * hd) as i32, 1i32);
            launch!(dev, "unary", grid(rows * heads * hd, 256), code, y, y, n, round)?;
        }
        self.put(out, shape, qtype, buf);
        Ok(())
    }

    /// The logits projection on each sequence's last row only.
    pub(super) fn head_rows(
        &mut self,
        index: usize,
        x: Ref,
        out: usize,
        segments: &[Segment],
    ) -> Result<(), CudaError> {
        let (xp, shape, _) = self.device_input(x)?;
        let proj = self.projections[index].as_ref().ok_or_else(|| unsupported("projection not uploaded"))?;
        let (k, n) = (proj.k, proj.n);
        if shape.last() != Some(&k) {
            return Err(unsupported(format!("input {shape:?} does not end in the weight's {k} inputs")));
        }
        let dev = self.device.clone();
        let last: Vec<i32> = segments.iter().map(|s| (s.start + s.len - 1) as i32).collect();
        let idx = grown(&dev, &mut self.picked_rows, last.len() * 4)?.ptr();
        dev.write(idx, &last)?;
        let picked = grown(&dev, &mut self.picked, last.len() * k * 4)?.ptr();
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (last.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let ki = k as i32;
        launch!(dev, "select_rows", cfg, xp, idx, picked, ki)?;
        let buf = self.out_buf(out, last.len() * n * 4)?;
        let proj = self.projections[index].as_ref().ok_or_else(|| unsupported("projection not uploaded"))?;
        proj.run(&dev, picked, last.len(), buf.ptr(), &mut self.scratch)?;
        self.put(out, [1, last.len(), n].into_iter().collect(), DType::F32, buf);
        Ok(())
    }
}

//! The portable tile kernels: plain Rust over the tiled layouts, run on
//! every machine, and the reference the vector paths are tested against.

use std::ops::Range;

use super::tiled::{lane_f32, Rows};
use super::weights::{q4_scale_aux, TileData, Tiled, Q8_RECORD_LINES, QBLOCK, TILE};
use crate::pool::Disjoint;

/// `y[r * t.n + c]` for every input row `r` and every output `c` of the
/// tiles `tiles`.
pub fn tiles(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>) {
    let bytes = t.as_bytes();
    for tile in tiles {
        let (start, stride) = t.place(tile);
        let base = &bytes[start..];
        for r in 0..rows.m {
            let mut acc = [0f32; TILE];
            match t.data {
                TileData::F32 => {
                    let x = &rows.x[r * rows.kp..r * rows.kp + t.k];
                    for (c, xv) in x.iter().enumerate() {
                        for (lane, a) in acc.iter_mut().enumerate() {
                            *a += lane_f32(base, c * stride + lane * 4) * xv;
                        }
                    }
                }
                TileData::F16 => {
                    let x = &rows.x[r * rows.kp..r * rows.kp + t.k];
                    for (c, xv) in x.iter().enumerate() {
                        let line = (c / 2) * stride + (c % 2) * 32;
                        for (lane, a) in acc.iter_mut().enumerate() {
                            let at = line + lane * 2;
                            *a += half::f16::from_le_bytes([base[at], base[at + 1]]).to_f32() * xv;
                        }
                    }
                }
                TileData::Q8 { blocks, rounds_to_f16 } => {
                    let x = &rows.x[r * rows.kp..(r + 1) * rows.kp];
                    for b in 0..blocks {
                        let rec = &base[b * stride..b * stride + Q8_RECORD_LINES * 64];
                        for (lane, a) in acc.iter_mut().enumerate() {
                            let scale = lane_f32(rec, 512 + lane * 4);
                            for (j, xv) in x[b * QBLOCK..(b + 1) * QBLOCK].iter().enumerate() {
                                *a += super::weights::q8_weight(rec[16 * j + lane] as i8, scale, rounds_to_f16) * xv;
                            }
                        }
                    }
                }
                TileData::Q4 { blocks, int8: false, symmetric, half, rounds_to_f16, .. } => {
                    let x = &rows.x[r * rows.kp..(r + 1) * rows.kp];
                    for b in 0..blocks {
                        let rec = &base[b * stride..];
                        let xb = &x[b * QBLOCK..(b + 1) * QBLOCK];
                        for (lane, a) in acc.iter_mut().enumerate() {
                            let (scale, aux) = q4_scale_aux(rec, lane, false, symmetric, half);
                            for (j, xv) in xb.iter().enumerate() {
                                let byte = rec[(j / 8) * 64 + lane * 4 + (j % 8) % 4];
                                let q = if j % 8 < 4 { byte & 0x0f } else { byte >> 4 };
                                *a += super::weights::q4_weight(f32::from(q), scale, aux, rounds_to_f16) * xv;
                            }
                        }
                    }
                }
                TileData::Q4 { blocks, int8: true, x_block, symmetric, .. } => {
                    // One integer sum per quantization block (a block larger
                    // than 32 spans several records), scaled once.
                    let sub = (x_block / QBLOCK).max(1);
                    let xq = &rows.q[r * rows.kp..(r + 1) * rows.kp];
                    for g in 0..blocks / sub {
                        let first = &base[g * sub * stride..];
                        let sx = rows.qscale[r * blocks + g * sub];
                        let qsum: i32 = rows.qsum[r * blocks + g * sub..r * blocks + (g + 1) * sub].iter().sum();
                        for (lane, a) in acc.iter_mut().enumerate() {
                            let (scale, zero) = q4_scale_aux(first, lane, true, symmetric, false);
                            let mut sum = 0i32;
                            for s in 0..sub {
                                let b = g * sub + s;
                                let rec = &base[b * stride..];
                                for (j, xv) in xq[b * QBLOCK..(b + 1) * QBLOCK].iter().enumerate() {
                                    let byte = rec[(j / 8) * 64 + lane * 4 + (j % 8) % 4];
                                    let q = if j % 8 < 4 { byte & 0x0f } else { byte >> 4 };
                                    sum += i32::from(q) * i32::from(*xv);
                                }
                            }
                            // Exact: both sides are integers below 2^24.
                            let exact = sum as f32 - zero * qsum as f32;
                            *a = exact.mul_add(scale * sx, *a);
                        }
                    }
                }
            }
            let first = tile * TILE;
            let width = TILE.min(t.n - first);
            // SAFETY: outputs `first..first + width` of row `r` belong to
            // this tile, which one thread computes.
            unsafe { y.slice(r * t.n + first, width) }.copy_from_slice(&acc[..width]);
        }
    }
}

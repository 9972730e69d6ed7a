//! Rotary position embedding in the rotate-half form
//! (`x * cos + rotate_half(x) * sin`, `rotate_half([a, b]) = [-b, a]`).

use super::attention::Layout;
use crate::value::Value;

/// Where cos/sin come from.
pub enum Angles<'a> {
    /// Full-width `[seq, head_dim]` tables already gathered per position
    /// (the decomposed export computes these with `Gather`).
    Gathered { cos: &'a [f32], sin: &'a [f32] },
    /// Half-width `[max_positions, head_dim / 2]` caches indexed by position
    /// (ONNX `RotaryEmbedding`, com.microsoft `RotaryEmbedding`).
    Cached { cos: &'a [f32], sin: &'a [f32], positions: &'a [i64] },
}

/// Rotates every `[head_dim]` row of `x` (laid out as `layout`; cached
/// angles take one position per batch row and token, or a start position);
/// the head count follows from the shape and `head_dim`.
pub fn rotary(x: &Value, head_dim: usize, layout: Layout, angles: &Angles, out: &mut Value) -> Result<(), String> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(format!("rotary head_dim {head_dim} must be even and positive"));
    }
    let heads = match (layout, x.shape.as_slice()) {
        (Layout::HeadsFirst, [_, h, _, _]) | (Layout::SeqFirst, [_, _, h, _]) => *h,
        (Layout::SeqFirst, [_, _, hidden]) if hidden % head_dim == 0 => hidden / head_dim,
        _ => return Err(format!("input {:?} does not fit {layout:?} rows of {head_dim}", x.shape)),
    };
    let batch = x.shape.first().copied().unwrap_or(1);
    let mut per_row = x.shape.clone();
    if let Some(b) = per_row.first_mut() {
        *b = 1;
    }
    let seq = layout.seq_len(&per_row, heads, head_dim)?;
    let half = head_dim / 2;
    let xs = x.as_f32()?;
    match angles {
        Angles::Gathered { .. } if batch != 1 => {
            return Err(format!("gathered cos/sin tables rotate batch 1, the input is {:?}", x.shape));
        }
        Angles::Gathered { cos, sin } if cos.len() != seq * head_dim || sin.len() != seq * head_dim => {
            return Err(format!(
                "cos/sin hold {} values, {seq} positions x {head_dim} need {}",
                cos.len(),
                seq * head_dim
            ));
        }
        Angles::Cached { positions, .. } if positions.len() != batch * seq && positions.len() != 1 => {
            return Err(format!("{} position ids for {batch} x {seq} positions", positions.len()));
        }
        _ => {}
    }
    let mut o = out.recycle_f32(xs.len());
    for (b, h, t) in (0..batch).flat_map(|b| (0..heads).flat_map(move |h| (0..seq).map(move |t| (b, h, t)))) {
        {
            let at = b * heads * seq * head_dim
                + match layout {
                    Layout::HeadsFirst => (h * seq + t) * head_dim,
                    Layout::SeqFirst => (t * heads + h) * head_dim,
                };
            let row = &xs[at..at + head_dim];
            let dst = &mut o[at..at + head_dim];
            let (cos, sin, stride) = match angles {
                Angles::Gathered { cos, sin } => (&cos[t * head_dim..], &sin[t * head_dim..], 1),
                Angles::Cached { cos, sin, positions } => {
                    let pos = if positions.len() == 1 {
                        positions[0]
                            .checked_add(t as i64)
                            .ok_or_else(|| format!("position id {} overflows", positions[0]))?
                    } else {
                        positions[b * seq + t]
                    };
                    let p = usize::try_from(pos).map_err(|_| format!("negative position id {pos}"))?;
                    // (Checked: a position near 2^63 wrapped the product to
                    // a small number that passed, and sliced out of range.)
                    let end = p.checked_add(1).and_then(|e| e.checked_mul(half)).unwrap_or(usize::MAX);
                    if end > cos.len() || end > sin.len() {
                        return Err(format!(
                            "position {p} is beyond the rotary cache ({} positions)",
                            cos.len() / half.max(1)
                        ));
                    }
                    (&cos[p * half..], &sin[p * half..], 0)
                }
            };
            for i in 0..half {
                // Gathered tables repeat the half-width angles over both
                // halves; cached tables store them once.
                let (c1, s1) = (cos[i], sin[i]);
                let (c2, s2) = if stride == 1 { (cos[i + half], sin[i + half]) } else { (c1, s1) };
                dst[i] = row[i] * c1 - row[i + half] * s1;
                dst[i + half] = row[i + half] * c2 + row[i] * s2;
            }
        }
    }
    *out = Value::f32(x.shape.clone(), o);
    Ok(())
}

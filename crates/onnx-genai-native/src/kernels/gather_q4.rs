//! com.microsoft `GatherBlockQuantized` with 4-bit rows: the embedding
//! lookup of a table shared with a `MatMulNBits` output projection. Only
//! the gathered rows are dequantized, so the table stays 4-bit in memory.

use crate::value::Value;

/// Gathers rows `indices` of `data` (`[rows, cols / 2]` bytes, element `2i`
/// in the low nibble of byte `i`) and dequantizes them with one scale per
/// row and `block` columns, and a zero point from `zeros` (`[rows,
/// ceil(blocks / 2)]` bytes, two per byte) or 8. The output is `indices`'
/// shape plus `[cols]`.
pub fn gather_q4(
    data: &Value,
    indices: &Value,
    scales: &Value,
    zeros: Option<&Value>,
    block: usize,
    out: &mut Value,
) -> Result<(), String> {
    let (&[rows, bytes], &[srows, blocks]) = (data.shape.as_slice(), scales.shape.as_slice()) else {
        return Err(format!("data {:?} and scales {:?} must be 2-D", data.shape, scales.shape));
    };
    let cols = bytes * 2;
    if block == 0 || srows != rows || blocks != cols.div_ceil(block) {
        return Err(format!(
            "scales {:?} do not give data {:?} one scale per {block} columns",
            scales.shape, data.shape
        ));
    }
    let zero_bytes = blocks.div_ceil(2);
    let zeros = match zeros {
        Some(z) if z.shape[..] != [rows, zero_bytes] => {
            return Err(format!("zero points {:?} are not [{rows}, {zero_bytes}]", z.shape));
        }
        Some(z) => Some(z.as_u8()?),
        None => None,
    };
    let (data, scales, ids) = (data.as_u8()?, scales.as_f32()?, indices.as_i64()?);
    // Every index checked, and the output sized, before it is allocated.
    let rows_of: Vec<usize> = ids
        .iter()
        .map(|&id| {
            usize::try_from(id).ok().filter(|r| *r < rows).ok_or_else(|| format!("index {id} is outside 0..{rows}"))
        })
        .collect::<Result<_, _>>()?;
    let mut o = out.recycle_f32(super::layout::checked_elements(&[ids.len(), cols])?);
    // (Rows of no columns have nothing to write: `chunks_exact_mut(0)`
    // panics.)
    for (dst, &row) in o.chunks_exact_mut(cols.max(1)).zip(&rows_of) {
        let packed = &data[row * bytes..(row + 1) * bytes];
        for (c, d) in dst.iter_mut().enumerate() {
            let b = c / block;
            let zero = super::weights::zero_point(zeros, row, blocks, b);
            let q = (packed[c / 2] >> (4 * (c % 2))) & 0x0f;
            *d = (f32::from(q) - f32::from(zero)) * scales[row * blocks + b];
        }
    }
    let mut shape = indices.shape.clone();
    shape.push(cols);
    *out = Value::f32(shape, o);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Indices are checked before the output is sized: a table of no rows
    /// and 2^32 columns (no bytes) gathered at index 0 is an error, not a
    /// 16 GiB output filled before the first index was looked at.
    #[test]
    fn a_bad_index_into_a_wide_empty_table_allocates_nothing() {
        let data = Value::u8(vec![0, 1 << 31], vec![]);
        let scales = Value::f32(vec![0, 1 << 16], vec![]);
        let ids = Value::i64(vec![1, 1], vec![0]);
        let mut out = Value::default();
        let err = gather_q4(&data, &ids, &scales, None, 1 << 16, &mut out).unwrap_err();
        assert!(err.contains("outside 0..0"), "{err}");
    }

    /// Low nibble first, per-block scales and zero points, default zero point 8.
    #[test]
    fn dequantizes_gathered_rows() {
        // 2 rows x 4 columns, blocks of 2: row 1 = nibbles [1, 2, 15, 0].
        let data = Value::u8(vec![2, 2], vec![0x00, 0x00, 0x21, 0x0f]);
        let scales = Value::f32(vec![2, 2], vec![1.0, 1.0, 0.5, 2.0]);
        let zeros = Value::u8(vec![2, 1], vec![0x00, 0x31]);
        let ids = Value::i64(vec![1, 1], vec![1]);
        let mut out = Value::default();
        gather_q4(&data, &ids, &scales, Some(&zeros), 2, &mut out).unwrap();
        assert_eq!(out.shape[..], [1, 1, 4]);
        assert_eq!(out.as_f32().unwrap(), &[0.0, 0.5, 24.0, -6.0]);
        gather_q4(&data, &ids, &scales, None, 2, &mut out).unwrap();
        assert_eq!(out.as_f32().unwrap(), &[-3.5, -3.0, 14.0, -16.0]);
        let bad = Value::i64(vec![1], vec![2]);
        assert!(gather_q4(&data, &bad, &scales, None, 2, &mut out).unwrap_err().contains("outside"));
    }
}

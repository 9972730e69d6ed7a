//! GGML tensor types and their dequantization. Quantized types store
//! blocks of 32 values: `Q8_0` (f16 scale `d`, 32 × i8: `d·q`), `Q4_0`
//! (`d`, 16 bytes of nibbles: `d·(q − 8)`), `Q4_1` (`d`, f16 minimum `m`,
//! nibbles: `d·q + m`); in a nibble block the low nibbles hold values 0–15
//! and the high nibbles values 16–31.

use half::{bf16, f16};

pub const BLOCK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl TensorType {
    pub const SUPPORTED: &'static str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1";

    pub fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// The GGML name of a type code, supported or not (for errors).
    pub fn code_name(code: u32) -> String {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
            "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
        ];
        NAMES.get(code as usize).map_or_else(|| format!("ggml type {code}"), |n| format!("{n} (ggml type {code})"))
    }

    /// `(values per block, bytes per block)`.
    pub fn block(self) -> (u64, u64) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
    }

    /// Bytes holding `elements` values; `None` unless whole blocks, or when
    /// the count does not fit a u64 (a crafted header's dimensions).
    pub fn bytes_for(self, elements: u64) -> Option<u64> {
        let (per, bytes) = self.block();
        if !elements.is_multiple_of(per) {
            return None;
        }
        (elements / per).checked_mul(bytes)
    }
}

fn half_at(raw: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([raw[at], raw[at + 1]]).to_f32()
}

/// Values of `raw` (whole blocks of `ty`, as checked when the file was
/// parsed).
pub fn dequantize(ty: TensorType, raw: &[u8]) -> Vec<f32> {
    let (_, block_bytes) = ty.block();
    match ty {
        TensorType::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        TensorType::F16 => raw.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        TensorType::BF16 => raw.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        TensorType::Q8_0 => raw
            .chunks_exact(block_bytes as usize)
            .flat_map(|b| {
                let d = half_at(b, 0);
                b[2..].iter().map(move |q| d * f32::from(*q as i8))
            })
            .collect(),
        TensorType::Q4_0 => nibbles(raw, block_bytes as usize, 2, |b, q| half_at(b, 0) * (f32::from(q) - 8.0)),
        TensorType::Q4_1 => nibbles(raw, block_bytes as usize, 4, |b, q| half_at(b, 0) * f32::from(q) + half_at(b, 2)),
    }
}

/// 4-bit blocks: a header of `header` bytes, then 16 bytes whose low
/// nibbles are values 0..16 and high nibbles values 16..32.
fn nibbles(raw: &[u8], block_bytes: usize, header: usize, value: impl Fn(&[u8], u8) -> f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(raw.len() / block_bytes * BLOCK);
    for b in raw.chunks_exact(block_bytes) {
        let qs = &b[header..];
        out.extend(qs.iter().map(|q| value(b, q & 0x0F)));
        out.extend(qs.iter().map(|q| value(b, q >> 4)));
    }
    out
}

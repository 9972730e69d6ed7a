//! Projection weights. The compiler first holds them as output rows
//! (`[N, K]`: f32, f16, or `MatMulNBits` 4-bit blocks), the form fusion
//! stacks and the reference kernels read. A final pass repacks each into
//! [`Tiled`] form: 16 output rows per tile, laid out in the order the
//! kernels stream them (a decode projection is one sequential read of
//! exactly the stored bytes).

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::storage::Lines;

/// Output rows per tile: one 512-bit register of f32 lanes.
pub const TILE: usize = 16;

/// Inputs per 4-bit block in the tiled layout.
pub const QBLOCK: usize = 32;

#[derive(Clone, Debug)]
pub enum Packed {
    /// Rows `[N, K]`.
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// `MatMulNBits` with 4 bits: per row, `blocks` blocks of `block`
    /// elements, two per byte (low nibble first), one scale per block and an
    /// optional packed 4-bit zero point per block (8 when absent). `int8`:
    /// `accuracy_level` 4, where ONNX Runtime quantizes each input block to
    /// int8 and sums in integers ([`super::linear_int8`]). `offsets`: an
    /// additive term per row and block (`w = (q - zero) * scale + offset`,
    /// affine blocks such as GGUF's Q4_1 after fusion; f32 inputs only).
    Q4 {
        data: Vec<u8>,
        scales: Vec<f32>,
        zeros: Option<Vec<u8>>,
        offsets: Option<Vec<f32>>,
        block: usize,
        blocks: usize,
        int8: bool,
    },
    /// 8-bit blocks of 32 with one f32 scale each (`w = q * scale`, or
    /// that rounded to f16 where `rounds_to_f16`): an f32 or f16 weight
    /// that round-trips exactly ([`Weight::narrowed`]).
    Q8 {
        values: Vec<i8>,
        scales: Vec<f32>,
        blocks: usize,
        rounds_to_f16: bool,
    },
    /// Repacked for the kernels.
    Tiled(Tiled),
}

/// `a` followed by `b` when both are present.
fn join<T>(a: Option<Vec<T>>, b: Option<Vec<T>>) -> Option<Vec<T>> {
    a.zip(b).map(|(mut a, b)| {
        a.extend(b);
        a
    })
}

/// A `[N, K]` weight: output `n` reads the K inputs of row `n`.
#[derive(Clone, Debug)]
pub struct Weight {
    pub n: usize,
    pub k: usize,
    pub packed: Packed,
}

/// The `k x n` values `w` (a MatMul's `[K, N]` weight) as `n` output rows
/// of `k`; zero where `w` is short of whole input rows (a weight still has
/// its declared size).
fn output_rows<T: Copy>(w: &[T], k: usize, n: usize, zero: T) -> Vec<T> {
    let mut t = Vec::new();
    if let Some(w) = w.get(..k * n) {
        super::layout::transpose_into(w, 1, k, n, &mut t);
        return t;
    }
    t.resize(k * n, zero);
    for (ki, row) in w.chunks_exact(n.max(1)).enumerate() {
        for (ni, v) in row.iter().enumerate() {
            t[ni * k + ki] = *v;
        }
    }
    t
}

/// The 4-bit zero point of block `b` of `row`: packed two per byte, low
/// nibble first, `ceil(blocks / 2)` bytes per row (`MatMulNBits` and
/// `GatherBlockQuantized` alike); 8 when the weight has none.
pub(crate) fn zero_point(zeros: Option<&[u8]>, row: usize, blocks: usize, b: usize) -> u8 {
    match zeros {
        Some(z) => (z[row * blocks.div_ceil(2) + b / 2] >> (4 * (b % 2))) & 0x0f,
        None => 8,
    }
}

impl Weight {
    /// Packs an ONNX MatMul weight given as `[K, N]`.
    pub fn from_kn_f32(w: &[f32], k: usize, n: usize) -> Self {
        Self { n, k, packed: Packed::F32(output_rows(w, k, n, 0.0)) }
    }

    pub fn from_kn_f16(w: &[f16], k: usize, n: usize) -> Self {
        Self { n, k, packed: Packed::F16(output_rows(w, k, n, f16::ZERO)) }
    }

    /// Stacks weights with the same K and storage: outputs of `a` come
    /// first.
    pub fn stack(a: Weight, b: Weight) -> Result<Self, String> {
        if a.k != b.k {
            return Err(format!("cannot stack weights with K {} and {}", a.k, b.k));
        }
        let packed = match (a.packed, b.packed) {
            (Packed::F32(mut x), Packed::F32(y)) => {
                x.extend(y);
                Packed::F32(x)
            }
            (Packed::F16(mut x), Packed::F16(y)) => {
                x.extend(y);
                Packed::F16(x)
            }
            (
                Packed::Q4 { data: mut d1, scales: mut s1, zeros: z1, offsets: o1, block, blocks, int8 },
                Packed::Q4 {
                    data: d2,
                    scales: s2,
                    zeros: z2,
                    offsets: o2,
                    block: block2,
                    blocks: blocks2,
                    int8: int8b,
                },
            ) if block == block2
                && blocks == blocks2
                && z1.is_some() == z2.is_some()
                && o1.is_some() == o2.is_some()
                && int8 == int8b =>
            {
                d1.extend(d2);
                s1.extend(s2);
                let zeros = join(z1, z2);
                let offsets = join(o1, o2);
                Packed::Q4 { data: d1, scales: s1, zeros, offsets, block, blocks, int8 }
            }
            _ => return Err("cannot stack weights of different storage".into()),
        };
        Ok(Self { n: a.n + b.n, k: a.k, packed })
    }

    /// Whether the products take int8 inputs (`accuracy_level` 4).
    pub fn int8_inputs(&self) -> bool {
        match &self.packed {
            Packed::Q4 { int8, .. } => *int8,
            Packed::Tiled(t) => matches!(t.data, TileData::Q4 { int8: true, .. }),
            _ => false,
        }
    }

    /// The storage and, for a weight narrowed losslessly, the arithmetic
    /// it reproduces: `q4`, or `f16 as q4` (an f16 weight stored as 4-bit
    /// blocks, computing the f16 weight's results bit for bit). What a
    /// plan's step names show, and what a tolerance tier is chosen by.
    pub fn label(&self) -> String {
        let stored = self.kind();
        match self.narrowed_from() {
            Some(origin) => format!("{origin} as {stored}"),
            None => stored.to_string(),
        }
    }

    /// The form a weight narrowed by [`Weight::narrowed`] into 8-bit or
    /// affine 4-bit blocks came from (`f32` or `f16`); `None` otherwise.
    fn narrowed_from(&self) -> Option<&'static str> {
        let to_f16 = match &self.packed {
            Packed::Q8 { rounds_to_f16, .. } => *rounds_to_f16,
            Packed::Tiled(t) => match t.data {
                TileData::Q8 { rounds_to_f16, .. } => rounds_to_f16,
                TileData::Q4 { per_weight: true, rounds_to_f16, .. } => rounds_to_f16,
                _ => return None,
            },
            _ => return None,
        };
        Some(if to_f16 { "f16" } else { "f32" })
    }

    /// A short name of the storage (`f32`, `f16`, `q4`, `q4i8`).
    pub fn kind(&self) -> &'static str {
        match &self.packed {
            Packed::F32(_) => "f32",
            Packed::F16(_) => "f16",
            Packed::Q4 { int8: false, .. } => "q4",
            Packed::Q4 { int8: true, .. } => "q4i8",
            Packed::Q8 { .. } => "q8",
            Packed::Tiled(t) => match t.data {
                TileData::F32 => "f32",
                TileData::F16 => "f16",
                TileData::Q8 { .. } => "q8",
                TileData::Q4 { int8: false, .. } => "q4",
                TileData::Q4 { int8: true, .. } => "q4i8",
            },
        }
    }

    /// Row `r` dequantized to f32 (`scratch` holds it unless the row is
    /// stored as f32 rows).
    pub fn row<'a>(&'a self, r: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let k = self.k;
        match &self.packed {
            Packed::F32(w) => &w[r * k..(r + 1) * k],
            Packed::F16(w) => {
                scratch.resize(k, 0.0);
                w[r * k..(r + 1) * k].convert_to_f32_slice(scratch);
                scratch
            }
            Packed::Q4 { data, scales, zeros, offsets, block, blocks, .. } => {
                scratch.resize(k, 0.0);
                let bytes_per_block = block / 2;
                let row = &data[r * blocks * bytes_per_block..(r + 1) * blocks * bytes_per_block];
                for b in 0..*blocks {
                    let scale = scales[r * blocks + b];
                    let zero = f32::from(zero_point(zeros.as_deref(), r, *blocks, b));
                    let offset = offsets.as_ref().map_or(0.0, |o| o[r * blocks + b]);
                    let start = b * block;
                    for j in 0..(*block).min(k.saturating_sub(start)) {
                        let byte = row[b * bytes_per_block + j / 2];
                        let q = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                        scratch[start + j] = (f32::from(q) - zero) * scale + offset;
                    }
                }
                scratch
            }
            Packed::Q8 { values, scales, blocks, rounds_to_f16 } => {
                scratch.resize(k, 0.0);
                for (c, v) in scratch.iter_mut().enumerate() {
                    *v = q8_weight(values[r * k + c], scales[r * blocks + c / QBLOCK], *rounds_to_f16);
                }
                scratch
            }
            Packed::Tiled(t) => {
                scratch.resize(k, 0.0);
                t.row(r, scratch);
                scratch
            }
        }
    }

    /// Bytes the packed weight occupies.
    pub fn bytes(&self) -> usize {
        match &self.packed {
            Packed::F32(w) => w.len() * 4,
            Packed::F16(w) => w.len() * 2,
            Packed::Q4 { data, scales, zeros, offsets, .. } => {
                data.len()
                    + scales.len() * 4
                    + zeros.as_ref().map_or(0, Vec::len)
                    + offsets.as_ref().map_or(0, |o| o.len() * 4)
            }
            Packed::Q8 { values, scales, .. } => values.len() + scales.len() * 4,
            Packed::Tiled(t) => t.bytes(),
        }
    }

    /// This weight in the kernels' tiled layout, or itself when it has no
    /// tiled form (4-bit blocks that are not whole multiples of 32).
    pub fn into_tiled(self) -> Self {
        if matches!(self.packed, Packed::Tiled(_)) {
            return self;
        }
        match Tiled::from_rows(&self) {
            Some(t) => Self { packed: Packed::Tiled(t), ..self },
            None => self,
        }
    }
}

/// One 64-byte line: the unit the tiled layouts are aligned to, so every
/// vector load of a tile stays inside one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line(pub [u8; 64]);

impl std::fmt::Debug for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Line")
    }
}

/// What a tile holds. Tiles are stored in pairs, the pair's two records of
/// each step side by side (`[pair][step][tile of the pair]`), so the kernels,
/// which work on a pair at a time, read one sequential stream; a step is an
/// input (f32), two inputs (f16) or a block of 32 (4-bit).
#[derive(Clone, Debug)]
pub enum TileData {
    /// One line of 16 f32 per input.
    F32,
    /// One line per two inputs: 16 f16 of the first, then of the second.
    F16,
    /// Per block of 32 inputs, one 6-line record: 4 lines of
    /// nibbles (line `i`, row `r`, byte `t`: input `8i + t` in the low
    /// nibble, `8i + 4 + t` in the high one — each 32-bit lane then holds
    /// four consecutive inputs of its row, as integer dot products want),
    /// a line of 16 f32 scales, and a line of 16 f32 `aux` values: for f32
    /// inputs the offset (`w = q * scale + aux`, so `aux = -zero * scale`),
    /// for int8 inputs the zero point itself. A `symmetric` weight (no zero
    /// points, no offsets: every zero point is 8) has no `aux` line — it
    /// is `-8 * scale` (f32 inputs) or 8 (int8 inputs), computed by the
    /// kernels — so its records are 5 lines: a sixth fewer bytes for every
    /// decode step to read. A `half` weight (f32 inputs, not symmetric)
    /// stores its scales and `aux` values as f16 in one line (16 scales,
    /// then 16 `aux`), also 5 lines: chosen only when every one of them
    /// round-trips through f16 exactly (GGUF's Q4_1 blocks, whose scale
    /// and minimum are f16), so the kernels compute with the same f32s.
    Q4 {
        blocks: usize,
        int8: bool,
        symmetric: bool,
        half: bool,
        /// Computed weight by weight (`q * scale + aux`, then times the
        /// input), as the f32 kernels do, never factored per block: an f32
        /// weight narrowed to this form ([`Weight::narrowed`]) then gives
        /// the f32 weight's results bit for bit.
        per_weight: bool,
        /// Each weight, once computed (`per_weight`), rounded to f16 (to
        /// nearest, ties to even) before it multiplies: an f16 weight
        /// narrowed to this form ([`Weight::narrowed`]: GGUF's Q4_1
        /// dequantized in f32, then stored as f16) then gives the f16
        /// weight's results bit for bit.
        rounds_to_f16: bool,
        /// The block the int8 inputs are quantized over (the weight's own
        /// `block`, a multiple of 32).
        x_block: usize,
    },
    /// Per block of 32 inputs, one 9-line record: 8 lines of int8 weights
    /// (input `j` of the block: the 16 rows' values at bytes `16j..16j+16`)
    /// and a line of 16 f32 scales (`w = q * scale`; where `rounds_to_f16`,
    /// that rounded to f16: an f16 weight narrowed to this form gives the
    /// f16 weight's results bit for bit).
    Q8 { blocks: usize, rounds_to_f16: bool },
}

/// A weight repacked for the kernels: output rows in tiles of [`TILE`]
/// (the last tile padded with zero rows).
#[derive(Clone, Debug)]
pub struct Tiled {
    pub n: usize,
    pub k: usize,
    /// Inputs a row of the layout spans: `k`, or whole blocks of 32.
    pub kp: usize,
    pub tiles: usize,
    pub data: TileData,
    pub lines: Lines,
}

/// Lines one Q4 `(tile, block)` record takes (with its `aux` line).
pub const Q4_RECORD_LINES: usize = 6;

/// Lines one symmetric or `half` Q4 record takes (no `aux` line of its own).
pub const Q4_SHORT_RECORD_LINES: usize = 5;

/// The scale and `aux` value of lane `lane` of a Q4 record (see
/// [`TileData::Q4`]): stored as f32 or (`half`) f16, or for a symmetric
/// weight `aux` implied by the scale.
pub fn q4_scale_aux(rec: &[u8], lane: usize, int8: bool, symmetric: bool, half: bool) -> (f32, f32) {
    let at = |o: usize| f32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
    let at16 = |o: usize| half::f16::from_le_bytes([rec[o], rec[o + 1]]).to_f32();
    if half {
        return (at16(256 + lane * 2), at16(288 + lane * 2));
    }
    let scale = at(256 + lane * 4);
    let aux = match (symmetric, int8) {
        (false, _) => at(320 + lane * 4),
        (true, true) => 8.0,
        (true, false) => -8.0 * scale,
    };
    (scale, aux)
}

/// Lines one Q8 `(tile, block)` record takes.
pub const Q8_RECORD_LINES: usize = 9;

/// Bytes of one `(tile, step)` record of each storage, and steps per tile.
fn record_and_steps(data: &TileData, k: usize) -> (usize, usize) {
    match data {
        TileData::F32 => (64, k),
        TileData::F16 => (64, k.div_ceil(2)),
        TileData::Q4 { blocks, symmetric, half, .. } => {
            (if *symmetric || *half { Q4_SHORT_RECORD_LINES } else { Q4_RECORD_LINES } * 64, *blocks)
        }
        TileData::Q8 { blocks, .. } => (Q8_RECORD_LINES * 64, *blocks),
    }
}

/// Byte offset of `tile`'s first record and the stride between its
/// consecutive records, for `tiles` tiles of `steps` records of `record`
/// bytes stored in pairs.
fn place(tile: usize, tiles: usize, steps: usize, record: usize) -> (usize, usize) {
    let (pair, j) = (tile / 2, tile % 2);
    let width = 2.min(tiles - 2 * pair);
    (pair * 2 * steps * record + j * record, width * record)
}

impl Tiled {
    /// Records (steps) per tile: a tile pair's bytes are `steps()` times
    /// its stride.
    pub fn steps(&self) -> usize {
        record_and_steps(&self.data, self.k).1
    }

    /// Where tile `tile`'s records start and the stride between them.
    pub fn place(&self, tile: usize) -> (usize, usize) {
        let (record, steps) = record_and_steps(&self.data, self.k);
        place(tile, self.tiles, steps, record)
    }

    /// Repacks row-form weights; `None` for 4-bit blocks that are not a
    /// multiple of 32 inputs.
    pub fn from_rows(w: &Weight) -> Option<Self> {
        let (n, k) = (w.n, w.k);
        let tiles = n.div_ceil(TILE);
        match &w.packed {
            Packed::F32(rows) => {
                let mut lines = vec![Line([0; 64]); tiles * k];
                for r in 0..n {
                    let (t, lane) = (r / TILE, r % TILE);
                    let (at, stride) = place(t, tiles, k, 64);
                    for (c, v) in rows[r * k..(r + 1) * k].iter().enumerate() {
                        lines[(at + c * stride) / 64].0[lane * 4..lane * 4 + 4].copy_from_slice(&v.to_le_bytes());
                    }
                }
                Some(Self { n, k, kp: k, tiles, data: TileData::F32, lines: lines.into() })
            }
            Packed::F16(rows) => {
                let steps = k.div_ceil(2);
                let mut lines = vec![Line([0; 64]); tiles * steps];
                for r in 0..n {
                    let (t, lane) = (r / TILE, r % TILE);
                    let (at, stride) = place(t, tiles, steps, 64);
                    for (c, v) in rows[r * k..(r + 1) * k].iter().enumerate() {
                        let b = (c % 2) * 32 + lane * 2;
                        lines[(at + (c / 2) * stride) / 64].0[b..b + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
                Some(Self { n, k, kp: k, tiles, data: TileData::F16, lines: lines.into() })
            }
            Packed::Q4 { data, scales, zeros, offsets, block, blocks, int8 } => {
                if *block % QBLOCK != 0 || *block == 0 || (*int8 && offsets.is_some()) {
                    return None;
                }
                let sub = block / QBLOCK;
                let qblocks = blocks * sub;
                let symmetric = zeros.is_none() && offsets.is_none();
                let aux_of = |r: usize, b: usize| {
                    let (scale, zero) =
                        (scales[r * blocks + b], f32::from(zero_point(zeros.as_deref(), r, *blocks, b)));
                    let offset = offsets.as_ref().map_or(0.0, |o| o[r * blocks + b]);
                    if *int8 {
                        zero
                    } else {
                        -zero * scale + offset
                    }
                };
                let half = !*int8
                    && !symmetric
                    && (0..n)
                        .all(|r| (0..*blocks).all(|b| f16_exact(scales[r * blocks + b]) && f16_exact(aux_of(r, b))));
                let record = if symmetric || half { Q4_SHORT_RECORD_LINES } else { Q4_RECORD_LINES };
                let mut lines = vec![Line([0; 64]); tiles * qblocks * record];
                let bytes_per_block = block / 2;
                for r in 0..n {
                    let (t, lane) = (r / TILE, r % TILE);
                    let (at, stride) = place(t, tiles, qblocks, record * 64);
                    let row = &data[r * blocks * bytes_per_block..(r + 1) * blocks * bytes_per_block];
                    for qb in 0..qblocks {
                        let (b, part) = (qb / sub, qb % sub);
                        let rec = (at + qb * stride) / 64;
                        let nib = |j: usize| {
                            let at = part * QBLOCK + j;
                            let byte = row[b * bytes_per_block + at / 2];
                            if at.is_multiple_of(2) {
                                byte & 0x0f
                            } else {
                                byte >> 4
                            }
                        };
                        for i in 0..4 {
                            for tb in 0..4 {
                                let v = nib(8 * i + tb) | (nib(8 * i + 4 + tb) << 4);
                                lines[rec + i].0[lane * 4 + tb] = v;
                            }
                        }
                        let (scale, aux) = (scales[r * blocks + b], aux_of(r, b));
                        if half {
                            let line = &mut lines[rec + 4].0;
                            line[lane * 2..lane * 2 + 2].copy_from_slice(&half::f16::from_f32(scale).to_le_bytes());
                            line[32 + lane * 2..32 + lane * 2 + 2]
                                .copy_from_slice(&half::f16::from_f32(aux).to_le_bytes());
                            continue;
                        }
                        lines[rec + 4].0[lane * 4..lane * 4 + 4].copy_from_slice(&scale.to_le_bytes());
                        if !symmetric {
                            lines[rec + 5].0[lane * 4..lane * 4 + 4].copy_from_slice(&aux.to_le_bytes());
                        }
                    }
                }
                let data = TileData::Q4 {
                    blocks: qblocks,
                    int8: *int8,
                    symmetric,
                    half,
                    per_weight: false,
                    rounds_to_f16: false,
                    x_block: *block,
                };
                Some(Self { n, k, kp: qblocks * QBLOCK, tiles, data, lines: lines.into() })
            }
            Packed::Q8 { values, scales, blocks, rounds_to_f16 } => {
                let mut lines = vec![Line([0; 64]); tiles * blocks * Q8_RECORD_LINES];
                for r in 0..n {
                    let (t, lane) = (r / TILE, r % TILE);
                    let (at, stride) = place(t, tiles, *blocks, Q8_RECORD_LINES * 64);
                    for b in 0..*blocks {
                        let rec = (at + b * stride) / 64;
                        for j in 0..QBLOCK.min(k - b * QBLOCK) {
                            let byte = 16 * j + lane;
                            lines[rec + byte / 64].0[byte % 64] = values[r * k + b * QBLOCK + j] as u8;
                        }
                        let scale = scales[r * blocks + b];
                        lines[rec + 8].0[lane * 4..lane * 4 + 4].copy_from_slice(&scale.to_le_bytes());
                    }
                }
                let data = TileData::Q8 { blocks: *blocks, rounds_to_f16: *rounds_to_f16 };
                Some(Self { n, k, kp: blocks * QBLOCK, tiles, data, lines: lines.into() })
            }
            Packed::Tiled(t) => Some(t.clone()),
        }
    }

    /// Bytes of the layout.
    pub fn bytes(&self) -> usize {
        self.lines.len() * 64
    }

    /// The raw bytes of the layout (the kernels read through typed
    /// pointers into it).
    pub fn as_bytes(&self) -> &[u8] {
        let lines = self.lines.as_slice();
        // SAFETY: `Line` is `repr(C)` of 64 bytes with no padding, so the
        // lines are one contiguous, initialized byte run.
        unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), lines.len() * 64) }
    }

    /// Row `r` dequantized into `out` (`k` values): what every kernel must
    /// compute with.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let (t, lane) = (r / TILE, r % TILE);
        let (start, stride) = self.place(t);
        let base = &self.as_bytes()[start..];
        let f32_at = |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        match self.data {
            TileData::F32 => {
                for (c, o) in out.iter_mut().enumerate().take(self.k) {
                    *o = f32_at(base, c * stride + lane * 4);
                }
            }
            TileData::F16 => {
                for (c, o) in out.iter_mut().enumerate().take(self.k) {
                    let at = (c / 2) * stride + (c % 2) * 32 + lane * 2;
                    *o = f16::from_le_bytes([base[at], base[at + 1]]).to_f32();
                }
            }
            TileData::Q8 { blocks, rounds_to_f16 } => {
                for b in 0..blocks {
                    let rec = &base[b * stride..b * stride + Q8_RECORD_LINES * 64];
                    let scale = f32_at(rec, 512 + lane * 4);
                    for j in 0..QBLOCK.min(self.k.saturating_sub(b * QBLOCK)) {
                        out[b * QBLOCK + j] = q8_weight(rec[16 * j + lane] as i8, scale, rounds_to_f16);
                    }
                }
            }
            TileData::Q4 { blocks, int8, symmetric, half, rounds_to_f16, .. } => {
                for b in 0..blocks {
                    let rec = &base[b * stride..];
                    let (scale, aux) = q4_scale_aux(rec, lane, int8, symmetric, half);
                    for j in 0..QBLOCK {
                        let c = b * QBLOCK + j;
                        if c >= self.k {
                            break;
                        }
                        let (i, within) = (j / 8, j % 8);
                        let byte = rec[i * 64 + lane * 4 + within % 4];
                        let q = f32::from(if within < 4 { byte & 0x0f } else { byte >> 4 });
                        out[c] = if int8 { (q - aux) * scale } else { q4_weight(q, scale, aux, rounds_to_f16) };
                    }
                }
            }
        }
    }
}

/// An 8-bit weight's value: `q * scale`, rounded to f16 where the weight
/// was narrowed from f16 (the portable kernel computes the same).
pub(crate) fn q8_weight(q: i8, scale: f32, rounds_to_f16: bool) -> f32 {
    as_stored(f32::from(q) * scale, rounds_to_f16)
}

/// An f32-input 4-bit weight's value: `q * scale + aux` (one rounding:
/// the product is exact), rounded to f16 where the weight was narrowed
/// from f16 (the portable kernel computes the same).
pub(crate) fn q4_weight(q: f32, scale: f32, aux: f32, rounds_to_f16: bool) -> f32 {
    as_stored(q * scale + aux, rounds_to_f16)
}

/// `w`, or (`rounds_to_f16`) `w` rounded to f16 as an f16 export stored it.
fn as_stored(w: f32, rounds_to_f16: bool) -> f32 {
    if rounds_to_f16 {
        f16::from_f32(w).to_f32()
    } else {
        w
    }
}

/// Whether `v` is an f16 value: its round trip through f16 gives the same
/// bits (so NaN and infinities never count, nor a value f16 rounds).
pub(crate) fn f16_exact(v: f32) -> bool {
    v.is_finite() && f16::from_f32(v).to_f32().to_bits() == v.to_bits()
}

/// A 4-bit weight with offsets as GGUF's Q4_1 blocks give (tests):
/// scales and offsets on a grid of 1/64 (f16-exact, and so is every `aux`
/// with or without zero points) when `f16_exact`, else offsets nudged off
/// every f16.
#[cfg(test)]
pub(crate) fn affine_q4(n: usize, k: usize, zeros: bool, f16_exact: bool) -> Weight {
    let blocks = k.div_ceil(QBLOCK);
    let data: Vec<u8> = (0..n * blocks * QBLOCK / 2).map(|i| (i * 53 % 256) as u8).collect();
    let scales: Vec<f32> = (0..n * blocks).map(|i| (i % 5 + 1) as f32 / 64.0).collect();
    let nudge = if f16_exact { 0.0 } else { 1e-6 };
    let offsets: Vec<f32> = (0..n * blocks).map(|i| -((i % 9) as f32) / 64.0 + nudge).collect();
    let zeros = zeros.then(|| (0..n * blocks.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect());
    let packed = Packed::Q4 { data, scales, zeros, offsets: Some(offsets), block: QBLOCK, blocks, int8: false };
    Weight { n, k, packed }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4(n: usize, k: usize, block: usize, zeros: bool, int8: bool) -> Weight {
        let blocks = k.div_ceil(block);
        let data: Vec<u8> = (0..n * blocks * block / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * blocks).map(|i| 0.01 * (i % 7 + 1) as f32).collect();
        let zeros = zeros.then(|| (0..n * blocks.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect());
        Weight { n, k, packed: Packed::Q4 { data, scales, zeros, offsets: None, block, blocks, int8 } }
    }

    /// Tiling keeps every row's values: f32 and f16 exactly, 4-bit within
    /// the f32 rounding of `q * scale + aux` (equal for int8 inputs, which
    /// keep the zero point itself), for partial tiles, partial last
    /// blocks, zero points and blocks larger than 32.
    #[test]
    fn tiled_rows_equal_the_row_form() {
        let (n, k) = (37, 72);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1).collect();
        let halves: Vec<f16> = w.iter().map(|v| f16::from_f32(*v)).collect();
        // An 8-bit grid as GGUF's Q8_0 dequantizes: each block's largest
        // magnitude is 127 steps.
        let q8: Vec<f32> =
            (0..n * k).map(|i| if i % k % 32 == 0 { 127.0 } else { (i * 17 % 255) as f32 - 127.0 } * 0.0625).collect();
        let narrowed = Weight { n, k, packed: Packed::F32(q8) }.narrowed();
        assert_eq!(narrowed.kind(), "q8", "multiples of max/127 narrow");
        let mut cases = vec![
            narrowed,
            Weight { n, k, packed: Packed::F32(w.clone()) },
            Weight { n, k, packed: Packed::F16(halves) },
            q4(n, 64, 32, false, false),
            q4(n, 64, 32, true, false),
            q4(n, 72, 32, true, true),
            q4(n, 72, 32, false, true),
            q4(n, 128, 64, true, false),
            affine_q4(n, 72, false, true),
            affine_q4(n, 72, true, true),
            affine_q4(n, 72, true, false),
        ];
        for w in cases.drain(..) {
            let t = Tiled::from_rows(&w).expect("tileable");
            assert_eq!(t.tiles, n.div_ceil(TILE));
            let (mut a, mut b) = (Vec::new(), vec![0.0; w.k]);
            for r in 0..n {
                let want = w.row(r, &mut a).to_vec();
                t.row(r, &mut b);
                for (c, (x, y)) in want.iter().zip(&b).enumerate() {
                    assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{} row {r} col {c}: {x} vs {y}", w.kind());
                }
            }
        }
        assert!(Tiled::from_rows(&q4(4, 32, 16, false, false)).is_none(), "blocks of 16 keep the row form");
        // Without zero points every `aux` is implied by its scale: the
        // records drop that line (5 of 64 bytes per 32 inputs of 16 rows,
        // against 6 with zero points), for f32 and int8 inputs alike.
        for int8 in [false, true] {
            let (with, without) = (q4(n, 64, 32, true, int8), q4(n, 64, 32, false, int8));
            let bytes = |w: &Weight| Tiled::from_rows(w).expect("tileable").bytes();
            assert_eq!(bytes(&with), n.div_ceil(TILE) * 2 * Q4_RECORD_LINES * 64);
            assert_eq!(bytes(&without), n.div_ceil(TILE) * 2 * Q4_SHORT_RECORD_LINES * 64);
        }
        // Scales and `aux` that are all f16 go in one f16 line (5 lines, as
        // symmetric records); a single one off the f16 grid keeps f32 lines.
        for zeros in [false, true] {
            let half = Tiled::from_rows(&affine_q4(n, 64, zeros, true)).expect("tileable");
            assert!(matches!(half.data, TileData::Q4 { half: true, .. }), "f16-exact sides are stored as f16");
            assert_eq!(half.bytes(), n.div_ceil(TILE) * 2 * Q4_SHORT_RECORD_LINES * 64);
            let full = Tiled::from_rows(&affine_q4(n, 64, zeros, false)).expect("tileable");
            assert!(matches!(full.data, TileData::Q4 { half: false, .. }), "inexact sides stay f32");
            assert_eq!(full.bytes(), n.div_ceil(TILE) * 2 * Q4_RECORD_LINES * 64);
        }
        // One value off the grid keeps the whole weight f32.
        let mut off: Vec<f32> = (0..64).map(|i| i as f32 - 32.0).collect();
        off[5] += 0.001;
        assert_eq!(Weight { n: 2, k: 32, packed: Packed::F32(off) }.narrowed().kind(), "f32");
    }
}

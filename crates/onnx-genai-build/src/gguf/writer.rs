//! Writes GGUF v3 files byte by byte, the way the format describes them:
//! the reader's tests and the fuzzing seeds are made with it.

/// Writes a GGUF v3 file the way the format describes it.
#[derive(Default)]
pub struct Writer {
    kvs: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

/// A GGUF string: its length (u64) then its bytes.
pub fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

impl Writer {
    pub fn kv(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kvs.push((key.into(), ty, payload));
        self
    }

    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv(key, 8, string(v))
    }

    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv(key, 4, v.to_le_bytes().to_vec())
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    /// An array of strings (value type 9 of element type 8).
    pub fn strings(&mut self, key: &str, items: &[&str]) -> &mut Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| p.extend(string(s)));
        self.kv(key, 9, p)
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, ty, payload) in &self.kvs {
            b.extend(string(k));
            b.extend(ty.to_le_bytes());
            b.extend(payload);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            b.extend(string(name));
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(32) * 32;
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        let start = b.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off as usize, 0);
            b.extend(data);
        }
        b
    }
}

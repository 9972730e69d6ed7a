//! A package directory from bytes: the input is a list of files, each
//! `@@ <name>` on a line of its own followed by the file's bytes up to the
//! next such line. Names are plain file names (letters, digits, `.`, `_`,
//! `-`; not starting with a dot), so nothing is written outside the
//! scratch package directory; others are skipped.

use onnx_genai_package::Package;

use crate::fixture;

/// The marker that starts a file (at the start of the input or a line).
pub(crate) const MARK: &[u8] = b"@@ ";

/// The files in `data`: (name, bytes).
pub(crate) fn files(data: &[u8]) -> Vec<(String, &[u8])> {
    let mut starts: Vec<usize> = Vec::new();
    if data.starts_with(MARK) {
        starts.push(0);
    }
    for i in 0..data.len() {
        if data[i] == b'\n' && data[i + 1..].starts_with(MARK) {
            starts.push(i + 1);
        }
    }
    let mut out = Vec::new();
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(data.len(), |next| next - 1);
        let section = &data[start + MARK.len()..end.max(start + MARK.len())];
        let (name, body) = match section.iter().position(|b| *b == b'\n') {
            Some(nl) => (&section[..nl], &section[nl + 1..]),
            None => (section, &section[section.len()..]),
        };
        let Ok(name) = std::str::from_utf8(name) else { continue };
        let plain = !name.is_empty()
            && name.len() <= 64
            && !name.starts_with('.')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if plain {
            out.push((name.to_string(), body));
        }
    }
    out
}

/// The bytes a directory's files make, the inverse of [`files`].
pub(crate) fn join(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (name, body)) in files.iter().enumerate() {
        if i > 0 {
            out.push(b'\n');
        }
        out.extend_from_slice(MARK);
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
        out.extend_from_slice(body);
    }
    out
}

pub(crate) fn run(data: &[u8]) -> Result<(), String> {
    let dir = fixture::scratch().join("package");
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("fuzz scratch: cannot create {}: {e}", dir.display());
    }
    for (name, body) in files(data) {
        if let Err(e) = std::fs::write(dir.join(&name), body) {
            panic!("fuzz scratch: cannot write {name}: {e}");
        }
    }
    let package = Package::open(&dir).map_err(|e| e.to_string())?;
    // What a caller computes next from a package that opened: the KV bytes
    // admission counts with, and the decoder's ports.
    if let Some(geometry) = package.kv_geometry() {
        let _ = geometry.bytes_per_token();
    }
    let (component, _) = package.decoder().map_err(|e| e.to_string())?;
    package.kv_ports(component).map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files split at each `@@ name` line; unsafe names are dropped.
    #[test]
    fn files_split_at_marks_and_refuse_paths() {
        let data = join(&[("a.yaml", b"x: 1\n".to_vec()), ("../escape", b"no".to_vec()), ("b.onnx", vec![0, 1])]);
        let f = files(&data);
        let names: Vec<&str> = f.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a.yaml", "b.onnx"]);
        assert_eq!(f[0].1, b"x: 1\n");
        assert_eq!(f[1].1, [0, 1]);
    }
}

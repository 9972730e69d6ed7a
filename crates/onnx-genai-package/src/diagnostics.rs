//! Coded validation diagnostics: every problem a package has, each with a
//! stable code, the file and field at fault, and what to do about it.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// Stable diagnostic codes. The numbers never change meaning; new checks get
/// new numbers. `PKG0xx` are the native manifest, `PKG1xx` the ONNX Runtime
/// GenAI `genai_config.json` dialect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Code {
    /// The manifest file is missing or unreadable.
    PKG001,
    /// The manifest is not valid YAML.
    PKG002,
    /// A key the schema does not know.
    PKG003,
    /// A value of the wrong type, a missing required field, or an invalid value.
    PKG004,
    /// An unsupported manifest format version.
    PKG005,
    /// A path that is absolute or climbs out with `..`.
    PKG010,
    /// A path that resolves (through a symlink) outside the package.
    PKG011,
    /// A referenced file does not exist.
    PKG012,
    /// A referenced file cannot be read.
    PKG013,
    /// An ONNX file that does not decode.
    PKG020,
    /// A port bound by the manifest is not an input/output of the graph.
    PKG021,
    /// A port's element type does not fit its role.
    PKG022,
    /// A port's rank does not fit its role.
    PKG023,
    /// A role the component needs is not bound.
    PKG024,
    /// The same role or tensor is bound twice, or a per-layer template is malformed.
    PKG025,
    /// A graph input that no port binds (the runtime could not feed it).
    PKG026,
    /// External data that is missing, short, or outside the package.
    PKG027,
    /// KV geometry disagrees with the graph's KV tensor shapes.
    PKG030,
    /// Inconsistent architecture numbers (heads vs KV heads, zero sizes).
    PKG031,
    /// The context length exceeds the positions the graph's rotary cache holds.
    PKG032,
    /// An operator the reference runtime (ONNX Runtime) refuses for this
    /// geometry: `GroupQueryAttention` with a head size that is not a
    /// multiple of 8 (of 16 when it applies rotary itself, `do_rotary`).
    PKG033,
    /// Logits width differs from the architecture's vocabulary size.
    PKG040,
    /// The tokenizer's vocabulary does not fit the model's.
    PKG041,
    /// The tokenizer file does not load.
    PKG042,
    /// A special token id (eos/bos) outside the vocabulary.
    PKG043,
    /// A sampling default out of its range (temperature below 0, top_p
    /// outside [0, 1], repetition_penalty not above 0).
    PKG044,
    /// The chat template does not parse, or a tag of it holds more code than
    /// its parser may recurse through.
    PKG050,
    /// A workflow application input or step that the graph does not have.
    PKG060,
    /// `genai_config.json` is not valid JSON.
    PKG101,
    /// A key `genai_config.json` does not know.
    PKG102,
    /// A value of the wrong type or a missing required key in `genai_config.json`.
    PKG103,
    /// A `%d` KV name template that matches no graph input or output.
    PKG104,
    /// A `genai_config.json` feature this project does not support.
    PKG105,
    /// `search.max_length` beyond the model's `context_length` (a warning).
    PKG106,
    /// A `tokenizer_config.json` tokenizer class without the
    /// `tokenizer.json` this runtime reads.
    PKG107,
    /// A `genai_config.json` search setting this runtime does not apply
    /// (beam search, a minimum length, n-gram blocking): a warning.
    PKG108,
    /// A `genai_config.json` model type ONNX Runtime GenAI does not list,
    /// read as a text decoder: a warning.
    PKG109,
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub code: Code,
    pub severity: Severity,
    /// Path relative to the package root.
    pub file: String,
    /// Dotted field path inside the file (`components[0].ports[2].name`), or empty.
    pub field: String,
    pub message: String,
    /// What to do about it.
    pub hint: String,
}

impl Diagnostic {
    pub fn error(
        code: Code,
        file: &str,
        field: impl Into<String>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self {
            code,
            severity: Severity::Error,
            file: file.into(),
            field: field.into(),
            message: message.into(),
            hint: hint.into(),
        }
    }

    pub fn warning(
        code: Code,
        file: &str,
        field: impl Into<String>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self { severity: Severity::Warning, ..Self::error(code, file, field, message, hint) }
    }
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let severity = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(f, "{severity}[{}] {}", self.code, self.file)?;
        if !self.field.is_empty() {
            write!(f, " @ {}", self.field)?;
        }
        write!(f, ": {}\n  hint: {}", self.message, self.hint)
    }
}

/// Everything `validate` found, in a stable order.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub diagnostics: Vec<Diagnostic>,
}

impl Report {
    pub fn push(&mut self, d: Diagnostic) {
        self.diagnostics.push(d);
    }

    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.severity == Severity::Error)
    }

    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.severity == Severity::Error)
    }
}

/// Digits replaced: diagnostics that differ only by a layer or tensor
/// number share this shape.
fn shape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('#') {
                out.push('#');
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Report {
    /// The diagnostics in groups that differ only by numbers (one per
    /// layer, say), each group in its first member's place.
    pub fn grouped(&self) -> Vec<Vec<&Diagnostic>> {
        let mut groups: Vec<Vec<&Diagnostic>> = Vec::new();
        let mut index: std::collections::BTreeMap<(Severity, Code, String, String, String, String), usize> =
            std::collections::BTreeMap::new();
        for d in &self.diagnostics {
            let key = (d.severity, d.code, d.file.clone(), shape(&d.field), shape(&d.message), shape(&d.hint));
            match index.get(&key) {
                Some(&i) => groups[i].push(d),
                None => {
                    index.insert(key, groups.len());
                    groups.push(vec![d]);
                }
            }
        }
        groups
    }

    /// Every diagnostic on its own (`validate --verbose`).
    pub fn verbose(&self) -> String {
        self.diagnostics.iter().map(|d| format!("{d}\n")).collect()
    }
}

/// Diagnostics that differ only by numbers print once, with a count and
/// the fields (or messages) of the others.
impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for group in self.grouped() {
            writeln!(f, "{}", group[0])?;
            if group.len() > 1 {
                let names: Vec<&str> = group[1..]
                    .iter()
                    .map(|d| if d.field.is_empty() { d.message.as_str() } else { d.field.as_str() })
                    .collect();
                let shown = names.iter().take(6).copied().collect::<Vec<_>>().join(", ");
                let more = if names.len() > 6 { ", ..." } else { "" };
                writeln!(f, "  (and {} more like it: {shown}{more}; --verbose lists each)", names.len())?;
            }
        }
        Ok(())
    }
}

/// The longest word a "did you mean" hint compares (the distance costs
/// the product of two words' lengths: tensor names of millions of
/// characters took hours).
const MAX_HINT_CHARS: usize = 256;

/// The known word nearest to `unknown` (Levenshtein distance at most a third of
/// its length, at least 2), for "did you mean" hints; none for words longer
/// than [`MAX_HINT_CHARS`].
pub fn nearest<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    let length = unknown.chars().count();
    if length > MAX_HINT_CHARS {
        return None;
    }
    let limit = (length / 3).max(2);
    known
        .iter()
        .filter(|k| k.len() <= 4 * MAX_HINT_CHARS && k.chars().count() <= MAX_HINT_CHARS)
        .map(|k| (levenshtein(unknown, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, k)| (*d, *k))
        .map(|(_, k)| k)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hints compare words of up to 256 characters: a two-million-character
    /// name gets none, at once, and a long known word is passed over while
    /// a near one is still found.
    #[test]
    fn hints_skip_words_too_long_to_compare() {
        assert_eq!(nearest("tokn_ids", &["token_ids", "logits"]), Some("token_ids"));
        let long = "a".repeat(2_000_000);
        assert_eq!(nearest(&long, &["a", &"a".repeat(2_000_001)]), None);
        assert_eq!(nearest("aaaa", &[&long, "aaab"]), Some("aaab"));
    }

    #[test]
    fn nearest_suggests_close_keys_only() {
        assert_eq!(nearest("hiden_size", &["hidden_size", "head_dim"]), Some("hidden_size"));
        assert_eq!(nearest("num_kv_head", &["num_kv_heads", "num_layers"]), Some("num_kv_heads"));
        assert_eq!(nearest("completely_else", &["hidden_size", "head_dim"]), None);
    }
}

#[cfg(test)]
mod grouping_tests {
    use super::*;

    /// Issue 18: a warning repeated per layer prints once with a count and
    /// the other fields; different messages stay apart; `verbose` keeps all.
    #[test]
    fn repeated_diagnostics_collapse_by_shape() {
        let mut r = Report::default();
        for layer in 0..30 {
            r.push(Diagnostic::warning(
                Code::PKG030,
                "model.onnx",
                format!("past_key_values.{layer}.key"),
                format!("head dim of layer {layer} is not fixed"),
                "fix it",
            ));
        }
        r.push(Diagnostic::error(Code::PKG030, "model.onnx", "other", "something else", "fix it"));
        let text = r.to_string();
        assert_eq!(r.grouped().len(), 2);
        assert_eq!(text.matches("warning[").count(), 1, "{text}");
        assert!(text.contains("(and 29 more like it: past_key_values.1.key, past_key_values.2.key"), "{text}");
        assert!(text.contains("error[PKG030] model.onnx @ other: something else"), "{text}");
        assert_eq!(r.verbose().matches("warning[").count(), 30);
    }
}

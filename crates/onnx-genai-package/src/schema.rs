//! Closed-schema parsing shared by `package.yaml` and `genai_config.json`.
//!
//! The serde structs are the single source of truth for which keys exist. To
//! report *every* unknown key at once (not only the first), a document is
//! deserialized repeatedly: each unknown key becomes a diagnostic with the
//! nearest known key as suggestion, is removed, and deserialization retries.

use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;

use crate::diagnostics::{nearest, Code, Diagnostic, Report};

/// Codes to use for one dialect's schema problems.
pub struct SchemaCodes {
    pub unknown_key: Code,
    pub bad_value: Code,
}

/// A tree both YAML and JSON documents convert into.
pub type Tree = serde_json::Value;

/// Deserializes `tree` into `T`, pushing one diagnostic per unknown key and
/// one for the first other problem. Returns `None` when `T` cannot be built.
pub fn deserialize_closed<T: DeserializeOwned>(
    mut tree: Tree,
    file: &str,
    codes: &SchemaCodes,
    report: &mut Report,
) -> Option<T> {
    // Each round removes one key, so the number of keys bounds the rounds;
    // each round re-reads the document, so the rounds are capped too (8,000
    // unknown keys once took seconds).
    let mut unknown_keys = 0;
    for _ in 0..=count_keys(&tree) {
        if unknown_keys == MAX_UNKNOWN_KEYS {
            report.push(Diagnostic::error(
                codes.unknown_key,
                file,
                "",
                format!("more than {MAX_UNKNOWN_KEYS} unknown keys; the rest are not listed"),
                "fix the keys above (is this the right kind of file?)",
            ));
            return None;
        }
        let err = match serde_path_to_error::deserialize::<_, T>(tree.clone()) {
            Ok(value) => return Some(value),
            Err(err) => err,
        };
        let message = err.inner().to_string();
        let segments: Vec<Segment> = err.path().iter().cloned().collect();
        if let Some(unknown) = message.strip_prefix("unknown field `").and_then(|m| m.split('`').next()) {
            let unknown = unknown.to_string();
            // The path may or may not end at the unknown key itself.
            let parent: Vec<Segment> = match segments.last() {
                Some(Segment::Map { key }) if *key == unknown => segments[..segments.len() - 1].to_vec(),
                _ => segments.clone(),
            };
            let expected = backticked(message.split_once("expected").map_or("", |(_, e)| e));
            let known: Vec<&str> = expected.iter().map(String::as_str).collect();
            let hint = match nearest(&unknown, &known) {
                Some(s) => format!("did you mean `{s}`? Known keys here: {}", known.join(", ")),
                None => format!("remove it; known keys here: {}", known.join(", ")),
            };
            report.push(Diagnostic::error(
                codes.unknown_key,
                file,
                join_path(&parent, Some(&unknown)),
                format!("unknown key `{unknown}`"),
                hint,
            ));
            if !remove_key(&mut tree, &parent, &unknown) {
                return None;
            }
            unknown_keys += 1;
            continue;
        }
        let hint = if let Some(rest) = message.strip_prefix("unknown variant `") {
            let got = rest.split('`').next().unwrap_or_default();
            let expected = backticked(message.split_once("expected").map_or("", |(_, e)| e));
            let known: Vec<&str> = expected.iter().map(String::as_str).collect();
            match nearest(got, &known) {
                Some(s) => format!("did you mean `{s}`? Allowed values: {}", known.join(", ")),
                None => format!("use one of: {}", known.join(", ")),
            }
        } else if message.starts_with("missing field") {
            "add the field; see ARCHITECTURE.md for the manifest schema".to_string()
        } else {
            "give the field a value of the expected type".to_string()
        };
        report.push(Diagnostic::error(codes.bad_value, file, join_path(&segments, None), message, hint));
        return None;
    }
    None
}

/// Unknown keys reported one by one before the rest are summarized.
pub const MAX_UNKNOWN_KEYS: usize = 50;

/// How deep a manifest's lists and maps may nest.
pub const MAX_NESTING: usize = 32;

/// Checks that the flow collections (`[...]`, `{...}`) of a YAML or JSON
/// text nest at most [`MAX_NESTING`] deep; returns the depth reached when
/// they do not. Run before parsing: a parser walks 100,000 levels slowly
/// (or not at all). Brackets inside quoted scalars, comments and block
/// scalars (`|`, `>`: where chat templates live, Jinja braces and all) are
/// not structure and are skipped.
pub fn check_nesting(text: &str) -> Result<(), usize> {
    let mut depth = 0usize;
    // Indentation of the key whose block scalar is being skipped.
    let mut block: Option<usize> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(owner) = block {
            if line.trim().is_empty() || indent > owner {
                continue;
            }
            block = None;
        }
        let (mut quote, mut escaped, mut prev) = (None::<char>, false, ' ');
        let mut content_end = 0;
        for (at, c) in line.char_indices() {
            match quote {
                Some('"') if c == '\\' && !escaped => {
                    escaped = true;
                    continue;
                }
                Some(q) if c == q && !escaped => quote = None,
                Some(_) => {}
                // A quote opens a scalar only where a value starts.
                None if (c == '"' || c == '\'') && matches!(prev, ' ' | ':' | '-' | '[' | '{' | ',') => quote = Some(c),
                None if c == '#' && prev.is_whitespace() => break,
                None if c == '[' || c == '{' => {
                    depth += 1;
                    if depth > MAX_NESTING {
                        return Err(depth);
                    }
                }
                None if c == ']' || c == '}' => depth = depth.saturating_sub(1),
                None => {}
            }
            escaped = false;
            if !c.is_whitespace() {
                content_end = at + c.len_utf8();
            }
            prev = c;
        }
        let content = line[..content_end].trim_end();
        let indicator = content.trim_end_matches(|c: char| c == '-' || c == '+' || c.is_ascii_digit());
        if quote.is_none()
            && (indicator.ends_with(": |")
                || indicator.ends_with(": >")
                || indicator == "|"
                || indicator == ">"
                || indicator.ends_with("- |")
                || indicator.ends_with("- >"))
        {
            block = Some(indent);
        }
    }
    Ok(())
}

fn count_keys(tree: &Tree) -> usize {
    match tree {
        Tree::Object(map) => map.len() + map.values().map(count_keys).sum::<usize>(),
        Tree::Array(items) => items.iter().map(count_keys).sum(),
        _ => 0,
    }
}

fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// `components[0].ports[2].name`-style path.
pub fn join_path(segments: &[Segment], last: Option<&str>) -> String {
    let mut out = String::new();
    for s in segments {
        match s {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Enum { variant } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(variant);
            }
            Segment::Unknown => out.push_str(".?"),
        }
    }
    if let Some(last) = last {
        if !out.is_empty() {
            out.push('.');
        }
        out.push_str(last);
    }
    out
}

fn remove_key(tree: &mut Tree, parent: &[Segment], key: &str) -> bool {
    let mut node = tree;
    for s in parent {
        node = match (s, node) {
            (Segment::Seq { index }, Tree::Array(items)) => match items.get_mut(*index) {
                Some(n) => n,
                None => return false,
            },
            (Segment::Map { key }, Tree::Object(map)) => match map.get_mut(key) {
                Some(n) => n,
                None => return false,
            },
            _ => return false,
        };
    }
    match node {
        Tree::Object(map) => map.remove(key).is_some(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        alpha: u32,
        beta: u32,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        inner: Vec<Inner>,
        name: String,
    }

    const CODES: SchemaCodes = SchemaCodes { unknown_key: Code::PKG003, bad_value: Code::PKG004 };

    /// Every unknown key is reported, at its own path, not just the first one.
    /// Issue 20, finding 4: 100,000 nested lists are refused before the
    /// parser sees them; brackets that are text (a chat template's Jinja in
    /// a block scalar, quoted strings, comments) are not counted.
    #[test]
    fn deep_nesting_is_refused_and_text_is_not_structure() {
        let deep = format!("extra: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(check_nesting(&deep), Err(MAX_NESTING + 1));
        let maps = format!("a: {}{}", "{b: ".repeat(40), "}".repeat(40));
        assert!(check_nesting(&maps).is_err());
        let jinja = "{# a comment #}{% if x %}{{ 'it' }}{% endif %}\n".repeat(40);
        let template = format!(
            "name: it's fine\nchat_template: |-\n  {}\nnote: \"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\" # {{{{{{{{\nlist: [[1, 2], {{a: [3]}}]\n",
            jinja.replace('\n', "\n  ")
        );
        assert_eq!(check_nesting(&template), Ok(()), "{template}");
    }

    /// Issue 20, finding 4: 8,000 unknown keys once took seconds (each
    /// reported key re-read the whole document); now the first
    /// `MAX_UNKNOWN_KEYS` are listed and the rest summarized.
    #[test]
    fn unknown_keys_past_the_cap_are_summarized() {
        let mut map = serde_json::Map::new();
        map.insert("name".into(), "x".into());
        map.insert("inner".into(), serde_json::json!([]));
        for i in 0..8000 {
            map.insert(format!("k{i}"), 1.into());
        }
        let mut report = Report::default();
        let parsed: Option<Outer> = deserialize_closed(Tree::Object(map), "f.yaml", &CODES, &mut report);
        assert!(parsed.is_none());
        assert_eq!(report.diagnostics.len(), MAX_UNKNOWN_KEYS + 1, "{report}");
        assert!(report.diagnostics.last().is_some_and(|d| d.message.contains("more than 50 unknown keys")));
    }

    #[test]
    fn reports_every_unknown_key_with_path_and_suggestion() {
        let tree = serde_json::json!({
            "name": "x", "nmae": "y",
            "inner": [{"alpha": 1, "beta": 2}, {"alpha": 1, "beta": 2, "betta": 3}]
        });
        let mut report = Report::default();
        let parsed: Option<Outer> = deserialize_closed(tree, "f.yaml", &CODES, &mut report);
        assert!(parsed.is_some(), "after removing unknown keys the document is valid");
        let fields: Vec<&str> = report.diagnostics.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields.len(), 2, "{report}");
        assert!(fields.contains(&"nmae"), "{fields:?}");
        assert!(fields.contains(&"inner[1].betta"), "{fields:?}");
        assert!(report.diagnostics.iter().any(|d| d.hint.contains("did you mean `beta`")), "{report}");
    }

    #[test]
    fn wrong_type_is_one_coded_error_with_path() {
        let tree = serde_json::json!({"name": "x", "inner": [{"alpha": "one", "beta": 2}]});
        let mut report = Report::default();
        let parsed: Option<Outer> = deserialize_closed(tree, "f.yaml", &CODES, &mut report);
        assert!(parsed.is_none());
        assert_eq!(report.diagnostics.len(), 1);
        assert_eq!(report.diagnostics[0].code, Code::PKG004);
        assert_eq!(report.diagnostics[0].field, "inner[0].alpha");
    }
}

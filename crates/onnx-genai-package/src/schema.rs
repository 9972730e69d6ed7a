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
    // Each round removes one key, so the number of keys bounds the rounds.
    for _ in 0..=count_keys(&tree) {
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

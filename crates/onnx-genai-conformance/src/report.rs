//! Reports of a conformance run: Markdown for people, JSON for tools, JUnit
//! XML for CI, each stamped with the commit.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::run::{CheckResult, Status};

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub commit: String,
    /// Stages and checks in the order they ran.
    pub results: Vec<CheckResult>,
}

impl Report {
    pub fn failures(&self) -> usize {
        self.results.iter().filter(|r| r.status == Status::Failed).count()
    }

    pub fn skipped(&self) -> usize {
        self.results.iter().filter(|r| r.status == Status::Skipped).count()
    }

    /// Per suite: (passed, failed, skipped).
    pub fn by_suite(&self) -> BTreeMap<&'static str, (usize, usize, usize)> {
        let mut m: BTreeMap<&'static str, (usize, usize, usize)> = BTreeMap::new();
        for r in &self.results {
            let e = m.entry(r.suite).or_default();
            match r.status {
                Status::Passed => e.0 += 1,
                Status::Failed => e.1 += 1,
                Status::Skipped => e.2 += 1,
            }
        }
        m
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Conformance report\n\ncommit `{}`\n", self.commit);
        let _ = writeln!(s, "| suite | passed | failed | skipped |\n|---|---:|---:|---:|");
        for (suite, (p, f, k)) in self.by_suite() {
            let _ = writeln!(s, "| {suite} | {p} | {f} | {k} |");
        }
        let _ = writeln!(s, "\n| check | status | seconds | summary |\n|---|---|---:|---|");
        for r in &self.results {
            let status = match r.status {
                Status::Passed => "pass",
                Status::Failed => "**FAIL**",
                Status::Skipped => "*skipped*",
            };
            let _ = writeln!(s, "| `{}` | {status} | {:.2} | {} |", r.name, r.seconds, r.summary.replace('|', "\\|"));
        }
        s
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    pub fn junit(&self) -> String {
        let mut suites: BTreeMap<&str, Vec<&CheckResult>> = BTreeMap::new();
        for r in &self.results {
            suites.entry(r.suite).or_default().push(r);
        }
        let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let _ = writeln!(
            s,
            "<testsuites name=\"onnx-genai conformance\" tests=\"{}\" failures=\"{}\" skipped=\"{}\">",
            self.results.len(),
            self.failures(),
            self.skipped()
        );
        let _ = writeln!(s, "  <properties><property name=\"commit\" value=\"{}\"/></properties>", xml(&self.commit));
        for (suite, results) in suites {
            let failures = results.iter().filter(|r| r.status == Status::Failed).count();
            let skipped = results.iter().filter(|r| r.status == Status::Skipped).count();
            let time: f64 = results.iter().map(|r| r.seconds).sum();
            let _ = writeln!(
                s,
                "  <testsuite name=\"{suite}\" tests=\"{}\" failures=\"{failures}\" skipped=\"{skipped}\" time=\"{time:.3}\">",
                results.len()
            );
            for r in results {
                let class = format!("{suite}.{}.{}", r.package, r.variant);
                let _ = write!(
                    s,
                    "    <testcase classname=\"{}\" name=\"{}\" time=\"{:.3}\"",
                    xml(&class),
                    xml(&r.name),
                    r.seconds
                );
                match r.status {
                    Status::Failed => {
                        let _ = writeln!(s, ">\n      <failure message=\"{}\"/>\n    </testcase>", xml(&r.summary));
                    }
                    Status::Skipped => {
                        let _ = writeln!(s, ">\n      <skipped message=\"{}\"/>\n    </testcase>", xml(&r.summary));
                    }
                    Status::Passed => {
                        let _ = writeln!(s, "><system-out>{}</system-out></testcase>", xml(&r.summary));
                    }
                }
            }
            let _ = writeln!(s, "  </testsuite>");
        }
        s.push_str("</testsuites>\n");
        s
    }
}

/// `s` as XML 1.0 text: markup escaped, and the control characters it
/// cannot hold at all (a NUL or an ESC in a golden record's line made the
/// JUnit report one no CI parser reads) replaced by U+FFFD.
fn xml(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() && !matches!(c, '\t' | '\n' | '\r') { '\u{fffd}' } else { c })
        .collect::<String>()
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(name: &str, status: Status, summary: &str) -> CheckResult {
        CheckResult {
            name: name.into(),
            suite: "parity",
            package: "p".into(),
            variant: "decomposed",
            backend: "native-cpu".into(),
            status,
            summary: summary.into(),
            seconds: 0.5,
            parity: None,
            batch: None,
            golden_text: None,
        }
    }

    /// JUnit output counts failures and escapes what it quotes; control
    /// characters XML 1.0 cannot hold (a NUL, an ESC quoted from a golden
    /// record) become U+FFFD, so the report stays one a CI parser reads.
    #[test]
    fn junit_counts_and_escapes() {
        let r = Report {
            commit: "abc".into(),
            results: vec![
                result("a", Status::Passed, "ok"),
                result("b", Status::Failed, "x < y & \"z\"\u{0}\u{1b}[1m"),
            ],
        };
        let x = r.junit();
        assert!(x.contains("tests=\"2\" failures=\"1\""));
        assert!(x.contains("x &lt; y &amp; &quot;z&quot;\u{fffd}\u{fffd}[1m"), "{x}");
        assert!(!x.contains('\u{0}') && !x.contains('\u{1b}'));
        assert!(r.markdown().contains("**FAIL**"));
        assert_eq!(r.failures(), 1);
    }

    /// A skipped check (a real model that could not be fetched) is in every
    /// report, as skipped and not as passed (issue 21).
    #[test]
    fn skipped_checks_are_reported_as_skipped() {
        let r = Report {
            commit: "abc".into(),
            results: vec![
                result("a", Status::Passed, "ok"),
                result("real::fetch", Status::Skipped, "the wheel could not be fetched"),
            ],
        };
        assert_eq!((r.failures(), r.skipped()), (0, 1));
        assert_eq!(r.by_suite()["parity"], (1, 0, 1));
        assert!(
            r.junit().contains("skipped=\"1\"")
                && r.junit().contains("<skipped message=\"the wheel could not be fetched\"/>")
        );
        assert!(r.markdown().contains("| `real::fetch` | *skipped* |"));
        assert!(r.json().contains("\"status\": \"skipped\""));
    }
}

//! The ratchet: `conformance/onnx-node-tests.yaml` records what every ONNX
//! node case does on native-cpu and on ONNX Runtime. A run that differs
//! fails — a case that regresses, and equally a case that newly passes,
//! until the file is rewritten (`cargo xtask onnx-tests --bless`), so
//! progress is recorded in review, not just observed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::{CaseResult, Outcome, Tolerance, ONNX_DEFAULT};

/// A tolerance wider than ONNX's default for one case, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    pub rtol: f64,
    pub atol: f64,
    pub why: String,
}

/// What one case is expected to do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    pub op: String,
    pub native: Outcome,
    pub ort: Outcome,
    /// native-cpu's reason when it does not pass (informational: only the
    /// outcomes are compared, so rewording an error does not churn the
    /// file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ratchet {
    /// The `onnx` wheel the cases come from.
    pub onnx: String,
    #[serde(default)]
    pub tolerances: BTreeMap<String, Override>,
    pub cases: BTreeMap<String, Expected>,
}

impl Ratchet {
    pub fn tolerance(&self, case: &str) -> Tolerance {
        self.tolerances.get(case).map_or(ONNX_DEFAULT, |o| Tolerance { rtol: o.rtol, atol: o.atol })
    }

    /// The file as it should read after `results` (overrides kept).
    pub fn blessed(&self, onnx: &str, results: &[CaseResult]) -> Ratchet {
        let cases = results
            .iter()
            .map(|r| {
                let expected = Expected {
                    op: r.op.clone(),
                    native: r.native.outcome,
                    ort: r.ort.outcome,
                    why: r.native.why.as_ref().map(|w| first_line(w, 160)),
                };
                (r.name.clone(), expected)
            })
            .collect();
        Ratchet { onnx: onnx.into(), tolerances: self.tolerances.clone(), cases }
    }
}

fn first_line(s: &str, max: usize) -> String {
    let line = s.lines().next().unwrap_or_default();
    match line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_string(),
    }
}

/// Where a run and the ratchet disagree.
#[derive(Clone, Debug, PartialEq)]
pub enum Difference {
    /// The backend (`native` or `ort`) did worse than recorded.
    Regressed { case: String, backend: &'static str, expected: Outcome, got: Outcome, why: Option<String> },
    /// The backend did better than recorded: record it.
    Improved { case: String, backend: &'static str, expected: Outcome, got: Outcome },
    /// Neither better nor worse, but different (one kind of refusal for
    /// another).
    Changed { case: String, backend: &'static str, expected: Outcome, got: Outcome, why: Option<String> },
    /// A case the ratchet does not list.
    New { case: String },
    /// A listed case that was not found.
    Missing { case: String },
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = |w: &Option<String>| w.as_deref().map(|w| format!(": {}", first_line(w, 300))).unwrap_or_default();
        match self {
            Difference::Regressed { case, backend, expected, got, why: w } => {
                write!(
                    f,
                    "REGRESSED {case} on {backend}: expected {}, got {}{}",
                    expected.as_str(),
                    got.as_str(),
                    why(w)
                )
            }
            Difference::Improved { case, backend, expected, got } => write!(
                f,
                "IMPROVED  {case} on {backend}: expected {}, got {} (record it with --bless)",
                expected.as_str(),
                got.as_str()
            ),
            Difference::Changed { case, backend, expected, got, why: w } => {
                write!(
                    f,
                    "CHANGED   {case} on {backend}: expected {}, got {}{}",
                    expected.as_str(),
                    got.as_str(),
                    why(w)
                )
            }
            Difference::New { case } => write!(f, "NEW       {case}: not in the ratchet (record it with --bless)"),
            Difference::Missing { case } => write!(f, "MISSING   {case}: in the ratchet but not among the cases"),
        }
    }
}

/// Passing is better than anything; among the rest, a refusal at compile
/// time (or before) is better than a failure at run time, which is better
/// than a wrong answer.
fn rank(o: Outcome) -> u8 {
    match o {
        Outcome::Pass => 0,
        Outcome::Unsupported | Outcome::NoKernel | Outcome::Unreadable => 1,
        Outcome::Error => 2,
        Outcome::Wrong => 3,
    }
}

/// Every disagreement between `results` and `ratchet`; empty when the run
/// matches the record exactly.
pub fn check(ratchet: &Ratchet, results: &[CaseResult]) -> Vec<Difference> {
    let mut out = Vec::new();
    let seen: BTreeSet<&str> = results.iter().map(|r| r.name.as_str()).collect();
    for r in results {
        let Some(e) = ratchet.cases.get(&r.name) else {
            out.push(Difference::New { case: r.name.clone() });
            continue;
        };
        for (backend, expected, got) in [("native", e.native, &r.native), ("ort", e.ort, &r.ort)] {
            if expected == got.outcome {
                continue;
            }
            let case = r.name.clone();
            let (got, why) = (got.outcome, got.why.clone());
            out.push(match rank(got).cmp(&rank(expected)) {
                std::cmp::Ordering::Greater => Difference::Regressed { case, backend, expected, got, why },
                std::cmp::Ordering::Less => Difference::Improved { case, backend, expected, got },
                std::cmp::Ordering::Equal => Difference::Changed { case, backend, expected, got, why },
            });
        }
    }
    for case in ratchet.cases.keys().filter(|c| !seen.contains(c.as_str())) {
        out.push(Difference::Missing { case: case.clone() });
    }
    out
}

/// Counts of one op's cases.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpRow {
    pub cases: usize,
    pub pass: usize,
    pub unsupported: usize,
    pub error: usize,
    pub wrong: usize,
    pub ort_pass: usize,
    /// Distinct compile-error reasons (attributes, inputs, dtypes refused).
    pub refusals: BTreeSet<String>,
}

/// Per-op counts for the ops native-cpu lowers (at least one case got past
/// "no kernel"), and the number of cases of ops it does not.
pub fn by_op(results: &[CaseResult]) -> (BTreeMap<String, OpRow>, usize) {
    let claimed: BTreeSet<&str> = results
        .iter()
        .filter(|r| !matches!(r.native.outcome, Outcome::NoKernel | Outcome::Unreadable))
        .map(|r| r.op.as_str())
        .collect();
    let mut rows: BTreeMap<String, OpRow> = BTreeMap::new();
    let mut unclaimed = 0;
    for r in results {
        if !claimed.contains(r.op.as_str()) {
            unclaimed += 1;
            continue;
        }
        let row = rows.entry(r.op.clone()).or_default();
        row.cases += 1;
        row.ort_pass += usize::from(r.ort.outcome == Outcome::Pass);
        match r.native.outcome {
            Outcome::Pass => row.pass += 1,
            Outcome::Error => row.error += 1,
            Outcome::Wrong => row.wrong += 1,
            Outcome::Unsupported | Outcome::NoKernel | Outcome::Unreadable => {
                row.unsupported += 1;
                if let Some(w) = &r.native.why {
                    row.refusals.insert(refusal(w));
                }
            }
        }
    }
    (rows, unclaimed)
}

/// The part of a compile error that says what was refused (after the node
/// name, which differs per case).
fn refusal(why: &str) -> String {
    let tail = why.rsplit_once("): ").map_or(why, |(_, t)| t);
    let tail = tail.rsplit_once("native-cpu: ").map_or(tail, |(_, t)| t);
    first_line(tail, 90)
}

/// `target/conformance/onnx-node.md`.
pub fn markdown(onnx: &str, results: &[CaseResult]) -> String {
    let (rows, unclaimed) = by_op(results);
    let mut s = String::new();
    let total = |f: fn(&OpRow) -> usize| rows.values().map(f).sum::<usize>();
    let _ = writeln!(s, "# ONNX node tests (onnx {onnx}) on native-cpu\n");
    let _ = writeln!(
        s,
        "{} cases; {} of ops native-cpu lowers: {} pass, {} refused at compile time, {} fail at run time, {} wrong. \
         {unclaimed} cases of ops without a native-cpu kernel or that the ONNX reader refuses. \
         ONNX Runtime passes {} of all cases.\n",
        results.len(),
        total(|r| r.cases),
        total(|r| r.pass),
        total(|r| r.unsupported),
        total(|r| r.error),
        total(|r| r.wrong),
        results.iter().filter(|r| r.ort.outcome == Outcome::Pass).count(),
    );
    let _ = writeln!(s, "| op | cases | pass | refused | run error | wrong | ORT pass | refused because |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---|");
    for (op, r) in &rows {
        let reasons: Vec<&str> = r.refusals.iter().map(String::as_str).collect();
        let _ = writeln!(
            s,
            "| {op} | {} | {} | {} | {} | {} | {} | {} |",
            r.cases,
            r.pass,
            r.unsupported,
            r.error,
            r.wrong,
            r.ort_pass,
            reasons.join("; ").replace('|', "\\|")
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx_node::Verdict;

    fn result(name: &str, native: Outcome, ort: Outcome) -> CaseResult {
        let verdict = |o| Verdict { outcome: o, why: (o != Outcome::Pass).then(|| "because".to_string()) };
        CaseResult { name: name.into(), op: "Add".into(), native: verdict(native), ort: verdict(ort) }
    }

    fn recorded(cases: &[(&str, Outcome)]) -> Ratchet {
        let cases = cases
            .iter()
            .map(|(n, o)| (n.to_string(), Expected { op: "Add".into(), native: *o, ort: Outcome::Pass, why: None }))
            .collect();
        Ratchet { onnx: "1.22.0".into(), tolerances: BTreeMap::new(), cases }
    }

    /// The ratchet's contract: a run equal to the record passes; worse is a
    /// regression, better an improvement, a sideways move a change, and
    /// cases gained or lost are named — every one of them fails the run.
    #[test]
    fn every_difference_from_the_record_is_reported() {
        let ratchet = recorded(&[
            ("same", Outcome::Pass),
            ("worse", Outcome::Pass),
            ("better", Outcome::Unsupported),
            ("sideways", Outcome::NoKernel),
            ("gone", Outcome::Pass),
        ]);
        let results = vec![
            result("same", Outcome::Pass, Outcome::Pass),
            result("worse", Outcome::Wrong, Outcome::Pass),
            result("better", Outcome::Pass, Outcome::Pass),
            result("sideways", Outcome::Unsupported, Outcome::Error),
            result("fresh", Outcome::Pass, Outcome::Pass),
        ];
        let diffs = check(&ratchet, &results);
        let kinds: Vec<String> = diffs.iter().map(|d| d.to_string()).collect();
        assert_eq!(diffs.len(), 6, "{kinds:#?}");
        assert!(matches!(&diffs[0], Difference::Regressed { case, got: Outcome::Wrong, .. } if case == "worse"));
        assert!(matches!(&diffs[1], Difference::Improved { case, .. } if case == "better"));
        assert!(matches!(&diffs[2], Difference::Changed { case, backend: "native", .. } if case == "sideways"));
        assert!(matches!(&diffs[3], Difference::Regressed { case, backend: "ort", .. } if case == "sideways"));
        assert!(matches!(&diffs[4], Difference::New { case } if case == "fresh"));
        assert!(matches!(&diffs[5], Difference::Missing { case } if case == "gone"));
        assert!(check(&ratchet.blessed("1.22.0", &results), &results).is_empty(), "a blessed record matches its run");
    }

    /// A run error ranks below a refusal and a wrong answer below both, so
    /// a kernel that starts failing at run time, or answering wrongly, in a
    /// case that used to be refused at compile time is a regression.
    #[test]
    fn failing_later_is_worse_than_refusing_early() {
        let ratchet = recorded(&[("a", Outcome::Unsupported), ("b", Outcome::Error)]);
        let results = vec![result("a", Outcome::Error, Outcome::Pass), result("b", Outcome::Wrong, Outcome::Pass)];
        let diffs = check(&ratchet, &results);
        assert!(diffs.iter().all(|d| matches!(d, Difference::Regressed { .. })), "{diffs:?}");
        assert_eq!(diffs.len(), 2);
    }

    #[test]
    fn the_table_counts_only_ops_native_cpu_lowers() {
        let mut results = vec![
            result("add_1", Outcome::Pass, Outcome::Pass),
            result("add_2", Outcome::Unsupported, Outcome::Pass),
            result("conv", Outcome::NoKernel, Outcome::Pass),
        ];
        results[2].op = "Conv".into();
        let (rows, unclaimed) = by_op(&results);
        assert_eq!(unclaimed, 1);
        let add = &rows["Add"];
        assert_eq!((add.cases, add.pass, add.unsupported, add.ort_pass), (2, 1, 1, 2));
        assert!(!rows.contains_key("Conv"));
        assert!(markdown("1.22.0", &results).contains("| Add | 2 | 1 | 1 | 0 | 0 | 2 |"));
    }
}

//! Running whole batteries: filter check, green baseline, a per-mutant
//! time limit derived from the baseline, the restore check, and the report.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::runner::is_killer;
use super::{Catalog, Mutant, MutantResult, Runner, Scope, TestRun, Verdict};

/// How many killers the clean-tree check runs at once: as many as a
/// mutant declares at most.
const KILLERS_AT_ONCE: usize = 4;

/// Which mutants of each battery run, and how long they may take.
#[derive(Clone, Debug)]
pub struct Selection {
    pub battery: Option<String>,
    pub mutant: Option<String>,
    /// `(k, n)`: only the k-th (1-based) of n shards of each battery.
    pub shard: Option<(usize, usize)>,
    /// The floor of the per-mutant limit; the limit is otherwise four
    /// times the baseline run (a mutant may have to rebuild).
    pub min_limit: Duration,
    pub baseline_limit: Duration,
}

impl Default for Selection {
    fn default() -> Self {
        Self {
            battery: None,
            mutant: None,
            shard: None,
            min_limit: Duration::from_secs(120),
            baseline_limit: Duration::from_secs(1800),
        }
    }
}

impl Selection {
    /// Whether `catalog`'s battery is in the selection.
    fn takes(&self, catalog: &Catalog) -> bool {
        self.battery.as_ref().is_none_or(|b| *b == catalog.battery)
    }
}

/// Something that makes the whole run untrustworthy, beyond one mutant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "kebab-case")]
pub enum Problem {
    /// The filter selects another number of tests than the catalog
    /// declares (a filter that drifts to zero measures nothing).
    FilterDrift { battery: String, selected: usize, declared: usize },
    /// The unmutated tests do not pass, so a failure would prove nothing.
    BaselineRed { battery: String, detail: String },
    /// The baseline passed fewer tests than the filter selects: an ignored
    /// (or otherwise skipped) killer can never catch a mutant.
    BaselineShort { battery: String, passed: usize, selected: usize },
    /// A declared killer is not among the tests the filter selects.
    UnselectedKiller { battery: String, killers: Vec<String> },
    /// The scratch tree differs from the source after restoring.
    NotRestored { files: Vec<String> },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::FilterDrift { battery, selected, declared } => {
                write!(
                    f,
                    "FILTER-DRIFT {battery}: the filter selects {selected} tests, the catalog declares {declared}"
                )
            }
            Problem::BaselineRed { battery, detail } => write!(f, "BASELINE-RED {battery}: {detail}"),
            Problem::BaselineShort { battery, passed, selected } => write!(
                f,
                "BASELINE-SHORT {battery}: the baseline passed {passed} of the {selected} tests the filter selects \
                 (an ignored or skipped test kills no mutant)"
            ),
            Problem::UnselectedKiller { battery, killers } => write!(
                f,
                "UNSELECTED-KILLER {battery}: the filter does not select these declared killers (they can catch \
                 nothing): {killers:?}"
            ),
            Problem::NotRestored { files } => {
                write!(f, "NOT-RESTORED: the scratch tree differs from the source after restoring: {files:?}")
            }
        }
    }
}

/// Everything one run of the batteries found.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub results: Vec<MutantResult>,
    pub problems: Vec<Problem>,
    /// What each battery spent before its first mutant.
    pub preparations: Vec<Preparation>,
    pub seconds: f64,
}

/// Seconds a battery spent before its first mutant: listing its tests and
/// the binaries that hold them (the first cargo run in a fresh scratch tree
/// builds them), the clean baseline, and the declared killers
/// run alone on the clean tree. The mutants' own seconds are in their
/// results; the rest of a run is these.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Preparation {
    pub battery: String,
    pub list: f64,
    pub baseline: f64,
    pub killers: f64,
}

impl std::fmt::Display for Preparation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: list {:.0} s, baseline {:.0} s, clean killers {:.0} s",
            self.battery, self.list, self.baseline, self.killers
        )
    }
}

impl Report {
    pub fn failures(&self) -> usize {
        self.results.iter().filter(|r| r.is_failure()).count()
    }

    pub fn passed(&self) -> bool {
        self.failures() == 0 && self.problems.is_empty()
    }

    pub fn result(&self, id: &str) -> Option<&MutantResult> {
        self.results.iter().find(|r| r.id == id)
    }

    /// Writes `report.md` and `report.json` (with the commit) into `dir`.
    pub fn write(&self, dir: &Path, commit: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut md = format!(
            "# Mutation batteries\n\ncommit `{commit}`, {:.0} s\n\n| battery | mutant | breaks | verdict | seconds |\n|---|---|---|---|---:|\n",
            self.seconds
        );
        for r in &self.results {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {:.1} |\n",
                r.battery,
                r.id,
                r.breaks.join(" "),
                r.describe(),
                r.seconds
            ));
        }
        md.push_str("\nBefore the first mutant of each battery:\n\n");
        for p in &self.preparations {
            md.push_str(&format!("- {p}\n"));
        }
        for p in &self.problems {
            md.push_str(&format!("\n**{p}**\n"));
        }
        std::fs::write(dir.join("report.md"), md)?;
        let json = serde_json::json!({
            "commit": commit,
            "seconds": self.seconds,
            "results": self.results,
            "preparations": self.preparations,
            "problems": self.problems,
        });
        let text = serde_json::to_string_pretty(&json).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("report.json"), text)
    }
}

impl MutantResult {
    /// One line for people: the verdict, and the killers when they differ
    /// from the declared ones.
    pub fn describe(&self) -> String {
        match &self.verdict {
            Verdict::Caught { by } if self.unexpected => {
                format!("caught by {by:?}, but the catalog expects {:?}", self.expected_killers)
            }
            Verdict::Caught { by } if self.scope == Scope::Battery => {
                format!("caught by {} (in the whole battery's run)", by.join(", "))
            }
            Verdict::Caught { by } => format!("caught by {}", by.join(", ")),
            Verdict::Missed => "MISSED: every test passed".into(),
            Verdict::Unviable { reason } => {
                format!("unviable (does not build): {}", reason.lines().last().unwrap_or(""))
            }
            Verdict::Timeout => "TIMEOUT".into(),
            Verdict::CatalogDrift { occurrences } => {
                format!("CATALOG-DRIFT: `find` occurs {occurrences} times, not once")
            }
        }
    }
}

/// Runs every selected battery of `catalogs` in the prepared scratch tree
/// of `runner`; `on_result` sees each mutant's result as it lands.
/// A `--battery` or `--mutant` that names nothing is an error listing
/// what exists (a misspelling used to select zero mutants and pass).
pub fn check_selection(catalogs: &[Catalog], selection: &Selection) -> Result<(), String> {
    let batteries: Vec<&str> = catalogs.iter().map(|c| c.battery.as_str()).collect();
    if let Some(b) = &selection.battery {
        if !batteries.contains(&b.as_str()) {
            return Err(format!("no battery `{b}`; the batteries are {}", batteries.join(", ")));
        }
    }
    let in_scope: Vec<&Catalog> = catalogs.iter().filter(|c| selection.takes(c)).collect();
    if let Some(id) = &selection.mutant {
        let ids: Vec<&str> = in_scope.iter().flat_map(|c| c.mutants.iter().map(|m| m.id.as_str())).collect();
        if !ids.contains(&id.as_str()) {
            return Err(format!("no mutant `{id}` in the selected batteries; their mutants are {}", ids.join(", ")));
        }
    }
    // Each name exists, yet together they may still select nothing (a
    // mutant outside the chosen shard): that run would pass on nothing.
    if in_scope.iter().map(|c| selected(c, selection).len()).sum::<usize>() == 0 {
        return Err(format!(
            "the selection (battery {:?}, mutant {:?}, shard {:?}) selects no mutant; \
             run without --shard to select one mutant by name",
            selection.battery, selection.mutant, selection.shard
        ));
    }
    Ok(())
}

/// The mutants of `catalog` that `selection` runs: the named one, or every
/// one, then the k-th of n shards (by catalog order).
fn selected<'a>(catalog: &'a Catalog, selection: &Selection) -> Vec<&'a Mutant> {
    catalog
        .mutants
        .iter()
        .filter(|m| selection.mutant.as_ref().is_none_or(|id| *id == m.id))
        .enumerate()
        .filter(|(i, _)| selection.shard.is_none_or(|(k, n)| i % n == k - 1))
        .map(|(_, m)| m)
        .collect()
}

pub fn run_all(
    runner: &Runner,
    catalogs: &[Catalog],
    selection: &Selection,
    mut on_result: impl FnMut(&MutantResult),
) -> Result<Report, String> {
    check_selection(catalogs, selection)?;
    let started = Instant::now();
    let mut report = Report::default();
    // Every build of the run selects the same packages (`build.rs`).
    let mut packages: Vec<String> = Vec::new();
    for p in catalogs.iter().flat_map(|c| &c.packages) {
        if !packages.contains(p) {
            packages.push(p.clone());
        }
    }
    for catalog in catalogs {
        if !selection.takes(catalog) {
            continue;
        }
        let mut preparation = Preparation { battery: catalog.battery.clone(), ..Preparation::default() };
        let phase = Instant::now();
        let index =
            runner.list(catalog, &packages).map_err(|e| format!("listing the tests of {}: {e}", catalog.battery))?;
        let listed = index.names();
        preparation.list = phase.elapsed().as_secs_f64();
        if listed.len() != catalog.tests {
            report.problems.push(Problem::FilterDrift {
                battery: catalog.battery.clone(),
                selected: listed.len(),
                declared: catalog.tests,
            });
            continue;
        }
        // A killer the filter does not select can never catch its mutant.
        let unselected: Vec<String> = catalog
            .mutants
            .iter()
            .flat_map(|m| m.killers.iter().map(move |k| (m, k)))
            .filter(|(_, k)| !listed.iter().any(|t| is_killer(t, k)))
            .map(|(m, k)| format!("{}: {k}", m.id))
            .collect();
        if !unselected.is_empty() {
            report.problems.push(Problem::UnselectedKiller { battery: catalog.battery.clone(), killers: unselected });
            continue;
        }
        let baseline_started = Instant::now();
        match runner.run(catalog, &packages, selection.baseline_limit)? {
            TestRun::Passed { count } if count == listed.len() => {}
            TestRun::Passed { count } => {
                report.problems.push(Problem::BaselineShort {
                    battery: catalog.battery.clone(),
                    passed: count,
                    selected: listed.len(),
                });
                continue;
            }
            other => {
                report
                    .problems
                    .push(Problem::BaselineRed { battery: catalog.battery.clone(), detail: format!("{other:?}") });
                continue;
            }
        }
        preparation.baseline = baseline_started.elapsed().as_secs_f64();
        let limit = selection.min_limit.max(baseline_started.elapsed() * 4);
        let phase = Instant::now();
        let selected = selected(catalog, selection);
        // The killers judge alone, so they must pass alone on the clean
        // tree, run as a mutant's are (a few at once): a killer that failed
        // there for its own reasons would "catch" every mutant it names.
        let mut killers = Vec::new();
        for k in selected.iter().filter_map(|m| index.killers(&m.killers)).flatten() {
            if !killers.contains(&k) {
                killers.push(k);
            }
        }
        let mut red = None;
        for group in killers.chunks(KILLERS_AT_ONCE) {
            match runner.run_killers(group, &packages, selection.baseline_limit)? {
                TestRun::Passed { count } if count == group.len() => {}
                other => red = Some(format!("declared killers run alone on the clean tree: {other:?}")),
            }
        }
        preparation.killers = phase.elapsed().as_secs_f64();
        report.preparations.push(preparation);
        if let Some(detail) = red {
            report.problems.push(Problem::BaselineRed { battery: catalog.battery.clone(), detail });
            continue;
        }
        for m in selected {
            let result = runner.mutant(catalog, &packages, &index, m, limit)?;
            on_result(&result);
            report.results.push(result);
        }
    }
    let files = runner.differences();
    if !files.is_empty() {
        report.problems.push(Problem::NotRestored { files });
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

//! Mutation batteries (INVARIANTS T1, T2): each catalog under
//! `conformance/mutations/` names a battery's packages, its test filter and
//! the exact number of tests the filter selects, and mutants (an exact
//! `find` text that must occur once, its `replace`, the invariants broken,
//! the tests expected to kill it). The runner works on a scratch copy of
//! the tree (never the user's), checks the baseline is green and the filter
//! selects the declared count, applies each mutant by rewriting the file,
//! runs its declared killers alone (the whole battery when they do not all
//! fail),
//! restores it by rewriting again (fresh mtime, so the build system cannot
//! skip the rebuild), and checks the scratch tree ends byte-identical to the
//! source.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::HarnessError;

mod battery;
mod build;
mod killers;
mod runner;
mod seed;

pub use battery::{check_selection, run_all, Problem, Report, Selection};
pub use killers::{Located, TestIndex};
pub use runner::{run_limited, RunLock, Runner, TestRun};
pub use seed::{seed_target, Seeded};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalog {
    pub battery: String,
    pub packages: Vec<String>,
    /// Only this test target of the packages (`--test NAME`): a battery
    /// whose tests live in one harness rebuilds only that binary per mutant.
    #[serde(default)]
    pub test_target: Option<String>,
    #[serde(default)]
    pub filter: String,
    /// Tests the battery leaves out (`--skip NAME`): ones that need set-up
    /// the mutation lane does not make and pin no invariant of the battery.
    #[serde(default)]
    pub skip: Vec<String>,
    /// The exact number of tests `filter` selects (FILTER-DRIFT otherwise).
    pub tests: usize,
    pub mutants: Vec<Mutant>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mutant {
    pub id: String,
    pub breaks: Vec<String>,
    pub file: String,
    pub find: String,
    pub replace: String,
    pub killers: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// Some test failed; `by` lists them.
    Caught {
        by: Vec<String>,
    },
    /// Every test passed under the mutant.
    Missed,
    /// The mutant does not build.
    Unviable {
        reason: String,
    },
    Timeout,
    /// `find` does not occur exactly once.
    CatalogDrift {
        occurrences: usize,
    },
}

/// Which tests judged a mutant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Its declared killers, each run alone, all failed.
    Killers,
    /// The whole battery ran (a killer passed, or could not be placed).
    Battery,
    /// Nothing ran: the mutant could not be applied (CATALOG-DRIFT).
    Nothing,
}

#[derive(Clone, Debug, Serialize)]
pub struct MutantResult {
    pub battery: String,
    pub id: String,
    pub breaks: Vec<String>,
    pub verdict: Verdict,
    pub scope: Scope,
    pub expected_killers: Vec<String>,
    /// Caught, but not by every declared killer.
    pub unexpected: bool,
    pub seconds: f64,
    /// Tracked files the tests themselves wrote under this mutant (e.g.
    /// proptest's regression file), put back before the next one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub restored: Vec<String>,
}

impl MutantResult {
    /// A result that fails the run: anything but a kill by the declared
    /// tests.
    pub fn is_failure(&self) -> bool {
        !matches!(self.verdict, Verdict::Caught { .. }) || self.unexpected
    }
}

pub fn load(root: &Path) -> Result<Vec<Catalog>, HarnessError> {
    let dir = root.join("conformance/mutations");
    let err = |path: &Path, reason: String| HarnessError::Suite { path: path.into(), reason };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| err(&dir, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut catalogs = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(|e| err(&path, e.to_string()))?;
        let de = serde_yaml_ng::Deserializer::from_str(&text);
        let c: Catalog = serde_path_to_error::deserialize(de)
            .map_err(|e| err(&path, format!("{} (at `{}`)", e.inner(), e.path())))?;
        let mut ids: Vec<&str> = c.mutants.iter().map(|m| m.id.as_str()).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(err(&path, format!("mutant id `{}` appears twice", w[0])));
        }
        if let Some(m) = c.mutants.iter().find(|m| m.killers.is_empty()) {
            return Err(err(
                &path,
                format!("mutant `{}` declares no killers: name the tests that must catch it", m.id),
            ));
        }
        catalogs.push(c);
    }
    Ok(catalogs)
}

/// Occurrences of `find` in `text` (non-overlapping).
pub fn occurrences(text: &str, find: &str) -> usize {
    if find.is_empty() {
        return 0;
    }
    text.matches(find).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// The shipped catalogs parse, meet the minimum sizes, and every
    /// `find` occurs exactly once in today's source (no CATALOG-DRIFT).
    #[test]
    fn shipped_catalogs_match_the_source() {
        let catalogs = load(&root()).unwrap();
        let count = |b: &str| catalogs.iter().find(|c| c.battery == b).map_or(0, |c| c.mutants.len());
        assert!(count("admission") >= 12 && count("lease") >= 10, "{} / {}", count("admission"), count("lease"));
        for c in &catalogs {
            for m in &c.mutants {
                let text = std::fs::read_to_string(root().join(&m.file)).unwrap();
                assert_eq!(occurrences(&text, &m.find), 1, "{}/{}: find drifted", c.battery, m.id);
                assert!(!m.killers.is_empty() && !m.breaks.is_empty(), "{}/{}", c.battery, m.id);
            }
        }
    }

    /// INVARIANTS T1 over the whole contract: every invariant listed in
    /// `conformance/mutation-coverage.yaml` is broken by some mutant of
    /// the batteries or is a gap named there with its reason; a gap a
    /// mutant now covers must leave the list; and no mutant names an
    /// invariant the list does not know (a misspelled `breaks`).
    #[test]
    fn every_invariant_has_a_mutant_or_a_named_gap() {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Coverage {
            invariants: Vec<String>,
            gaps: std::collections::BTreeMap<String, String>,
        }
        let text = std::fs::read_to_string(root().join("conformance/mutation-coverage.yaml")).unwrap();
        let coverage: Coverage = serde_yaml_ng::from_str(&text).unwrap();
        let catalogs = load(&root()).unwrap();
        let broken: std::collections::BTreeSet<&str> =
            catalogs.iter().flat_map(|c| &c.mutants).flat_map(|m| m.breaks.iter().map(String::as_str)).collect();
        for id in &coverage.invariants {
            match coverage.gaps.get(id) {
                Some(reason) => {
                    assert!(!broken.contains(id.as_str()), "{id} has a mutant now: remove its gap ({reason})");
                    assert!(!reason.trim().is_empty(), "the gap {id} needs its reason");
                }
                None => assert!(broken.contains(id.as_str()), "no mutant breaks {id}: add one or name the gap"),
            }
        }
        for id in coverage.gaps.keys() {
            assert!(coverage.invariants.contains(id), "gap {id} is not an invariant of the list");
        }
        for c in &catalogs {
            for m in &c.mutants {
                for id in &m.breaks {
                    assert!(
                        id == "T1" || coverage.invariants.contains(id),
                        "{}/{} breaks `{id}`, which mutation-coverage.yaml does not list",
                        c.battery,
                        m.id
                    );
                }
            }
        }
    }

    /// A second run cannot start while the lock is held; it can after.
    /// Issue 21: a misspelled `--battery` or `--mutant` is an error naming
    /// what exists, never a run of zero mutants that passes.
    #[test]
    fn a_selection_that_names_nothing_is_an_error() {
        let catalogs = load(&root()).unwrap();
        let select = |battery: Option<&str>, mutant: Option<&str>| Selection {
            battery: battery.map(str::to_string),
            mutant: mutant.map(str::to_string),
            ..Selection::default()
        };
        let first = &catalogs[0];
        assert!(check_selection(&catalogs, &select(Some(&first.battery), Some(&first.mutants[0].id))).is_ok());
        assert!(check_selection(&catalogs, &select(None, None)).is_ok());
        let err = check_selection(&catalogs, &select(Some("admision"), None)).unwrap_err();
        assert!(err.contains("no battery `admision`") && err.contains(&first.battery), "{err}");
        let err = check_selection(&catalogs, &select(None, Some("no-such-mutant"))).unwrap_err();
        assert!(err.contains("no mutant `no-such-mutant`"), "{err}");
        let other = catalogs.iter().find(|c| c.battery != first.battery).unwrap();
        let err = check_selection(&catalogs, &select(Some(&other.battery), Some(&first.mutants[0].id))).unwrap_err();
        assert!(err.contains("no mutant"), "a mutant of another battery is not in scope: {err}");
        // Both names exist, but the mutant is not in the shard chosen.
        let second = &first.mutants[1].id;
        let sharded = |k| Selection { shard: Some((k, 2)), ..select(Some(&first.battery), Some(second)) };
        assert!(check_selection(&catalogs, &sharded(1)).is_ok(), "a lone mutant is the first of its shards");
        let err = check_selection(&catalogs, &sharded(2)).unwrap_err();
        assert!(err.contains("selects no mutant"), "{err}");
    }

    #[test]
    fn the_lock_refuses_a_nested_run() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::take(dir.path()).unwrap();
        let second = RunLock::take(dir.path());
        assert!(second.is_err_and(|e| e.contains("another mutation run holds")));
        drop(first);
        assert!(RunLock::take(dir.path()).is_ok());
    }

    #[test]
    fn occurrences_count_exact_text() {
        assert_eq!(occurrences("a b a", "a"), 2);
        assert_eq!(occurrences("abc", "x"), 0);
        assert_eq!(occurrences("abc", ""), 0);
    }
}

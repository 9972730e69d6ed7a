//! A mutant's fast path: build and run only its declared killers.
//!
//! A battery's whole run rebuilds every test binary of its packages and runs
//! every selected test under each mutant; most of that time (links of test
//! binaries that hold no killer, tests that wait out a mutant they do not
//! judge) says nothing the declared killers do not. So each mutant first
//! builds only the test targets that hold its killers (`cargo test --no-run
//! -p PACKAGE --lib --test NAME`) and runs each killer in its own process
//! (`BINARY --exact NAME`, in the package directory as cargo would), all at
//! once: a killer that waits out a timeout under the mutant does not hold
//! up the others. When every killer fails, that is the verdict the catalog
//! claims. Anything else (a killer
//! that passes, or one the index cannot place) falls back to the whole
//! battery, whose run decides: a survivor is still MISSED and a kill by
//! another test still names that test.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::runner::{failed_tests, is_killer, passed_tests, Runner, Watched};
use super::TestRun;

/// One test of a battery and the cargo arguments that build and run only
/// the target holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    pub name: String,
    pub package: String,
    /// `--lib`, `--test NAME` or `--bin NAME`.
    pub target: Vec<String>,
    /// The test binary (its path does not change when it is rebuilt) and
    /// the package directory cargo runs it in.
    pub executable: PathBuf,
    pub dir: PathBuf,
}

/// Where each test a battery selects lives.
#[derive(Clone, Debug, Default)]
pub struct TestIndex(Vec<Located>);

impl TestIndex {
    pub(crate) fn new(located: Vec<Located>) -> Self {
        Self(located)
    }

    /// Full names of the tests placed, in the order listed.
    pub fn names(&self) -> Vec<String> {
        self.0.iter().map(|l| l.name.clone()).collect()
    }

    /// The tests `killers` name, or `None` when some killer names no test
    /// the index placed (the whole battery must decide then).
    pub fn killers(&self, killers: &[String]) -> Option<Vec<&Located>> {
        // No killers would be "every killer failed" with nothing run.
        if killers.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        for k in killers {
            let found: Vec<&Located> = self.0.iter().filter(|l| is_killer(&l.name, k)).collect();
            if found.is_empty() {
                return None;
            }
            for l in found {
                if !out.contains(&l) {
                    out.push(l);
                }
            }
        }
        Some(out)
    }
}

impl Runner {
    /// Builds the targets holding `killers` (under the applied mutant, or
    /// on the clean tree; the run's `packages`, see `build.rs`) and runs
    /// each killer in its own process, all within `limit`. `Failed` lists
    /// the killers whose runs reported them failed; `Passed` (none failed)
    /// counts those reported passed. A run that reports neither (it died
    /// first, or ran nothing) is in neither.
    pub fn run_killers(&self, killers: &[&Located], packages: &[String], limit: Duration) -> Result<TestRun, String> {
        let deadline = Instant::now() + limit;
        let mut targets: Vec<Vec<String>> = Vec::new();
        for k in killers {
            if !targets.contains(&k.target) {
                targets.push(k.target.clone());
            }
        }
        if let Err(decided) = self.build(packages, &targets, deadline)? {
            return Ok(decided);
        }
        // On an early return the runs still going are dropped, and a
        // dropped `Watched` kills its process group.
        let mut running = Vec::new();
        for k in killers {
            let mut c = self.test_command(&k.executable, &k.dir, &k.package);
            c.args(["--exact", "--test-threads=1", &k.name]);
            running.push((k.name.as_str(), Watched::spawn(c)?));
        }
        let (mut failed, mut passed) = (Vec::new(), 0);
        for (name, run) in running {
            let Some((status, stdout, _)) = run.wait(deadline)? else {
                return Ok(TestRun::TimedOut);
            };
            if !status.success() && failed_tests(&stdout).iter().any(|t| t == name) {
                failed.push(name.to_string());
            } else if status.success() && passed_tests(&stdout) == 1 {
                passed += 1;
            }
        }
        if failed.is_empty() {
            return Ok(TestRun::Passed { count: passed });
        }
        Ok(TestRun::Failed { tests: failed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every killer must be placed, by its full name or trailing segments;
    /// one the index lacks sends the mutant to the whole battery.
    #[test]
    fn killers_are_placed_or_refused() {
        let at = |name: &str, test: &str| Located {
            name: name.into(),
            package: "p".into(),
            target: vec!["--test".into(), test.into()],
            executable: PathBuf::from("/t").join(test),
            dir: PathBuf::from("/w/crates/p"),
        };
        let index = TestIndex(vec![at("tests::close_is_one_decision", "server"), at("eviction_is_strict", "faults")]);
        let placed = index.killers(&["close_is_one_decision".into(), "eviction_is_strict".into()]).unwrap();
        assert_eq!(placed.len(), 2);
        assert_eq!(placed[0].target, ["--test", "server"]);
        assert!(index.killers(&["is_one_decision".into()]).is_none(), "a fragment of a segment names nothing");
        assert!(index.killers(&["close_is_one_decision".into(), "missing".into()]).is_none());
        assert!(index.killers(&[]).is_none(), "no killers is never a kill by all of them");
        let twice = index.killers(&["close_is_one_decision".into(), "tests::close_is_one_decision".into()]).unwrap();
        assert_eq!(twice.len(), 1, "two names of one test run it once");
    }
}

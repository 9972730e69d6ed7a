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

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::runner::{failed_tests, full_name, is_killer, passed_tests, tail, Runner, Watched};
use super::{Catalog, TestRun};

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
    /// Places every test of `listed` (the battery's selection) in its
    /// package's test target: cargo names each test binary it builds
    /// (`--message-format=json`), and each binary lists its tests.
    pub fn index(&self, catalog: &Catalog, listed: &[String]) -> Result<TestIndex, String> {
        let mut located = Vec::new();
        for package in &catalog.packages {
            let mut c = self.cargo_command();
            c.args(["test", "--no-run", "--message-format=json", "-p", package]);
            if let Some(target) = &catalog.test_target {
                c.args(["--test", target]);
            }
            let out = c.output().map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("building the tests of {package}: {}", String::from_utf8_lossy(&out.stderr)));
            }
            for binary in test_binaries(&String::from_utf8_lossy(&out.stdout)) {
                let mut list = Command::new(&binary.executable);
                list.arg("--list").current_dir(&binary.dir).envs(self.envs.iter().map(|(k, v)| (k, v)));
                let out = list.output().map_err(|e| format!("{}: {e}", binary.executable.display()))?;
                let names = String::from_utf8_lossy(&out.stdout);
                for name in names.lines().filter_map(|l| l.strip_suffix(": test")).map(full_name) {
                    if listed.contains(&name) {
                        located.push(Located {
                            name,
                            package: package.clone(),
                            target: binary.target.clone(),
                            executable: binary.executable.clone(),
                            dir: binary.dir.clone(),
                        });
                    }
                }
            }
        }
        Ok(TestIndex(located))
    }

    /// Builds the targets holding `killers` (under the applied mutant, or
    /// on the clean tree) and runs each killer in its own process, all
    /// within `limit`. `Failed` lists the killers whose runs reported them
    /// failed; `Passed` (none failed) counts those reported passed. A run
    /// that reports neither (it died first, or ran nothing) is in neither.
    pub fn run_killers(&self, killers: &[&Located], limit: Duration) -> Result<TestRun, String> {
        let deadline = Instant::now() + limit;
        let mut targets: BTreeMap<&str, BTreeSet<&[String]>> = BTreeMap::new();
        for k in killers {
            targets.entry(k.package.as_str()).or_default().insert(k.target.as_slice());
        }
        for (package, targets) in targets {
            let mut build = self.cargo_command();
            build.args(["test", "--no-run", "-p", package]);
            for target in targets {
                build.args(target);
            }
            match Watched::spawn(build)?.wait(deadline)? {
                None => return Ok(TestRun::TimedOut),
                Some((status, _, stderr)) if !status.success() => {
                    return Ok(TestRun::BuildFailed { tail: tail(&stderr) })
                }
                Some(_) => {}
            }
        }
        // On an early return the runs still going are dropped, and a
        // dropped `Watched` kills its process group.
        let mut running = Vec::new();
        for k in killers {
            let mut c = Command::new(&k.executable);
            c.args(["--exact", "--test-threads=1", &k.name]).current_dir(&k.dir);
            c.envs(self.envs.iter().map(|(k, v)| (k, v)));
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

/// A test binary cargo built: its executable, the package directory cargo
/// runs it in, and the arguments that select its target.
struct TestBinary {
    executable: PathBuf,
    dir: PathBuf,
    target: Vec<String>,
}

/// The test binaries in the JSON messages of `cargo test --no-run
/// --message-format=json` (dependencies' artifacts are not test builds).
fn test_binaries(messages: &str) -> Vec<TestBinary> {
    let mut out = Vec::new();
    for line in messages.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(executable), Some(manifest)) = (msg["executable"].as_str(), msg["manifest_path"].as_str()) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let name = msg["target"]["name"].as_str().unwrap_or_default().to_string();
        let target = match msg["target"]["kind"][0].as_str() {
            Some("lib") => vec!["--lib".to_string()],
            Some("test") => vec!["--test".to_string(), name],
            Some("bin") => vec!["--bin".to_string(), name],
            // Benches and examples hold no battery test.
            _ => continue,
        };
        let dir = PathBuf::from(manifest).parent().map(PathBuf::from).unwrap_or_default();
        out.push(TestBinary { executable: executable.into(), dir, target });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only test builds of the workspace's targets are test binaries, each
    /// with the arguments that select it: a dependency's library or a
    /// build script must never be run as a battery's test.
    #[test]
    fn test_binaries_come_from_test_artifacts() {
        let messages = [
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/a/Cargo.toml","target":{"kind":["lib"],"name":"a"},"profile":{"test":true},"executable":"/t/a-1"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/a/Cargo.toml","target":{"kind":["test"],"name":"server"},"profile":{"test":true},"executable":"/t/server-2"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/r/dep/Cargo.toml","target":{"kind":["lib"],"name":"dep"},"profile":{"test":false},"executable":null}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/a/Cargo.toml","target":{"kind":["bin"],"name":"tool"},"profile":{"test":false},"executable":"/t/tool"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "not json",
        ]
        .join("\n");
        let found = test_binaries(&messages);
        let targets: Vec<&[String]> = found.iter().map(|b| b.target.as_slice()).collect();
        assert_eq!(targets, [&["--lib".to_string()][..], &["--test".to_string(), "server".to_string()][..]]);
        assert_eq!(found[1].executable, PathBuf::from("/t/server-2"));
        assert_eq!(found[1].dir, PathBuf::from("/w/crates/a"));
    }

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

//! The scratch build of a mutation run: one `cargo test --no-run` over one
//! set of packages, and the test binaries it names.
//!
//! Cargo resolves a dependency's features over the packages a command
//! selects (`-p`), so `cargo test -p engine` and `cargo test -p engine -p
//! server` build different copies of every crate whose features the two
//! selections change — serde, syn, tokenizers, and the workspace crates
//! above them. A run that selected each battery's packages, then each
//! package alone, built up to four copies of a crate (about a third of the
//! mutation lane's time). Every build of a run therefore selects the same
//! packages (the union of every catalog's), narrows only by target, and
//! runs the tests from the binaries it names.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::runner::{tail, Watched};
use super::{Catalog, Runner, TestRun};

/// A test binary cargo built: its package, executable, the package
/// directory cargo runs it in, and the arguments that select its target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TestBinary {
    pub package: String,
    pub executable: PathBuf,
    pub dir: PathBuf,
    pub target: Vec<String>,
}

impl TestBinary {
    /// Its run, as [`Runner::test_command`] makes it.
    pub fn command(&self, runner: &Runner) -> Command {
        runner.test_command(&self.executable, &self.dir, &self.package)
    }

    /// Whether `catalog` runs this binary: one of its packages, and its
    /// one test target when it names one.
    pub fn belongs_to(&self, catalog: &Catalog) -> bool {
        catalog.packages.contains(&self.package)
            && catalog.test_target.as_ref().is_none_or(|t| self.target == ["--test", t.as_str()])
    }
}

impl Runner {
    /// Builds the test targets `targets` names (all of them when empty) of
    /// `packages`, by `deadline`: the binaries, or the run that decides
    /// instead (a build that failed, or ran out of time).
    pub(crate) fn build(
        &self,
        packages: &[String],
        targets: &[Vec<String>],
        deadline: Instant,
    ) -> Result<Result<Vec<TestBinary>, TestRun>, String> {
        let mut c = self.cargo_command();
        c.args(["test", "--no-run", "--message-format=json"]);
        for p in packages {
            c.args(["-p", p]);
        }
        for t in targets {
            c.args(t);
        }
        Ok(match Watched::spawn(c)?.wait(deadline)? {
            None => Err(TestRun::TimedOut),
            Some((status, _, stderr)) if !status.success() => Err(TestRun::BuildFailed { tail: tail(&stderr) }),
            Some((_, stdout, _)) => Ok(test_binaries(&stdout)),
        })
    }

    /// A test binary, to run as `cargo test` would: in its package
    /// directory, with the package's `CARGO_MANIFEST_DIR` and
    /// `CARGO_PKG_NAME`, and the runner's environment.
    pub(crate) fn test_command(&self, executable: &Path, dir: &Path, package: &str) -> Command {
        let mut c = Command::new(executable);
        c.current_dir(dir)
            .env("CARGO_MANIFEST_DIR", dir)
            .env("CARGO_PKG_NAME", package)
            .envs(self.envs.iter().map(|(k, v)| (k, v)));
        c
    }
}

/// The battery's selection as test-binary arguments: its filter and skips.
pub(crate) fn selection_args(catalog: &Catalog) -> Vec<String> {
    let mut args = Vec::new();
    if !catalog.filter.is_empty() {
        args.push(catalog.filter.clone());
    }
    for name in &catalog.skip {
        args.extend(["--skip".to_string(), name.clone()]);
    }
    args
}

/// The package a `package_id` names: `path+file:///w/crates/a#0.1.0`
/// (the directory's name is the package's) or
/// `path+file:///w/crates/a#other@0.1.0`.
fn package_name(id: &str) -> Option<String> {
    let (url, fragment) = id.rsplit_once('#')?;
    match fragment.split_once('@') {
        Some((name, _version)) => Some(name.to_string()),
        None => url.trim_end_matches('/').rsplit('/').next().map(str::to_string),
    }
}

/// The test binaries in the JSON messages of `cargo test --no-run
/// --message-format=json` (dependencies' artifacts are not test builds).
pub(crate) fn test_binaries(messages: &str) -> Vec<TestBinary> {
    let mut out = Vec::new();
    for line in messages.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(executable), Some(manifest), Some(package)) = (
            msg["executable"].as_str(),
            msg["manifest_path"].as_str(),
            msg["package_id"].as_str().and_then(package_name),
        ) else {
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
        out.push(TestBinary { package, executable: executable.into(), dir, target });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only test builds of the workspace's targets are test binaries, each
    /// with its package and the arguments that select it: a dependency's
    /// library or a build script must never be run as a battery's test,
    /// and a binary of another package must never count for a battery.
    #[test]
    fn test_binaries_come_from_test_artifacts() {
        let messages = [
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/a#0.1.0","manifest_path":"/w/crates/a/Cargo.toml","target":{"kind":["lib"],"name":"a"},"profile":{"test":true},"executable":"/t/a-1"}"#,
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/x#a-server@0.1.0","manifest_path":"/w/crates/x/Cargo.toml","target":{"kind":["test"],"name":"server"},"profile":{"test":true},"executable":"/t/server-2"}"#,
            r#"{"reason":"compiler-artifact","package_id":"registry+https://github.com/rust-lang/crates.io-index#dep@1.0.0","manifest_path":"/r/dep/Cargo.toml","target":{"kind":["lib"],"name":"dep"},"profile":{"test":false},"executable":null}"#,
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/a#0.1.0","manifest_path":"/w/crates/a/Cargo.toml","target":{"kind":["bin"],"name":"tool"},"profile":{"test":false},"executable":"/t/tool"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "not json",
        ]
        .join("\n");
        let found = test_binaries(&messages);
        let targets: Vec<&[String]> = found.iter().map(|b| b.target.as_slice()).collect();
        assert_eq!(targets, [&["--lib".to_string()][..], &["--test".to_string(), "server".to_string()][..]]);
        assert_eq!((found[0].package.as_str(), found[1].package.as_str()), ("a", "a-server"));
        assert_eq!(found[1].executable, PathBuf::from("/t/server-2"));
        assert_eq!(found[1].dir, PathBuf::from("/w/crates/x"));
    }

    /// A battery runs the binaries of its own packages, and of its one
    /// test target when it names one.
    #[test]
    fn a_battery_runs_only_its_own_binaries() {
        let binary = |package: &str, target: &[&str]| TestBinary {
            package: package.into(),
            executable: PathBuf::from("/t/x"),
            dir: PathBuf::from("/w"),
            target: target.iter().map(|s| s.to_string()).collect(),
        };
        let mut catalog = Catalog {
            battery: "b".into(),
            packages: vec!["a".into()],
            test_target: None,
            filter: String::new(),
            skip: Vec::new(),
            tests: 0,
            mutants: Vec::new(),
        };
        assert!(binary("a", &["--lib"]).belongs_to(&catalog));
        assert!(!binary("b", &["--lib"]).belongs_to(&catalog));
        catalog.test_target = Some("conformance".into());
        assert!(binary("a", &["--test", "conformance"]).belongs_to(&catalog));
        assert!(!binary("a", &["--lib"]).belongs_to(&catalog));
        assert!(!binary("a", &["--test", "other"]).belongs_to(&catalog));
    }
}

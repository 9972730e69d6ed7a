//! The scratch tree and the cargo runs of a mutation battery.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::build::selection_args;
use super::killers::{Located, TestIndex};
use super::{occurrences, Catalog, Mutant, MutantResult, Scope, Verdict};

/// Holds `target/mutants/lock` for one run; a second run refuses to start.
pub struct RunLock(PathBuf);

impl RunLock {
    pub fn take(dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let path = dir.join("lock");
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                use std::io::Write;
                let _ = writeln!(f, "{}", std::process::id());
                Ok(Self(path))
            }
            Err(_) => Err(format!(
                "another mutation run holds {} (pid {}); wait for it, or delete the file if that run is gone",
                path.display(),
                std::fs::read_to_string(&path).unwrap_or_default().trim()
            )),
        }
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Outcome of one test run.
#[derive(Debug, PartialEq, Eq)]
pub enum TestRun {
    Passed { count: usize },
    Failed { tests: Vec<String> },
    BuildFailed { tail: String },
    TimedOut,
}

/// Runs cargo in a scratch tree with a persistent target directory.
pub struct Runner {
    pub source: PathBuf,
    pub scratch: PathBuf,
    pub target_dir: PathBuf,
    pub envs: Vec<(String, String)>,
    /// Directories under the source's `target/` the tests read (installed
    /// runtimes), linked into the scratch tree.
    pub shared_target: Vec<String>,
    /// `--config` values for every cargo run in the scratch tree (the
    /// scratch build's own profile; never the user's).
    pub cargo_config: Vec<String>,
    /// The main build's target directory: its third-party units seed
    /// `target_dir` before the first run (`seed.rs`).
    pub seed_from: Option<PathBuf>,
    /// The tracked files as copied, to verify restores against (the source
    /// may change while a run is in progress).
    snapshot: std::collections::BTreeMap<String, Vec<u8>>,
}

impl Runner {
    pub fn new(source: PathBuf, scratch: PathBuf, target_dir: PathBuf) -> Self {
        Self {
            source,
            scratch,
            target_dir,
            envs: Vec::new(),
            shared_target: Vec::new(),
            cargo_config: Vec::new(),
            seed_from: None,
            snapshot: Default::default(),
        }
    }

    /// Copies every file git tracks (as it is in the working tree) into a
    /// fresh scratch directory, and remembers the bytes copied.
    pub fn prepare(&mut self) -> Result<(), String> {
        let _ = std::fs::remove_dir_all(&self.scratch);
        self.snapshot.clear();
        for rel in tracked_files(&self.source)? {
            let (from, to) = (self.source.join(&rel), self.scratch.join(&rel));
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
            }
            if let Ok(bytes) = std::fs::read(&from) {
                std::fs::write(&to, &bytes).map_err(|e| format!("{}: {e}", to.display()))?;
                self.snapshot.insert(rel, bytes);
            }
        }
        if let Some(from) = &self.seed_from {
            let seeded = super::seed_target(&from.join("debug"), &self.target_dir.join("debug"))?;
            if let Some(why) = &seeded.skipped {
                println!("==> not seeding {}: {why}", self.target_dir.display());
            } else if seeded != super::Seeded::default() {
                println!(
                    "==> seeded {} from {}: {} artifacts linked, {} files copied",
                    self.target_dir.display(),
                    from.display(),
                    seeded.linked,
                    seeded.copied
                );
            }
        }
        for dir in &self.shared_target {
            let (from, to) = (self.source.join("target").join(dir), self.scratch.join("target").join(dir));
            if from.is_dir() {
                std::fs::create_dir_all(self.scratch.join("target")).map_err(|e| e.to_string())?;
                link_dir(&from, &to)?;
            }
        }
        Ok(())
    }

    /// Files whose scratch copy differs from what was copied, and files that
    /// were not copied at all (a test that writes a new file into the tree):
    /// should be none. `target/` (the linked runtimes) is not the tree.
    pub fn differences(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .snapshot
            .iter()
            .filter(|(rel, bytes)| std::fs::read(self.scratch.join(rel)).ok().as_ref() != Some(*bytes))
            .map(|(rel, _)| rel.clone())
            .collect();
        let mut stack = vec![self.scratch.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries.flatten() {
                let path = e.path();
                let Ok(rel) = path.strip_prefix(&self.scratch) else { continue };
                let rel = rel.to_string_lossy().to_string();
                let kind = e.file_type();
                if kind.as_ref().is_ok_and(|k| k.is_dir()) {
                    if rel != "target" && rel != ".git" {
                        stack.push(path);
                    }
                } else if !self.snapshot.contains_key(&rel) && e.file_name() != "Cargo.lock" {
                    // (cargo writes a lock file beside a manifest that has
                    // none; that is the build, not a test)
                    out.push(rel);
                }
            }
        }
        out.sort();
        out
    }

    /// Cargo in the scratch tree, on the runner's target directory and
    /// environment.
    pub(crate) fn cargo_command(&self) -> Command {
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.current_dir(&self.scratch).env("CARGO_TARGET_DIR", &self.target_dir);
        for value in &self.cargo_config {
            c.args(["--config", value]);
        }
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        c
    }

    /// The tests the battery's filter selects (building the run's
    /// `packages` first), each placed in its package's test target: cargo
    /// names each test binary it builds (`--message-format=json`), and each
    /// binary lists its tests.
    pub fn list(&self, catalog: &Catalog, packages: &[String]) -> Result<TestIndex, String> {
        let binaries =
            self.build(packages, &catalog_targets(catalog), unhurried())?.map_err(|run| format!("{run:?}"))?;
        let mut located = Vec::new();
        for b in binaries.iter().filter(|b| b.belongs_to(catalog)) {
            let out = b.command(self).arg("--list").args(selection_args(catalog)).output();
            let out = out.map_err(|e| format!("{}: {e}", b.executable.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "{} --list: {}",
                    b.executable.display(),
                    tail(&String::from_utf8_lossy(&out.stderr))
                ));
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            for name in stdout.lines().filter_map(|l| l.strip_suffix(": test")).map(full_name) {
                located.push(Located {
                    name,
                    package: b.package.clone(),
                    target: b.target.clone(),
                    executable: b.executable.clone(),
                    dir: b.dir.clone(),
                });
            }
        }
        Ok(TestIndex::new(located))
    }

    /// Builds and runs the battery's tests, every binary even after one
    /// fails (so the killers are complete), all within `limit`.
    pub fn run(&self, catalog: &Catalog, packages: &[String], limit: Duration) -> Result<TestRun, String> {
        let deadline = Instant::now() + limit;
        let binaries = match self.build(packages, &catalog_targets(catalog), deadline)? {
            Ok(binaries) => binaries,
            Err(decided) => return Ok(decided),
        };
        let (mut failed, mut passed, mut green) = (Vec::new(), 0, true);
        for b in binaries.iter().filter(|b| b.belongs_to(catalog)) {
            let mut c = b.command(self);
            c.arg("--test-threads=2").args(selection_args(catalog));
            let Some((status, stdout, _)) = Watched::spawn(c)?.wait(deadline)? else {
                return Ok(TestRun::TimedOut);
            };
            passed += passed_tests(&stdout);
            if !status.success() {
                // A binary that died without naming a failed test still
                // failed: the verdict is a kill by no named test.
                green = false;
                failed.extend(failed_tests(&stdout));
            }
        }
        Ok(if green { TestRun::Passed { count: passed } } else { TestRun::Failed { tests: failed } })
    }

    /// Applies `m`, runs, restores. The file is rewritten both ways (fresh
    /// mtime), and restoring is checked against the source bytes.
    /// The mutant's declared killers run first, alone (`killers.rs`); the
    /// whole battery runs only when they do not all fail.
    pub fn mutant(
        &self,
        catalog: &Catalog,
        packages: &[String],
        index: &TestIndex,
        m: &Mutant,
        limit: Duration,
    ) -> Result<MutantResult, String> {
        let started = Instant::now();
        let path = self.scratch.join(&m.file);
        let original = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", m.file))?;
        let n = occurrences(&original, &m.find);
        let mut scope = Scope::Nothing;
        let (verdict, unexpected) = if n != 1 {
            (Verdict::CatalogDrift { occurrences: n }, false)
        } else {
            scope = Scope::Killers;
            write_fresh(&path, &original.replacen(&m.find, &m.replace, 1))?;
            // Only a kill by every killer, a build failure or a timeout
            // decides here; anything else (a killer that passed, one the
            // index could not place, a run that could not start) goes to
            // the whole battery, with a limit of its own.
            let outcome = match index.killers(&m.killers).map(|k| (k.len(), self.run_killers(&k, packages, limit))) {
                Some((n, Ok(TestRun::Failed { tests }))) if tests.len() == n => Some(Ok(TestRun::Failed { tests })),
                Some((_, Ok(decided @ (TestRun::BuildFailed { .. } | TestRun::TimedOut)))) => Some(Ok(decided)),
                _ => None,
            };
            let outcome = outcome.unwrap_or_else(|| {
                scope = Scope::Battery;
                self.run(catalog, packages, limit)
            });
            write_fresh(&path, &original)?;
            match outcome? {
                TestRun::Passed { .. } => (Verdict::Missed, false),
                TestRun::Failed { tests } => {
                    let unexpected = !m.killers.iter().all(|k| tests.iter().any(|t| is_killer(t, k)));
                    (Verdict::Caught { by: tests }, unexpected)
                }
                TestRun::BuildFailed { tail } => (Verdict::Unviable { reason: tail }, false),
                TestRun::TimedOut => (Verdict::Timeout, false),
            }
        };
        self.finish(catalog, m, started, (verdict, scope), unexpected)
    }

    /// Checks the tree is back to its source and reports the verdict.
    fn finish(
        &self,
        catalog: &Catalog,
        m: &Mutant,
        started: Instant,
        (verdict, scope): (Verdict, Scope),
        unexpected: bool,
    ) -> Result<MutantResult, String> {
        let path = self.scratch.join(&m.file);
        if std::fs::read(&path).ok().as_ref() != self.snapshot.get(&m.file) {
            return Err(format!("{} was not restored byte for byte", m.file));
        }
        // A failing test may write into the tree (proptest records its
        // failing case): the next mutant must start from the source again.
        let restored = self.differences();
        for rel in &restored {
            let path = self.scratch.join(rel);
            match self.snapshot.get(rel) {
                Some(bytes) => std::fs::write(&path, bytes).map_err(|e| format!("{rel}: {e}"))?,
                // Written by a test, never part of the tree.
                None => std::fs::remove_file(&path).map_err(|e| format!("{rel}: {e}"))?,
            }
        }
        Ok(MutantResult {
            battery: catalog.battery.clone(),
            id: m.id.clone(),
            breaks: m.breaks.clone(),
            verdict,
            scope,
            expected_killers: m.killers.clone(),
            unexpected,
            seconds: started.elapsed().as_secs_f64(),
            restored,
        })
    }
}

/// The deadline of a build that preparation waits out however long it
/// takes (a mutant's builds have limits; listing and indexing do not).
pub(super) fn unhurried() -> Instant {
    Instant::now() + Duration::from_secs(24 * 3600)
}

/// The targets a battery's builds name: its one test target, or all.
pub(super) fn catalog_targets(catalog: &Catalog) -> Vec<Vec<String>> {
    catalog.test_target.iter().map(|t| vec!["--test".to_string(), t.clone()]).collect()
}

/// A test's name as libtest (or libtest-mimic, after its `[kind]` tag)
/// prints it: `module::path::name`.
pub(crate) fn full_name(printed: &str) -> String {
    let printed = printed.trim();
    let untagged = match printed.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or(printed, |(_, name)| name.trim()),
        None => printed,
    };
    untagged.to_string()
}

/// Whether the failed test `full` is the catalog's killer `killer`: the
/// same name, or its trailing path segments (`name`, or
/// `tiny-llama-f16::decomposed::native-cpu::long` when only the package
/// and export tell the harness's tests apart).
pub(crate) fn is_killer(full: &str, killer: &str) -> bool {
    full == killer || full.strip_suffix(killer).is_some_and(|head| head.ends_with("::"))
}

/// The tests a libtest (or libtest-mimic) run printed as failed.
pub(crate) fn failed_tests(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("test ").and_then(|r| r.strip_suffix(" ... FAILED")))
        .map(full_name)
        .collect()
}

/// How many tests a run printed as passed.
pub(crate) fn passed_tests(stdout: &str) -> usize {
    stdout.lines().filter(|l| l.starts_with("test ") && l.ends_with(" ... ok")).count()
}

/// A child in its own process group whose output is read as it runs (a
/// full pipe must not stall it). Dropped before it was waited for, it
/// kills the whole group: no early return leaves a test running.
pub(crate) struct Watched {
    child: Child,
    readers: Option<(std::thread::JoinHandle<String>, std::thread::JoinHandle<String>)>,
    waited: bool,
}

impl Watched {
    /// Runs `command` with its output captured (returned by [`Watched::wait`]).
    pub(crate) fn spawn(command: Command) -> Result<Self, String> {
        Self::start(command, true)
    }

    /// Runs `command` with its output where this process's goes (a long
    /// run the user watches); [`Watched::wait`] returns empty output.
    pub(crate) fn spawn_inherited(command: Command) -> Result<Self, String> {
        Self::start(command, false)
    }

    fn start(mut command: Command, captured: bool) -> Result<Self, String> {
        own_process_group(&mut command);
        if !captured {
            let child = command.spawn().map_err(|e| e.to_string())?;
            return Ok(Self { child, readers: None, waited: false });
        }
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| e.to_string())?;
        let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
        let readers =
            (std::thread::spawn(move || read_all(out.as_mut())), std::thread::spawn(move || read_all(err.as_mut())));
        Ok(Self { child, readers: Some(readers), waited: false })
    }

    /// Its status, stdout and stderr; `None` when `deadline` passed first
    /// and the whole process group was killed.
    pub(crate) fn wait(
        mut self,
        deadline: Instant,
    ) -> Result<Option<(std::process::ExitStatus, String, String)>, String> {
        let status = loop {
            match self.child.try_wait().map_err(|e| e.to_string())? {
                Some(s) => break s,
                // The drop kills the group. The output is not needed, and a
                // survivor of the kill could hold the pipes open: the
                // readers are left to finish on their own.
                None if Instant::now() > deadline => return Ok(None),
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        self.waited = true;
        let (out, err) = self.readers.take().map_or((String::new(), String::new()), |(out, err)| {
            (out.join().unwrap_or_default(), err.join().unwrap_or_default())
        });
        Ok(Some((status, out, err)))
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if !self.waited {
            kill_tree(&mut self.child);
        }
    }
}

/// Runs `command` in its own process group for at most `limit`: its exit
/// status, or `None` when the limit killed the whole group.
pub fn run_limited(command: Command, limit: Duration) -> Result<Option<std::process::ExitStatus>, String> {
    Ok(Watched::spawn_inherited(command)?.wait(Instant::now() + limit)?.map(|(status, _, _)| status))
}

/// Cargo runs the test binary as its own child: killing cargo alone would
/// leave a spinning mutant behind, so each run gets a process group and a
/// timeout kills the whole group.
#[cfg(unix)]
fn own_process_group(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
}

#[cfg(not(unix))]
fn own_process_group(_command: &mut Command) {}

fn kill_tree(child: &mut Child) {
    #[cfg(unix)]
    {
        // The group id is the child's pid (`process_group(0)`).
        let _ = Command::new("kill").args(["-s", "KILL", "--", &format!("-{}", child.id())]).status();
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(unix)]
fn link_dir(from: &Path, to: &Path) -> Result<(), String> {
    std::os::unix::fs::symlink(from, to).map_err(|e| format!("linking {}: {e}", to.display()))
}

#[cfg(not(unix))]
fn link_dir(from: &Path, _to: &Path) -> Result<(), String> {
    Err(format!("cannot link {} into the scratch tree on this platform", from.display()))
}

fn read_all(r: Option<&mut impl std::io::Read>) -> String {
    let mut s = String::new();
    if let Some(r) = r {
        let _ = r.read_to_string(&mut s);
    }
    s
}

/// Writes by truncating and rewriting the file, so its mtime is new.
fn write_fresh(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

fn tracked_files(root: &Path) -> Result<Vec<String>, String> {
    let out = Command::new("git").args(["ls-files", "-z"]).current_dir(root).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("git ls-files failed: the mutation runner needs a git checkout".into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).split('\0').filter(|s| !s.is_empty()).map(str::to_string).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killer names a test by its full path or by trailing whole
    /// segments, never by a fragment of a segment: `ok` must not catch
    /// through `tests::not_ok`, nor `long` through `native-cpu::belong`
    /// (a killer matching more than it names would let a mutant pass as
    /// caught by the wrong test, INVARIANTS T2).
    #[test]
    fn killers_match_whole_trailing_segments() {
        let name = full_name(" [parity] parity::tiny-llama-f16::decomposed::native-cpu::long ");
        assert_eq!(name, "parity::tiny-llama-f16::decomposed::native-cpu::long");
        assert_eq!(full_name("tests::ok_clamp_caps_at_budget"), "tests::ok_clamp_caps_at_budget");
        for killer in ["long", "native-cpu::long", "tiny-llama-f16::decomposed::native-cpu::long", &name] {
            assert!(is_killer(&name, killer), "{killer}");
        }
        for killer in ["ong", "cpu::long", "tiny-llama-gqa::decomposed::native-cpu::long", "parity::tiny"] {
            assert!(!is_killer(&name, killer), "{killer}");
        }
        assert!(!is_killer("tests::not_ok", "ok"));
    }
}

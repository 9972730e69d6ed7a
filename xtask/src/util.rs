use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (xtask lives one level below it).
/// The repository root: where this binary was built from, or, for a binary
/// carried to another machine (the GPU check), the current directory when
/// it is a checkout of this repository.
pub fn root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default();
    let is_checkout = |p: &Path| p.join("conformance/lanes.yaml").is_file();
    if is_checkout(&built) {
        return built;
    }
    match std::env::current_dir() {
        Ok(dir) if is_checkout(&dir) => dir,
        _ => built,
    }
}

pub fn target() -> PathBuf {
    root().join("target")
}

/// Field `name` of a `/proc/cpuinfo` text (its first processor's), empty
/// where it has none.
pub fn cpuinfo_field<'a>(info: &'a str, name: &str) -> &'a str {
    info.lines()
        .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
        .and_then(|l| l.split_once(':'))
        .map_or("", |(_, v)| v.trim())
}

/// The commit HEAD names (`unknown` outside a git checkout).
/// HEAD's commit, marked `-dirty` when the tree differs from it (changed
/// or untracked files): a report must not claim a commit it did not test.
pub fn commit() -> String {
    commit_of(&root())
}

fn commit_of(dir: &std::path::Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(head) = git(&["rev-parse", "HEAD"]) else { return "unknown".into() };
    match git(&["status", "--porcelain"]) {
        Some(changes) if !changes.is_empty() => format!("{head}-dirty"),
        _ => head,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21: a report stamped from a modified tree says so.
    #[test]
    fn a_dirty_tree_is_marked() {
        let dir = tempfile::tempdir().unwrap();
        let git = |args: &[&str]| {
            let ok = Command::new("git").args(args).current_dir(dir.path()).output().unwrap().status.success();
            assert!(ok, "git {args:?}");
        };
        git(&["init", "-q"]);
        std::fs::write(dir.path().join("a.txt"), "one").unwrap();
        git(&["add", "a.txt"]);
        git(&["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]);
        let clean = commit_of(dir.path());
        assert_eq!(clean.len(), 40, "{clean}");
        std::fs::write(dir.path().join("a.txt"), "two").unwrap();
        assert_eq!(commit_of(dir.path()), format!("{clean}-dirty"));
        git(&["checkout", "-q", "a.txt"]);
        std::fs::write(dir.path().join("new.txt"), "x").unwrap();
        assert_eq!(commit_of(dir.path()), format!("{clean}-dirty"), "untracked files count");
    }
}

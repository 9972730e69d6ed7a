//! The golden records of `onnx-genai check --golden DIR`: where each
//! prompt's record lives, the stage that writes a missing one from ONNX
//! Runtime and judges every backend against it, and the whole-or-nothing
//! write that keeps a record from being left truncated.

use std::path::{Path, PathBuf};
use std::time::Instant;

use onnx_genai_package::Package;

use super::{finish, native_backends, result, CheckOptions, Verdict};
use crate::cases::REFERENCE;
use crate::run::{open_backend, CheckResult};
use crate::tolerance::Tier;

/// The golden record of prompt `i` of the package at `package_dir` (named
/// `name`) in `dir`: `<stem>__prompt<i>.snap` ([`golden_stem`]), in the
/// format of the repository's own goldens (`golden/decode/`).
fn golden_path(dir: &Path, name: &str, package_dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("{}__prompt{i}.snap", golden_stem(name, package_dir)))
}

/// `<name>__<directory>`: two exports of one model are two records. Only
/// ASCII letters, digits, `-` and `_` are kept (anything else becomes
/// `_`), so no manifest name can place a file outside the records'
/// directory — and two packages can share a stem (`a/model` and
/// `b/model`), which [`super::check_dirs`] refuses.
pub(super) fn golden_stem(name: &str, package_dir: &Path) -> String {
    let safe = |s: &str| -> String {
        let kept: String =
            s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') { c } else { '_' }).collect();
        kept.trim_start_matches('_').to_string()
    };
    let dir_name = package_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{}__{}", safe(name), safe(&dir_name))
}

/// `--golden DIR`: per prompt, ONNX Runtime's greedy record is written
/// when DIR has none; then every backend's run is judged against the
/// record (token ids and text exactly, the recorded top-5 logits at the
/// tier).
/// `near_ties`: the (backend, prompt) pairs parity found parted only at a
/// near-tie — their tokens may leave the record there without failing.
pub(super) fn golden_stage(
    package: &Package,
    (name, package_dir): (&str, &Path),
    dir: &Path,
    prompts: &[(String, Vec<u32>)],
    opts: &CheckOptions,
    tier: Tier,
    near_ties: &[(String, usize)],
) -> Vec<(CheckResult, Verdict)> {
    let steps = opts.steps.max(1);
    let mut at: Vec<usize> = vec![0, 1, steps / 2, steps - 1];
    at.retain(|s| *s < steps);
    at.sort_unstable();
    at.dedup();
    // Each backend opened once for every prompt (a native compile, an ONNX
    // Runtime session: once a prompt multiplied them by the prompts file)
    // and one at a time (a large model's backends side by side multiply
    // its memory). The reference runs first, so every record a missing
    // one makes is written before another backend is judged against it;
    // the results are given prompt by prompt.
    let mut by_prompt: Vec<Vec<(CheckResult, Verdict)>> = prompts.iter().map(|_| Vec::new()).collect();
    for backend in std::iter::once(REFERENCE.to_string()).chain(native_backends()) {
        let mut decoder = open_backend(&backend, package, opts.threads).map_err(|e| e.to_string());
        for (i, (text, tokens)) in prompts.iter().enumerate() {
            let g = crate::cases::GoldenFile {
                prompt: text.clone(),
                max_new_tokens: steps,
                top5_at_steps: at.clone(),
                decimals: 5,
            };
            let path = golden_path(dir, name, package_dir, i);
            let started = Instant::now();
            let mut r = result("golden", name, &backend, started);
            r.name = format!("golden::{name}::{backend}::prompt{i}");
            let recorded = decoder.as_mut().map_err(|e| e.clone()).and_then(|d| {
                crate::golden::record(name, "package", package, d, tokens, &g).map_err(|e| e.to_string())
            });
            let (verdict, outcome) = match recorded {
                Err(e) => (Verdict::CouldNotRun, Err(e)),
                Ok(rec) if backend == REFERENCE && !path.exists() => {
                    let written = std::fs::create_dir_all(dir).and_then(|()| {
                        write_whole(&path, crate::golden::snapshot_file("onnx-genai check", &rec).as_bytes())
                    });
                    match written {
                        Ok(()) => (Verdict::Pass, Ok(format!("recorded {} from ONNX Runtime", path.display()))),
                        Err(e) => (Verdict::CouldNotRun, Err(format!("cannot write {}: {e}", path.display()))),
                    }
                }
                Ok(rec) => match crate::golden::judge(&path, &rec, tier, g.decimals) {
                    crate::golden::Judgement::Matches => {
                        (Verdict::Pass, Ok(format!("matches {} (logits at tier {})", path.display(), tier.name())))
                    }
                    j @ (crate::golden::Judgement::Malformed { .. } | crate::golden::Judgement::Missing) => {
                        (Verdict::CouldNotRun, Err(format!("{j} ({})", path.display())))
                    }
                    crate::golden::Judgement::Differs { ref committed, .. } if committed.starts_with("prompt") => (
                        Verdict::CouldNotRun,
                        Err(format!(
                            "{} records another prompt ({committed}): delete it to record this one",
                            path.display()
                        )),
                    ),
                    crate::golden::Judgement::Differs { ref committed, .. }
                        if recorded_steps(committed).is_some_and(|n| n != steps) =>
                    {
                        let n = recorded_steps(committed).unwrap_or(0);
                        (
                            Verdict::CouldNotRun,
                            Err(format!(
                                "{} records {n} steps, this check decodes {steps}: run it with --steps {n}, \
                                 or delete it to record these",
                                path.display()
                            )),
                        )
                    }
                    j if near_ties.contains(&(backend.clone(), i)) => (
                        Verdict::NearTie,
                        Ok(format!("{j} ({}): where parity found a near-tie (not a failure)", path.display())),
                    ),
                    j => (Verdict::Mismatch, Err(format!("{j} ({})", path.display()))),
                },
            };
            by_prompt[i].push((finish(r, outcome, started), verdict));
        }
    }
    by_prompt.into_iter().flatten().collect()
}

/// The greedy steps a record holds, from its `token_ids: [..]` line (a
/// record holds exactly the steps it was made with: a check with another
/// `--steps` asks another question, which is no mismatch of the model).
fn recorded_steps(line: &str) -> Option<usize> {
    let ids = line.strip_prefix("token_ids: [")?.strip_suffix(']')?;
    Some(if ids.trim().is_empty() { 0 } else { ids.split(',').count() })
}

/// Writes `bytes` to `path` whole or not at all: into a sibling file first,
/// then renamed over `path` — an interrupted or failed write leaves `path`
/// as it was (a truncated golden record read later as a mismatch), and a
/// symlink at `path` is replaced, not written through. A `path` that
/// leads to something other than a regular file (`/dev/stdout`, a pipe) is
/// written to as it is: a rename would replace the link, or the device.
pub fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return std::fs::write(path, bytes);
    }
    // (The process id keeps two checks writing one record apart.)
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".{}.partial", std::process::id()));
    let partial = PathBuf::from(partial);
    // (A file left there by an earlier failure goes first: `create_new`
    // then also refuses a symlink put in its place.)
    let _ = std::fs::remove_file(&partial);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .and_then(|mut f| std::io::Write::write_all(&mut f, bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record is written whole through a sibling file, which is not left
    /// behind; a dangling symlink where the record goes is replaced, its
    /// target not created (a plain write followed the link); and a path
    /// leading to a pipe is written into as it is (a rename would replace
    /// the link to it).
    #[test]
    fn records_are_written_whole_and_never_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("a.snap");
        write_whole(&record, b"first").unwrap();
        write_whole(&record, b"second").unwrap();
        assert_eq!(std::fs::read(&record).unwrap(), b"second");
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, ["a.snap"], "a partial file was left behind");

        let (link, target) = (dir.path().join("b.snap"), dir.path().join("elsewhere"));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write_whole(&link, b"record").unwrap();
        assert!(!target.exists(), "the write followed the link");
        assert!(std::fs::symlink_metadata(&link).unwrap().is_file());

        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        let piped = dir.path().join("to-pipe");
        std::os::unix::fs::symlink(&fifo, &piped).unwrap();
        write_whole(&piped, b"report").unwrap();
        assert_eq!(reader.join().unwrap(), b"report");
        assert!(std::fs::symlink_metadata(&piped).unwrap().is_symlink(), "the link to the pipe was replaced");
    }
}

//! The README's commands against the lanes (issue 21): every `cargo xtask`
//! command the README documents is run by some lane's `commands`
//! (smoke-sized), or `conformance/lanes.yaml` says under `unlaned` why no
//! lane runs it. A documented command that no lane runs rots unseen: `cargo
//! xtask bench` once stopped at its second package and nothing noticed.

use super::LaneFile;

/// One documented command: the words after `cargo xtask` up to its first
/// optional (`[...]`) part, e.g. `bench --backend native-cuda` or
/// `load --package DIR`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Documented {
    pub key: String,
    subcommand: String,
    /// Words a lane's command must contain (placeholders such as `DIR`
    /// or `N`, written in capitals, stand for any value).
    literals: Vec<String>,
}

/// The commands of the README's `cargo xtask` code lines and of its
/// command tables (a row starting with a backticked `cargo xtask ...`),
/// each once.
pub fn documented(readme: &str) -> Vec<Documented> {
    let mut out: Vec<Documented> = Vec::new();
    for line in readme.lines() {
        let text = if line.starts_with("| `cargo xtask ") {
            line.split('`').nth(1)
        } else if line.starts_with("cargo xtask ") {
            line.split('#').next()
        } else {
            None
        };
        let Some(text) = text else { continue };
        let words: Vec<&str> = text.split_whitespace().skip(2).take_while(|w| !w.starts_with('[')).collect();
        let Some((subcommand, rest)) = words.split_first() else { continue };
        let d = Documented {
            key: words.join(" "),
            subcommand: subcommand.to_string(),
            literals: rest.iter().filter(|w| !is_placeholder(w)).map(|w| w.to_string()).collect(),
        };
        if !out.iter().any(|o| o.key == d.key) {
            out.push(d);
        }
    }
    out
}

fn is_placeholder(word: &str) -> bool {
    word.chars().any(|c| c.is_ascii_uppercase()) && !word.chars().any(|c| c.is_ascii_lowercase())
}

/// Whether `argv` runs `d`: the same subcommand with every literal word of
/// `d`. A command without literals (plain `bench`) is not run by a lane
/// command that carries the literals of one of its documented variants
/// (`bench --backend native-cuda` is another mode).
fn runs(argv: &[String], d: &Documented, all: &[Documented]) -> bool {
    let [cargo, xtask, subcommand, args @ ..] = argv else { return false };
    if cargo != "cargo" || xtask != "xtask" || *subcommand != d.subcommand {
        return false;
    }
    if !d.literals.iter().all(|l| args.contains(l)) {
        return false;
    }
    let variant = |o: &Documented| {
        o.subcommand == d.subcommand
            && o.literals.len() > d.literals.len()
            && o.literals.iter().all(|l| args.contains(l))
    };
    !all.iter().any(variant)
}

/// A problem for each documented command no lane runs and the file does
/// not excuse, and for each excuse that names no documented command.
pub fn problems(readme: &str, file: &LaneFile) -> Vec<String> {
    let all = documented(readme);
    let mut out = Vec::new();
    for d in &all {
        let laned = file.lanes.iter().any(|lane| lane.commands.iter().any(|argv| runs(argv, d, &all)));
        match (laned, file.unlaned.get(&d.key)) {
            (false, None) => out.push(format!(
                "README command `cargo xtask {}` runs in no lane: add it (smoke-sized) to a lane's commands, or say \
                 why under `unlaned` in conformance/lanes.yaml",
                d.key
            )),
            (true, Some(_)) => {
                out.push(format!("`unlaned` excuses `cargo xtask {}`, which a lane runs: remove the excuse", d.key))
            }
            _ => {}
        }
    }
    for key in file.unlaned.keys() {
        if !all.iter().any(|d| d.key == *key) {
            out.push(format!("`unlaned` names `cargo xtask {key}`, which the README does not document"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::Lane;

    const README: &str = "\
```sh
cargo xtask conformance   # the main job
```
| command | does |
|---|---|
| `cargo xtask bench [--threads N] [--real]` | decode speed |
| `cargo xtask bench --backend native-cuda [--rounds R]` | on a GPU |
| `cargo xtask load --package DIR [--sweep 1,2]` | one package |
| `cargo xtask fuzz` | nightly |
| `onnx-genai serve` | not an xtask command |
";

    fn lane(commands: &[&[&str]]) -> Lane {
        let yaml = format!(
            "name: l\nbackend: none\nempty: its commands\ncommands: {}",
            serde_json::to_string(&commands).unwrap()
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    /// The README's code lines and table rows give their commands up to
    /// the first optional part; placeholders match any value.
    #[test]
    fn documented_commands_are_read_from_code_lines_and_tables() {
        let keys: Vec<String> = documented(README).into_iter().map(|d| d.key).collect();
        assert_eq!(keys, ["conformance", "bench", "bench --backend native-cuda", "load --package DIR", "fuzz"]);
    }

    /// Issue 21, on this repository: every `cargo xtask` command the
    /// README documents is run by a lane of `conformance/lanes.yaml` or
    /// excused there (the audit checks the same; this runs it in the unit
    /// lane, without building every test binary first).
    #[test]
    fn this_readme_and_these_lanes_agree() {
        let readme = std::fs::read_to_string(crate::util::root().join("README.md")).unwrap();
        let file = super::super::load().unwrap();
        assert!(documented(&readme).len() >= 10, "the README's commands were not found");
        let found = problems(&readme, &file);
        assert!(found.is_empty(), "{found:#?}");
    }

    /// Issue 21: a documented command no lane runs is reported; a lane
    /// running only another mode of it (`bench --backend native-cuda`) does
    /// not count for the plain command; a placeholder takes any value; an
    /// excuse for a command a lane runs, or for one the README lacks, is
    /// reported too; a clean setup reports nothing.
    #[test]
    fn every_documented_command_runs_in_a_lane_or_says_why() {
        let gpu_only = LaneFile {
            lanes: vec![lane(&[
                &["cargo", "xtask", "conformance", "--package", "tiny"],
                &["cargo", "xtask", "bench", "--backend", "native-cuda"],
                &["cargo", "xtask", "load", "--package", "target/packages/x"],
            ])],
            unlaned: [("fuzz".to_string(), "nightly".to_string()), ("gone".to_string(), "old".to_string())].into(),
        };
        let found = problems(README, &gpu_only);
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].contains("`cargo xtask bench` runs in no lane"), "{found:#?}");
        assert!(found[1].contains("`cargo xtask gone`, which the README does not document"), "{found:#?}");

        let clean = LaneFile {
            lanes: vec![lane(&[
                &["cargo", "xtask", "conformance"],
                &["cargo", "xtask", "bench", "--rounds", "1"],
                &["cargo", "xtask", "bench", "--backend", "native-cuda"],
                &["cargo", "xtask", "load", "--package", "target/packages/x"],
                &["cargo", "xtask", "fuzz"],
            ])],
            unlaned: [("fuzz".to_string(), "nightly".to_string())].into(),
        };
        let found = problems(README, &clean);
        assert_eq!(found, ["`unlaned` excuses `cargo xtask fuzz`, which a lane runs: remove the excuse"]);
    }
}

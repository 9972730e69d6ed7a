//! Suite definitions (data under `conformance/`), expanded into named
//! checks: `parity::<package>::<variant>::<backend>::<prompt>`,
//! `batch::<package>::<variant>::<backend>` (the suite's prompts decoded as
//! one batch against each alone) and `golden::<package>::<variant>::<backend>`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use onnx_genai_build::Variant;
use onnx_genai_engine::BackendKind;
use serde::Deserialize;

use crate::real::RealModel;
use crate::tolerance::Tier;
use crate::HarnessError;

/// Backends compared against the reference.
pub const CANDIDATES: &[&str] = &[BackendKind::NativeCpu.name(), BackendKind::NativeCuda.name()];
/// Candidates that need hardware most machines lack: their checks are
/// selected only when a run names the backend (`--backend native-cuda`, the
/// gpu lane), never by default.
pub const ON_REQUEST: &[&str] = &[BackendKind::NativeCuda.name()];
/// The reference backend.
pub const REFERENCE: &str = BackendKind::Ort.name();

/// `conformance/parity/<file>.yaml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParityFile {
    pub package: String,
    pub variants: Vec<Variant>,
    /// Tier for every variant unless `tiers` overrides it.
    pub tier: Tier,
    #[serde(default)]
    pub tiers: BTreeMap<Variant, Tier>,
    /// Greedy decode steps after the prefill (at least 32).
    pub steps: usize,
    pub prompts: Vec<PromptDef>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptDef {
    pub name: String,
    pub text: String,
}

/// `conformance/golden.yaml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GoldenFile {
    pub prompt: String,
    pub max_new_tokens: usize,
    /// Decode steps (0 = after the prefill) whose top-5 logits are kept.
    pub top5_at_steps: Vec<usize>,
    /// Decimal places the logits are rounded to.
    pub decimals: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Suite {
    Parity,
    Batch,
    Golden,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Parity => "parity",
            Suite::Batch => "batch",
            Suite::Golden => "golden",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Suite::Parity, Suite::Batch, Suite::Golden].into_iter().find(|x| x.name() == s)
    }
}

#[derive(Clone, Debug)]
pub enum CheckKind {
    Parity {
        prompt: PromptDef,
        steps: usize,
        tier: Tier,
    },
    /// Every prompt (and a shorter cut of each) as one batch with staggered
    /// joins, each sequence against the same prompt alone on the reference.
    Batch {
        prompts: Vec<PromptDef>,
        steps: usize,
        tier: Tier,
    },
    /// The greedy record against the package and variant's golden, its
    /// logits at `tier` (the variant's parity tier).
    Golden {
        file: GoldenFile,
        tier: Tier,
    },
}

/// One named, independently runnable check.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    pub suite: Suite,
    pub package: String,
    pub variant: Variant,
    pub backend: String,
    pub kind: CheckKind,
    /// A real model's export (needs its fetched GGUF).
    pub real: bool,
}

pub(crate) fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, HarnessError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| HarnessError::Suite { path: path.into(), reason: e.to_string() })?;
    let de = serde_yaml_ng::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(de)
        .map_err(|e| HarnessError::Suite { path: path.into(), reason: format!("{} (at `{}`)", e.inner(), e.path()) })
}

/// Every check the suites under `root/conformance` define, sorted by name.
pub fn discover(root: &Path) -> Result<Vec<Check>, HarnessError> {
    let mut checks = Vec::new();
    let parity_dir = root.join("conformance/parity");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&parity_dir)
        .map_err(|e| HarnessError::Suite { path: parity_dir.clone(), reason: e.to_string() })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let packages = shipped_packages(root)?;
    let mut tiers = std::collections::HashMap::new();
    for path in &files {
        let f: ParityFile = read_yaml(path)?;
        if !packages.contains(&f.package) {
            return Err(HarnessError::Suite {
                path: path.clone(),
                reason: format!("no package `{}` under packages/", f.package),
            });
        }
        if f.steps < 32 {
            return Err(HarnessError::Suite {
                path: path.clone(),
                reason: format!("steps is {}; parity needs at least 32", f.steps),
            });
        }
        for variant in &f.variants {
            let tier = f.tiers.get(variant).copied().unwrap_or(f.tier);
            tiers.insert((f.package.clone(), *variant), tier);
            for backend in std::iter::once(&REFERENCE).chain(CANDIDATES) {
                checks.push(Check {
                    name: format!("batch::{}::{}::{backend}", f.package, variant.name()),
                    suite: Suite::Batch,
                    package: f.package.clone(),
                    variant: *variant,
                    backend: backend.to_string(),
                    kind: CheckKind::Batch { prompts: f.prompts.clone(), steps: f.steps, tier },
                    real: false,
                });
            }
            for backend in CANDIDATES {
                for prompt in &f.prompts {
                    checks.push(Check {
                        name: format!("parity::{}::{}::{backend}::{}", f.package, variant.name(), prompt.name),
                        suite: Suite::Parity,
                        package: f.package.clone(),
                        variant: *variant,
                        backend: backend.to_string(),
                        kind: CheckKind::Parity { prompt: prompt.clone(), steps: f.steps, tier },
                        real: false,
                    });
                }
            }
        }
    }
    let golden: GoldenFile = read_yaml(&root.join("conformance/golden.yaml"))?;
    for package in &packages {
        let file = root.join("conformance/parity").join(format!("{package}.yaml"));
        let spec_path = root.join("packages").join(package).join("spec.yaml");
        let spec = onnx_genai_build::read_spec(&spec_path)
            .map_err(|e| HarnessError::Suite { path: spec_path.clone(), reason: e.to_string() })?;
        for variant in spec.variants() {
            let Some(&tier) = tiers.get(&(package.clone(), variant)) else {
                return Err(HarnessError::Suite {
                    path: file.clone(),
                    reason: format!(
                        "no parity tier for {package}'s {} export: goldens are judged at it",
                        variant.name()
                    ),
                });
            };
            for backend in std::iter::once(&REFERENCE).chain(CANDIDATES) {
                checks.push(Check {
                    name: format!("golden::{package}::{}::{backend}", variant.name()),
                    suite: Suite::Golden,
                    package: package.clone(),
                    variant,
                    backend: backend.to_string(),
                    kind: CheckKind::Golden { file: golden.clone(), tier },
                    real: false,
                });
            }
        }
    }
    for model in RealModel::load_all(root)? {
        checks.extend(real_checks(&model, &golden));
    }
    checks.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(checks)
}

/// Parity and batches of every export on the CPU candidates, goldens on
/// both backends (a GPU check carries no real weights: it benches
/// SmolLM2's shapes instead).
fn real_checks(model: &RealModel, golden: &GoldenFile) -> Vec<Check> {
    let mut checks = Vec::new();
    for export in &model.exports {
        let package = model.package(export);
        let variant = export.variant;
        let check = |name: String, backend: &str, kind: CheckKind, suite: Suite| Check {
            name,
            suite,
            package: package.clone(),
            variant,
            backend: backend.into(),
            kind,
            real: true,
        };
        for backend in CANDIDATES.iter().filter(|b| !ON_REQUEST.contains(b)) {
            for prompt in &model.prompts {
                let kind = CheckKind::Parity { prompt: prompt.clone(), steps: model.steps, tier: export.tier };
                let name = format!("parity::{package}::{}::{backend}::{}", variant.name(), prompt.name);
                checks.push(check(name, backend, kind, Suite::Parity));
            }
        }
        // ONNX Runtime's batch runs its sequences one after another; the tiny
        // packages hold it to B1, so the real exports spend their time on
        // the native batches.
        for backend in CANDIDATES.iter().filter(|b| !ON_REQUEST.contains(b)) {
            let kind = CheckKind::Batch { prompts: model.prompts.clone(), steps: model.steps, tier: export.tier };
            let name = format!("batch::{package}::{}::{backend}", variant.name());
            checks.push(check(name, backend, kind, Suite::Batch));
        }
        for backend in std::iter::once(&REFERENCE).chain(CANDIDATES.iter().filter(|b| !ON_REQUEST.contains(b))) {
            let name = format!("golden::{package}::{}::{backend}", variant.name());
            let kind = CheckKind::Golden { file: golden.clone(), tier: export.tier };
            checks.push(check(name, backend, kind, Suite::Golden));
        }
    }
    checks
}

/// Packages the decode-core suites cover (vision-language workflow packages
/// are covered by the engine's workflow tests).
fn shipped_packages(root: &Path) -> Result<Vec<String>, HarnessError> {
    let specs = onnx_genai_build::spec_files(&root.join("packages")).map_err(|e| HarnessError::Build(e.to_string()))?;
    let mut names = Vec::new();
    for p in &specs {
        let spec = onnx_genai_build::read_spec(p).map_err(|e| HarnessError::Build(e.to_string()))?;
        if spec.vision.is_none() {
            names.push(spec.name);
        }
    }
    Ok(names)
}

/// Which checks a run selects.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub package: Option<String>,
    pub backend: Option<String>,
    pub suite: Option<Suite>,
    /// Leave out the real models' checks.
    pub no_real: bool,
    /// `(k, n)`: the k-th of n shards, 1-based.
    pub shard: Option<(usize, usize)>,
}

impl Filter {
    /// Parses `k/n` with `1 <= k <= n`.
    pub fn parse_shard(s: &str) -> Result<(usize, usize), String> {
        let (k, n) = s.split_once('/').ok_or_else(|| format!("shard `{s}` is not k/n"))?;
        let (k, n): (usize, usize) = (
            k.parse().map_err(|_| format!("shard index `{k}`"))?,
            n.parse().map_err(|_| format!("shard count `{n}`"))?,
        );
        if k == 0 || k > n {
            return Err(format!("shard {k}/{n}: need 1 <= k <= n"));
        }
        Ok((k, n))
    }

    pub fn apply(&self, checks: Vec<Check>) -> Vec<Check> {
        let selected = checks.into_iter().filter(|c| {
            self.package.as_ref().is_none_or(|p| *p == c.package)
                && match &self.backend {
                    Some(b) => *b == c.backend,
                    None => !ON_REQUEST.contains(&c.backend.as_str()),
                }
                && self.suite.is_none_or(|s| s == c.suite)
                && !(self.no_real && c.real)
        });
        match self.shard {
            // Round-robin over the sorted list keeps shards balanced across
            // packages and suites.
            Some((k, n)) => selected.enumerate().filter(|(i, _)| i % n == k - 1).map(|(_, c)| c).collect(),
            None => selected.collect(),
        }
    }

    /// [`Filter::apply`] for a run: a selection of no checks is an error
    /// (such a run would pass having compared nothing, as `--backend ort
    /// --suite parity` once did).
    pub fn select(&self, checks: Vec<Check>) -> Result<Vec<Check>, String> {
        let selected = self.apply(checks);
        if selected.is_empty() {
            let hint = match (self.backend.as_deref(), self.suite) {
                (Some(REFERENCE), Some(Suite::Parity)) => {
                    "; parity compares a native backend against ONNX Runtime, so it has no ort checks"
                }
                _ => "",
            };
            return Err(format!(
                "the filters select no checks (package {:?}, backend {:?}, suite {:?}, shard {:?}){hint}",
                self.package,
                self.backend,
                self.suite.map(|s| s.name()),
                self.shard
            ));
        }
        Ok(selected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checks() -> Vec<Check> {
        discover(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")).unwrap()
    }

    /// Every shipped package is covered by parity in all its variants and
    /// by batches and goldens on both backends; names are unique.
    #[test]
    fn suites_cover_every_package_variant_and_backend() {
        let all = checks();
        let names: std::collections::BTreeSet<&str> = all.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names.len(), all.len(), "duplicate check names");
        for package in ["tiny-llama-gqa", "tiny-gpt2", "tiny-llama-f16"] {
            let variants = if package == "tiny-gpt2" { &Variant::ALL[..3] } else { &Variant::ALL[..] };
            for variant in variants {
                let v = variant.name();
                assert!(names.contains(format!("golden::{package}::{v}::ort").as_str()));
                assert!(names.contains(format!("golden::{package}::{v}::native-cpu").as_str()));
                assert!(names.contains(format!("batch::{package}::{v}::ort").as_str()));
                assert!(names.contains(format!("batch::{package}::{v}::native-cpu").as_str()));
                assert!(names.iter().any(|n| n.starts_with(&format!("parity::{package}::{v}::native-cpu::"))));
            }
        }
    }

    /// native-cuda has every check native-cpu has on the shipped packages
    /// (same packages, variants, suites and prompts; no real-model checks: a
    /// GPU check carries no real weights), selected only when a run names
    /// it: a default run never selects it, `--backend native-cuda` (the gpu
    /// lane) selects exactly those.
    #[test]
    fn native_cuda_checks_mirror_native_cpu_and_run_only_on_request() {
        let all = checks();
        let of = |backend: &str| -> std::collections::BTreeSet<String> {
            all.iter().filter(|c| c.backend == backend && !c.real).map(|c| c.name.replace(backend, "<b>")).collect()
        };
        assert!(all.iter().all(|c| !(c.real && c.backend == "native-cuda")));
        assert!(!of("native-cuda").is_empty());
        assert_eq!(of("native-cuda"), of("native-cpu"));
        let default = Filter::default().apply(all.clone());
        assert!(default.iter().all(|c| c.backend != "native-cuda"));
        assert!(default.iter().any(|c| c.backend == "native-cpu"));
        let cuda = Filter { backend: Some("native-cuda".into()), ..Filter::default() }.apply(all.clone());
        assert_eq!(cuda.len(), of("native-cuda").len());
        assert!(cuda.iter().all(|c| c.backend == "native-cuda"));
    }

    /// Shards partition the selected checks: disjoint, complete, balanced.
    #[test]
    fn shards_partition_the_checks() {
        // What a default run selects (native-cuda's checks only on request).
        let all = Filter::default().apply(checks());
        let n = 4;
        let mut seen = Vec::new();
        for k in 1..=n {
            let shard = Filter { shard: Some((k, n)), ..Filter::default() }.apply(all.clone());
            assert!(shard.len().abs_diff(all.len() / n) <= 1, "shard {k}/{n} has {}", shard.len());
            seen.extend(shard.into_iter().map(|c| c.name));
        }
        seen.sort();
        let mut want: Vec<String> = all.iter().map(|c| c.name.clone()).collect();
        want.sort();
        assert_eq!(seen, want);
        assert!(
            Filter::parse_shard("0/3").is_err()
                && Filter::parse_shard("4/3").is_err()
                && Filter::parse_shard("x").is_err()
        );
        let only =
            Filter { package: Some("tiny-gpt2".into()), suite: Some(Suite::Golden), ..Filter::default() }.apply(all);
        assert!(!only.is_empty() && only.iter().all(|c| c.package == "tiny-gpt2" && c.suite == Suite::Golden));
    }

    /// A run's selection of nothing is an error, not a pass on zero checks
    /// (issue 21: `--backend ort --suite parity` selected nothing and
    /// passed).
    #[test]
    fn a_run_that_selects_no_checks_is_an_error() {
        let all = checks();
        let ort_parity = Filter { backend: Some("ort".into()), suite: Some(Suite::Parity), ..Filter::default() };
        let err = ort_parity.select(all.clone()).unwrap_err();
        assert!(err.contains("select no checks") && err.contains("no ort checks"), "{err}");
        let unknown = Filter { package: Some("no-such-package".into()), ..Filter::default() };
        assert!(unknown.select(all.clone()).is_err());
        let golden = Filter { backend: Some("ort".into()), suite: Some(Suite::Golden), ..Filter::default() };
        assert!(!golden.select(all).unwrap().is_empty(), "ort has golden checks");
    }

    /// A malformed suite file is an error naming the file and field.
    #[test]
    fn malformed_suite_files_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("conformance/parity")).unwrap();
        std::fs::write(
            dir.path().join("conformance/parity/bad.yaml"),
            "package: x\nvariants: [decomposed]\ntier: f64\nsteps: 32\nprompts: []\n",
        )
        .unwrap();
        let err = read_yaml::<ParityFile>(&dir.path().join("conformance/parity/bad.yaml")).unwrap_err().to_string();
        assert!(err.contains("bad.yaml") && err.contains("tier"), "{err}");
    }
}

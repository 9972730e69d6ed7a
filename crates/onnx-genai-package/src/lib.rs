//! The onnx-genai package format: manifest schema, loading confined to the
//! package directory, KV geometry, validation with coded diagnostics, and
//! import of ONNX Runtime GenAI `genai_config.json` packages.

pub mod confine;
pub mod diagnostics;
pub mod genai;
pub mod geometry;
pub mod manifest;
mod sampling_defaults;
pub mod schema;
mod tokenizer_file;
pub mod validate;
pub mod yaml;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use diagnostics::{Code, Diagnostic, Report, Severity};
pub use geometry::{KvGeometry, LayerKv};
pub use manifest::{Component, ElementType, Family, Manifest, Port, Role};
pub use tokenizer_file::decode;
pub use validate::{validate, Dialect, MANIFEST_FILE};

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("package {} is invalid:\n{report}run `onnx-genai validate {}` for the full report", root.display(), root.display())]
    Invalid { root: PathBuf, report: Report },
    #[error("component `{name}` is not in the package (known: {known})")]
    UnknownComponent { name: String, known: String },
    #[error("component `{component}` binds no `{role}` port")]
    UnboundRole { component: String, role: &'static str },
}

/// One layer's KV ports (tensor names) and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPorts {
    pub past_key: String,
    pub past_value: String,
    pub present_key: String,
    pub present_value: String,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A package that validated without errors.
#[derive(Clone, Debug)]
pub struct Package {
    pub root: PathBuf,
    pub dialect: Dialect,
    pub manifest: Manifest,
    /// Warnings validation found (errors make [`Package::open`] fail).
    pub warnings: Vec<Diagnostic>,
    component_paths: BTreeMap<String, PathBuf>,
    tokenizer: tokenizers::Tokenizer,
}

impl Package {
    /// Validates and opens the package at `root`; any error-level diagnostic
    /// fails the open with the whole report.
    pub fn open(root: &Path) -> Result<Self, PackageError> {
        let (report, checked) = validate(root);
        let invalid = |report| PackageError::Invalid { root: root.to_path_buf(), report };
        if report.has_errors() {
            return Err(invalid(report));
        }
        match (checked.manifest, checked.tokenizer) {
            (Some(manifest), Some(tokenizer)) => Ok(Self {
                root: root.to_path_buf(),
                dialect: checked.dialect,
                manifest,
                warnings: report.diagnostics,
                component_paths: checked.component_paths,
                tokenizer,
            }),
            _ => Err(invalid(report)),
        }
    }

    /// The declared KV geometry; `None` when the manifest declares none
    /// (admission then reserves nothing).
    pub fn kv_geometry(&self) -> Option<KvGeometry> {
        KvGeometry::from_manifest(&self.manifest)
    }

    /// The KV tensors a decoder backend must carry: the declared geometry,
    /// or — when none is declared — the architecture's layers in the weight
    /// dtype. Only backends use this; admission uses [`Package::kv_geometry`].
    pub fn kv_tensors(&self) -> KvGeometry {
        self.kv_geometry().unwrap_or_else(|| {
            let a = &self.manifest.architecture;
            KvGeometry {
                dtype: self.manifest.dtype,
                layers: vec![LayerKv { kv_heads: a.num_kv_heads, head_dim: a.head_dim }; a.num_layers as usize],
            }
        })
    }

    /// Where the context length is set, for messages: the key and file the
    /// user edits.
    pub fn context_length_key(&self) -> String {
        match self.dialect {
            Dialect::Native => format!("`architecture.max_sequence_length` in {MANIFEST_FILE}"),
            Dialect::GenaiConfig => format!("`model.context_length` in {}", genai::CONFIG_FILE),
        }
    }

    /// The package tokenizer, as loaded (and checked) by validation.
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Every layer's KV ports on `component`, with the shapes of
    /// [`Package::kv_tensors`].
    pub fn kv_ports(&self, component: &Component) -> Result<Vec<KvPorts>, PackageError> {
        let mut layers = Vec::new();
        for (i, shape) in self.kv_tensors().layers.iter().enumerate() {
            let port = |role: Role| {
                component
                    .layer_port(role, i as u32)
                    .ok_or(PackageError::UnboundRole { component: component.name.clone(), role: role.as_str() })
            };
            layers.push(KvPorts {
                past_key: port(Role::PastKey)?,
                past_value: port(Role::PastValue)?,
                present_key: port(Role::PresentKey)?,
                present_value: port(Role::PresentValue)?,
                kv_heads: shape.kv_heads as usize,
                head_dim: shape.head_dim as usize,
            });
        }
        Ok(layers)
    }

    pub fn component(&self, name: &str) -> Result<(&Component, &Path), PackageError> {
        let component = self.manifest.components.iter().find(|c| c.name == name);
        match (component, self.component_paths.get(name)) {
            (Some(c), Some(p)) => Ok((c, p)),
            _ => Err(PackageError::UnknownComponent {
                name: name.into(),
                known: self.manifest.components.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
            }),
        }
    }

    /// The component that produces logits (validation guarantees one).
    pub fn decoder(&self) -> Result<(&Component, &Path), PackageError> {
        let name = self
            .manifest
            .components
            .iter()
            .find(|c| c.ports.iter().any(|p| p.role == Role::Logits))
            .map(|c| c.name.clone())
            .unwrap_or_default();
        self.component(&name)
    }
}

impl Component {
    /// The graph tensor bound to a non-per-layer role.
    pub fn port(&self, role: Role) -> Option<&str> {
        self.ports.iter().find(|p| p.role == role).map(|p| p.name.as_str())
    }

    /// The graph tensor bound to a per-layer role at `layer`.
    pub fn layer_port(&self, role: Role, layer: u32) -> Option<String> {
        self.port(role).map(|t| Manifest::expand(t, layer))
    }
}

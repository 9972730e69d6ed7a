//! Deep validation: every problem of a package at once.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use onnx_genai_onnx::{DataType, Model};

use crate::confine;
use crate::diagnostics::{nearest, Code, Diagnostic, Report};
use crate::genai;
use crate::manifest::{Manifest, Role, FORMAT};
use crate::schema::{deserialize_closed, SchemaCodes, Tree};

mod template;
mod workflow;

pub const MANIFEST_FILE: &str = "package.yaml";

/// Which format the package directory is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `package.yaml`.
    Native,
    /// ONNX Runtime GenAI's `genai_config.json`.
    GenaiConfig,
}

/// What validation learned on the way, reused by [`crate::Package::open`].
pub struct Checked {
    pub dialect: Dialect,
    pub manifest: Option<Manifest>,
    pub component_paths: BTreeMap<String, PathBuf>,
    /// The tokenizer validation loaded, handed on so it is read once.
    pub tokenizer: Option<tokenizers::Tokenizer>,
}

/// Validates the package at `root`, collecting every problem.
pub fn validate(root: &Path) -> (Report, Checked) {
    let mut report = Report::default();
    let mut checked =
        Checked { dialect: Dialect::Native, manifest: None, component_paths: BTreeMap::new(), tokenizer: None };
    let native = root.join(MANIFEST_FILE);
    let genai_path = root.join(genai::CONFIG_FILE);
    let mut manifest = if std::fs::symlink_metadata(&native).is_ok() {
        read_text(root, MANIFEST_FILE, &mut report).and_then(|text| parse_native(&text, &mut report))
    } else if std::fs::symlink_metadata(&genai_path).is_ok() {
        checked.dialect = Dialect::GenaiConfig;
        read_text(root, genai::CONFIG_FILE, &mut report).and_then(|text| genai::import(&text, &mut report))
    } else {
        report.push(Diagnostic::error(
            Code::PKG001,
            MANIFEST_FILE,
            "",
            format!("no {MANIFEST_FILE} (or {}) in the package directory", genai::CONFIG_FILE),
            "point at a package directory, or build one with `onnx-genai build <spec.yaml> <out-dir>`",
        ));
        None
    };
    let Some(m) = manifest.as_mut() else {
        return (report, checked);
    };
    let template_source =
        if checked.dialect == Dialect::GenaiConfig { genai::complete(root, m, &mut report) } else { None };
    let ctx = Ctx { root, dialect: checked.dialect };
    if !check_architecture(&ctx, m, &mut report) {
        // Later checks walk the layers and heads; with sizes out of bounds
        // they would allocate per layer (billions of entries) first.
        return (report, checked);
    }
    if m.components.len() > MAX_COMPONENTS {
        // Each is read and decoded whole and kept while the package is
        // checked: thousands naming one large file took the memory.
        report.push(Diagnostic::error(
            Code::PKG004,
            ctx.manifest_file(),
            "components",
            format!("{} components; a package has at most {MAX_COMPONENTS}", m.components.len()),
            "a model is one decoder and a few encoders or embedders",
        ));
        return (report, checked);
    }
    let mut models = Vec::new();
    for (ci, component) in m.components.iter().enumerate() {
        let field = ctx.component_field(ci, "file");
        let model = match confine::resolve(root, &component.file, ctx.manifest_file(), &field) {
            Ok(path) => {
                checked.component_paths.insert(component.name.clone(), path.clone());
                load_model(&component.file, &path, &mut report)
            }
            Err(d) => {
                report.push(d);
                None
            }
        };
        models.push(model);
    }
    if checked.dialect == Dialect::GenaiConfig {
        adopt_graph_kv_dtype(m, &models);
    }
    for (ci, model) in models.iter().enumerate() {
        if let Some(model) = model {
            check_ports(&ctx, m, ci, model, &mut report);
            check_rotary_positions(&ctx, m, ci, model, &mut report);
            check_reference_operator_limits(&ctx, m, ci, model, &mut report);
        }
    }
    check_roles_present(&ctx, m, &mut report);
    workflow::check(&ctx, m, &models, &mut report);
    checked.tokenizer = crate::tokenizer_file::check(&ctx, m, &mut report);
    crate::sampling_defaults::check(&ctx, m, &mut report);
    check_chat_template(&ctx, m, template_source, &mut report);
    checked.manifest = manifest;
    (report, checked)
}

pub(crate) struct Ctx<'a> {
    pub(crate) root: &'a Path,
    pub(crate) dialect: Dialect,
}

impl Ctx<'_> {
    pub(crate) fn manifest_file(&self) -> &'static str {
        match self.dialect {
            Dialect::Native => MANIFEST_FILE,
            Dialect::GenaiConfig => genai::CONFIG_FILE,
        }
    }

    fn component_field(&self, ci: usize, key: &str) -> String {
        match self.dialect {
            Dialect::Native => format!("components[{ci}].{key}"),
            Dialect::GenaiConfig if key == "file" => "model.decoder.filename".into(),
            Dialect::GenaiConfig => "model.decoder.inputs".into(),
        }
    }

    fn port_field(&self, ci: usize, pi: usize, role: Role) -> String {
        match self.dialect {
            Dialect::Native => format!("components[{ci}].ports[{pi}].name"),
            Dialect::GenaiConfig => genai::port_field(role).into(),
        }
    }

    fn arch_field(&self, key: &str) -> String {
        match self.dialect {
            Dialect::Native => format!("architecture.{key}"),
            Dialect::GenaiConfig => match key {
                "vocab_size" => "model.vocab_size".into(),
                "num_layers" => "model.decoder.num_hidden_layers".into(),
                "num_kv_heads" => "model.decoder.num_key_value_heads".into(),
                "num_attention_heads" => "model.decoder.num_attention_heads".into(),
                "head_dim" => "model.decoder.head_size".into(),
                "hidden_size" => "model.decoder.hidden_size".into(),
                "max_sequence_length" => "model.context_length".into(),
                other => format!("model.{other}"),
            },
        }
    }

    /// Missing ports in the GenAI dialect get its own code: the usual cause is
    /// a `%d` template that names no tensor.
    fn missing_port_code(&self, role: Role) -> Code {
        match (self.dialect, role.per_layer()) {
            (Dialect::GenaiConfig, true) => Code::PKG104,
            _ => Code::PKG021,
        }
    }
}

/// The largest manifest (`package.yaml`, `genai_config.json`) read.
const MAX_MANIFEST_BYTES: u64 = 4 << 20;

pub(crate) fn read_text(root: &Path, file: &str, report: &mut Report) -> Option<String> {
    let path = match confine::resolve(root, file, file, "") {
        Ok(p) => p,
        Err(mut d) => {
            if d.code == Code::PKG012 {
                d.code = Code::PKG001;
            }
            report.push(d);
            return None;
        }
    };
    // A manifest is a few kilobytes; a huge one is refused before parsing.
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_MANIFEST_BYTES) {
        report.push(Diagnostic::error(
            Code::PKG001,
            file,
            "",
            format!("larger than {MAX_MANIFEST_BYTES} bytes"),
            "a manifest describes the package; weights and vocabularies live in their own files",
        ));
        return None;
    }
    match std::fs::read(&path) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => Some(text),
            Err(e) => {
                report.push(Diagnostic::error(
                    Code::PKG001,
                    file,
                    "",
                    format!("not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
                    "save the file as UTF-8",
                ));
                None
            }
        },
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG001,
                file,
                "",
                format!("cannot read: {e}"),
                "check the file's permissions",
            ));
            None
        }
    }
}

/// Parses `package.yaml` text against the closed schema.
pub fn parse_native(text: &str, report: &mut Report) -> Option<Manifest> {
    if let Err(depth) = crate::schema::check_nesting(text) {
        report.push(Diagnostic::error(
            Code::PKG002,
            MANIFEST_FILE,
            "",
            format!(
                "nested {depth} levels deep; a manifest nests at most {} (lists and maps)",
                crate::schema::MAX_NESTING
            ),
            "a manifest is a few levels of maps and lists; fix the brackets",
        ));
        return None;
    }
    let tree: Tree = match crate::yaml::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG002,
                MANIFEST_FILE,
                "",
                format!("not valid YAML: {e}"),
                "fix the YAML syntax at the line and column given",
            ));
            return None;
        }
    };
    let codes = SchemaCodes { unknown_key: Code::PKG003, bad_value: Code::PKG004 };
    let m: Manifest = deserialize_closed(tree, MANIFEST_FILE, &codes, report)?;
    if m.format != FORMAT {
        report.push(Diagnostic::error(
            Code::PKG005,
            MANIFEST_FILE,
            "format",
            format!("format `{}` is not supported", m.format),
            format!("this version reads `{FORMAT}`; rebuild the package with this version's builder"),
        ));
        return None;
    }
    Some(m)
}

/// Upper bounds on the architecture's sizes: far above any released model,
/// low enough that every product the runtime forms from them (KV bytes per
/// token, per-layer tables) fits its integer type and allocates sanely.
pub const ARCHITECTURE_BOUNDS: [(&str, u32); 7] = [
    ("hidden_size", 1 << 20),
    ("num_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_kv_heads", 1 << 12),
    ("head_dim", 1 << 14),
    ("vocab_size", 1 << 24),
    ("max_sequence_length", 1 << 24),
];

/// The bound [`ARCHITECTURE_BOUNDS`] sets on `key` (none: `u32::MAX`).
pub fn bound_of(key: &str) -> u32 {
    ARCHITECTURE_BOUNDS.iter().find(|(k, _)| *k == key).map_or(u32::MAX, |(_, b)| *b)
}

/// Reports what is wrong with the architecture; returns whether its sizes
/// are within [`ARCHITECTURE_BOUNDS`], which every later check that
/// allocates per layer relies on.
fn check_architecture(ctx: &Ctx, m: &Manifest, report: &mut Report) -> bool {
    let a = &m.architecture;
    let file = ctx.manifest_file();
    let mut bounded = true;
    for (key, value) in [
        ("hidden_size", a.hidden_size),
        ("num_layers", a.num_layers),
        ("num_attention_heads", a.num_attention_heads),
        ("num_kv_heads", a.num_kv_heads),
        ("head_dim", a.head_dim),
        ("vocab_size", a.vocab_size),
        ("max_sequence_length", a.max_sequence_length),
    ] {
        if value == 0 {
            report.push(Diagnostic::error(
                Code::PKG031,
                file,
                ctx.arch_field(key),
                format!("`{key}` is 0"),
                "give the model's real size",
            ));
        } else if value > bound_of(key) {
            bounded = false;
            report.push(Diagnostic::error(
                Code::PKG031,
                file,
                ctx.arch_field(key),
                format!("`{key}` is {value}, above the supported {}", bound_of(key)),
                "give the model's real size",
            ));
        }
    }
    if a.num_kv_heads != 0 && !a.num_attention_heads.is_multiple_of(a.num_kv_heads) {
        report.push(Diagnostic::error(
            Code::PKG031,
            file,
            ctx.arch_field("num_kv_heads"),
            format!("{} attention heads cannot share {} KV heads evenly", a.num_attention_heads, a.num_kv_heads),
            "num_attention_heads must be a multiple of num_kv_heads (MHA: equal; MQA: 1)",
        ));
    }
    if let Some(layers) = m.kv_cache.as_ref().and_then(|k| k.layers.as_ref()) {
        if layers.len() != a.num_layers as usize {
            report.push(Diagnostic::error(
                Code::PKG031,
                file,
                "kv_cache.layers",
                format!("{} per-layer KV entries for {} layers", layers.len(), a.num_layers),
                "give one entry per layer, or drop `layers` when all layers are alike",
            ));
        }
        for (i, l) in layers.iter().enumerate() {
            for (key, value) in [("kv_heads", l.kv_heads), ("head_dim", l.head_dim)] {
                let bound = bound_of(if key == "kv_heads" { "num_kv_heads" } else { "head_dim" });
                if value == 0 || value > bound {
                    bounded &= value <= bound;
                    report.push(Diagnostic::error(
                        Code::PKG031,
                        file,
                        format!("kv_cache.layers[{i}].{key}"),
                        format!("`{key}` is {value}; it must be between 1 and {bound}"),
                        "give the layer's real KV geometry",
                    ));
                }
            }
        }
    }
    bounded
}

/// Positions past a rotary cos/sin cache have no angle: a context length
/// beyond the cache would fail (or read garbage) mid-generation, so it is
/// refused up front, naming the key that sets it.
fn check_rotary_positions(ctx: &Ctx, m: &Manifest, ci: usize, model: &Model, report: &mut Report) {
    let context = u64::from(m.architecture.max_sequence_length);
    let initializers = model.graph.initializers_by_name();
    for node in &model.graph.nodes {
        let cos_input = match (node.domain.as_str(), node.op_type.as_str()) {
            ("com.microsoft", "GroupQueryAttention") => 7,
            ("com.microsoft", "RotaryEmbedding") => 2,
            ("" | "ai.onnx", "RotaryEmbedding") => 1,
            _ => continue,
        };
        let Some(cache) = node.inputs.get(cos_input).and_then(|name| initializers.get(name.as_str())) else { continue };
        let Some(rows) = cache.dims.first().and_then(|r| u64::try_from(*r).ok()) else { continue };
        if context > rows {
            report.push(Diagnostic::error(
                Code::PKG032,
                ctx.manifest_file(),
                ctx.arch_field("max_sequence_length"),
                format!(
                    "the context length {context} exceeds the {rows} positions of rotary cache `{}` (node `{}` in {})",
                    cache.name, node.name, m.components[ci].file
                ),
                format!("set it to at most {rows}, or re-export the model with a longer rotary cache"),
            ));
            return;
        }
    }
}

/// Head sizes ONNX Runtime's `GroupQueryAttention` runs: multiples of 8,
/// or of 16 when it applies rotary itself (`do_rotary`).
fn gqa_head_multiple(node: &onnx_genai_onnx::Node) -> u32 {
    match node.attr("do_rotary") {
        Some(onnx_genai_onnx::AttrValue::Int(1)) => 16,
        _ => 8,
    }
}

/// ONNX Runtime's `GroupQueryAttention` refuses head sizes it has no kernel
/// for (see [`gqa_head_multiple`]), and only when it first runs: a package
/// that validated would then fail its first request. Refused up front,
/// naming the key.
fn check_reference_operator_limits(ctx: &Ctx, m: &Manifest, ci: usize, model: &Model, report: &mut Report) {
    let mut head_dims = vec![m.architecture.head_dim];
    if let Some(layers) = m.kv_cache.as_ref().and_then(|k| k.layers.as_ref()) {
        head_dims.extend(layers.iter().map(|l| l.head_dim));
    }
    // The first head size off each multiple, found once (per node, the
    // scan of every layer's was nodes x layers).
    let first_off = |multiple: u32| head_dims.iter().copied().find(|d| !d.is_multiple_of(multiple));
    let (off_8, off_16) = (first_off(8), first_off(16));
    let gqa = model.graph.nodes.iter().filter(|n| n.domain == "com.microsoft" && n.op_type == "GroupQueryAttention");
    for node in gqa {
        let multiple = gqa_head_multiple(node);
        let Some(head) = (if multiple == 16 { off_16 } else { off_8 }) else { continue };
        report.push(Diagnostic::error(
            Code::PKG033,
            ctx.manifest_file(),
            ctx.arch_field("head_dim"),
            format!(
                "ONNX Runtime's GroupQueryAttention (node `{}` in {}{}) needs a head size that is a multiple of {multiple}; this model's is {head}",
                node.name,
                m.components[ci].file,
                if multiple == 16 { ", rotating inside" } else { "" }
            ),
            format!("export the model without GroupQueryAttention (plain ONNX attention), or with a head size that is a multiple of {multiple}"),
        ));
        return;
    }
}

fn load_model(relative: &str, path: &Path, report: &mut Report) -> Option<Model> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG013,
                relative,
                "",
                format!("cannot read: {e}"),
                "check the file's permissions",
            ));
            return None;
        }
    };
    match onnx_genai_onnx::decode_in(&bytes, path.parent().unwrap_or(Path::new("."))) {
        Ok(model) => Some(model),
        Err(e @ onnx_genai_onnx::OnnxError::External { .. }) => {
            report.push(Diagnostic::error(
                Code::PKG027,
                relative,
                "",
                e.to_string(),
                "external data must lie inside the package, whole, where the model's offsets say; re-export the package",
            ));
            None
        }
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG020,
                relative,
                "",
                format!("not a readable ONNX model: {e}"),
                "re-export the model; the file may be truncated or not ONNX",
            ));
            None
        }
    }
}

fn adopt_graph_kv_dtype(m: &mut Manifest, models: &[Option<Model>]) {
    let Some(template) = m.components.first().and_then(|c| c.ports.iter().find(|p| p.role == Role::PastKey)) else {
        return;
    };
    let name = Manifest::expand(&template.name, 0);
    let dtype = models.first().and_then(Option::as_ref).and_then(|model| model.graph.input(&name)).map(|v| v.dtype);
    if let (Some(kv), Some(DataType::Float16)) = (m.kv_cache.as_mut(), dtype) {
        kv.dtype = crate::manifest::ElementType::F16;
    }
}

fn allowed_dtypes(m: &Manifest, role: Role) -> Vec<DataType> {
    match role {
        Role::TokenIds | Role::PositionIds | Role::AttentionMask => vec![DataType::Int64, DataType::Int32],
        Role::InputsEmbeds | Role::Logits => vec![DataType::Float, DataType::Float16],
        // The KV cache's type where declared, else the weights' (what
        // backends carry it in: `Package::kv_tensors`); a graph whose past
        // is another type ran into ONNX Runtime's type error at the first
        // step.
        _ => vec![m.kv_cache.as_ref().map_or(m.dtype, |kv| kv.dtype).onnx()],
    }
}

fn check_ports(ctx: &Ctx, m: &Manifest, ci: usize, model: &Model, report: &mut Report) {
    let component = &m.components[ci];
    let graph = &model.graph;
    // Looked up once per port and layer: a scan of the graph's list each
    // time was layers x inputs comparisons (quadratic in a crafted graph).
    let (inputs, outputs) = (graph.inputs_by_name(), graph.outputs_by_name());
    let file = ctx.manifest_file();
    let mut seen_roles = HashSet::new();
    let mut bound_names = HashSet::new();
    // A role bound again is reported once and its port not checked: each
    // copy of a per-layer port walked every layer (a manifest of aliases,
    // 1,000 copies of one port over 4,096 layers, made 4 million
    // diagnostics).
    let mut reported_twice = HashSet::new();
    for (pi, port) in component.ports.iter().enumerate() {
        let field = ctx.port_field(ci, pi, port.role);
        let templated = port.name.contains("{layer}");
        if !seen_roles.insert(port.role) {
            if reported_twice.insert(port.role) {
                report.push(Diagnostic::error(
                    Code::PKG025,
                    file,
                    field.clone(),
                    format!("role `{}` is bound twice in component `{}`", port.role.as_str(), component.name),
                    "bind each role once",
                ));
            }
            continue;
        }
        if port.role.per_layer() != templated {
            let msg = if templated {
                format!("role `{}` is not per layer but its name contains `{{layer}}`", port.role.as_str())
            } else {
                format!("per-layer role `{}` needs `{{layer}}` in its name", port.role.as_str())
            };
            report.push(Diagnostic::error(
                Code::PKG025,
                file,
                field,
                msg,
                "write e.g. `past_key_values.{layer}.key` for per-layer KV ports",
            ));
            continue;
        }
        let layers = if templated { m.architecture.num_layers } else { 1 };
        for layer in 0..layers {
            let name = Manifest::expand(&port.name, layer);
            if !bound_names.insert(name.clone()) {
                report.push(Diagnostic::error(
                    Code::PKG025,
                    file,
                    field.clone(),
                    format!("tensor `{name}` is bound twice"),
                    "bind each tensor once",
                ));
                // One layer bound twice usually means all are: once a port.
                break;
            }
            let (input, output) = (inputs.get(name.as_str()).copied(), outputs.get(name.as_str()).copied());
            let (found, kind, pool) = if port.role.is_output() {
                (output, "output", &graph.outputs)
            } else if port.role == Role::InputsEmbeds && input.is_none() {
                // A decoder reads embeddings; an embedding component writes them.
                (output, "output", &graph.outputs)
            } else {
                (input, "input", &graph.inputs)
            };
            let Some(value) = found else {
                let names: Vec<&str> = pool.iter().map(|v| v.name.as_str()).collect();
                let hint = match nearest(&name, &names) {
                    Some(s) => format!("did you mean `{s}`? The graph's {kind}s are: {}", names.join(", ")),
                    None => format!("the graph's {kind}s are: {}", names.join(", ")),
                };
                report.push(Diagnostic::error(
                    ctx.missing_port_code(port.role),
                    file,
                    field.clone(),
                    format!("`{name}` (role `{}`) is not an {kind} of {}", port.role.as_str(), component.file),
                    hint,
                ));
                // One missing layer usually means all are: report the template once.
                break;
            };
            let allowed = allowed_dtypes(m, port.role);
            if !allowed.contains(&value.dtype) {
                let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
                report.push(Diagnostic::error(
                    Code::PKG022,
                    file,
                    field.clone(),
                    format!(
                        "`{name}` is {} but role `{}` needs {}",
                        value.dtype,
                        port.role.as_str(),
                        names.join(" or ")
                    ),
                    if port.role.per_layer() && m.kv_cache.is_none() {
                        "with no kv_cache section the KV cache takes `dtype`: declare kv_cache.dtype as the graph's \
                         KV tensors' type"
                            .to_string()
                    } else if port.role.per_layer() {
                        "make kv_cache.dtype match the graph's KV tensors".to_string()
                    } else {
                        "re-export the graph with the expected element type".to_string()
                    },
                ));
            }
            match value.rank() {
                Some(rank) if rank != port.role.rank() => report.push(Diagnostic::error(
                    Code::PKG023,
                    file,
                    field.clone(),
                    format!(
                        "`{name}` has rank {rank} but role `{}` needs rank {}",
                        port.role.as_str(),
                        port.role.rank()
                    ),
                    "bind the role to a tensor of the right rank",
                )),
                Some(_) => check_shape(ctx, m, port.role, layer, &name, value, &field, report),
                None => {}
            }
        }
    }
    let application: HashSet<&str> = m
        .workflow
        .iter()
        .flat_map(|w| &w.application_inputs)
        .filter(|a| a.component == component.name)
        .map(|a| a.port.as_str())
        .collect();
    for input in graph.runtime_inputs() {
        if !bound_names.contains(&input.name) && !application.contains(input.name.as_str()) {
            report.push(Diagnostic::error(
                Code::PKG026,
                file,
                ctx.component_field(ci, "ports"),
                format!("graph input `{}` of {} is bound by no port", input.name, component.file),
                "bind it to a role, declare it as a workflow application input, or remove it from the graph",
            ));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_shape(
    ctx: &Ctx,
    m: &Manifest,
    role: Role,
    layer: u32,
    name: &str,
    value: &onnx_genai_onnx::ValueInfo,
    field: &str,
    report: &mut Report,
) {
    let Some(shape) = value.shape.as_ref() else { return };
    let file = ctx.manifest_file();
    if role.per_layer() {
        let Some(geometry) = crate::geometry::KvGeometry::from_manifest(m) else { return };
        let Some(expected) = geometry.layers.get(layer as usize) else { return };
        for (axis, what, want) in [(1, "KV heads", expected.kv_heads), (3, "head dim", expected.head_dim)] {
            match shape[axis].fixed() {
                Some(got) if got != i64::from(want) => report.push(Diagnostic::error(
                    Code::PKG030,
                    file,
                    field,
                    format!("`{name}` has {got} {what} (axis {axis}) but the KV geometry says {want}"),
                    "make architecture.num_kv_heads/head_dim (or kv_cache.layers) match the graph",
                )),
                Some(_) => {}
                None => report.push(Diagnostic::warning(
                    Code::PKG030,
                    file,
                    field,
                    format!("`{name}` axis {axis} ({what}) is not fixed, so the KV geometry cannot be checked"),
                    "export KV tensors with fixed head counts and head size",
                )),
            }
        }
    } else if role == Role::Logits {
        if let Some(width) = shape[2].fixed() {
            if width != i64::from(m.architecture.vocab_size) {
                report.push(Diagnostic::error(
                    Code::PKG040,
                    file,
                    ctx.arch_field("vocab_size"),
                    format!("logits `{name}` are {width} wide but vocab_size is {}", m.architecture.vocab_size),
                    "make vocab_size equal the logits width",
                ));
            }
        }
    }
}

fn check_roles_present(ctx: &Ctx, m: &Manifest, report: &mut Report) {
    let file = ctx.manifest_file();
    let decoders: Vec<usize> =
        (0..m.components.len()).filter(|&ci| m.components[ci].ports.iter().any(|p| p.role == Role::Logits)).collect();
    if decoders.is_empty() {
        report.push(Diagnostic::error(
            Code::PKG024,
            file,
            "components",
            "no component binds the `logits` role",
            "bind the decoder's logits output with `role: logits`",
        ));
    }
    for ci in decoders {
        let roles: HashSet<Role> = m.components[ci].ports.iter().map(|p| p.role).collect();
        let mut need = Vec::new();
        if !roles.contains(&Role::TokenIds) && !roles.contains(&Role::InputsEmbeds) {
            need.push("token_ids or inputs_embeds");
        }
        if m.kv_cache.is_some() {
            for (role, label) in [
                (Role::PastKey, "past_key"),
                (Role::PastValue, "past_value"),
                (Role::PresentKey, "present_key"),
                (Role::PresentValue, "present_value"),
            ] {
                if !roles.contains(&role) {
                    need.push(label);
                }
            }
        }
        for label in need {
            report.push(Diagnostic::error(
                Code::PKG024,
                file,
                ctx.component_field(ci, "ports"),
                format!("decoder component `{}` binds no `{label}` port", m.components[ci].name),
                "bind the role to the graph tensor that carries it",
            ));
        }
    }
}

/// `source`: the file and field the template came from when not the
/// manifest's own `chat_template` (an imported package's).
/// The most components a package may list.
pub const MAX_COMPONENTS: usize = 16;

fn check_chat_template(ctx: &Ctx, m: &Manifest, source: Option<(&str, &str)>, report: &mut Report) {
    let Some(template) = &m.chat_template else { return };
    let (file, field) = source.unwrap_or((ctx.manifest_file(), "chat_template"));
    if let Err(e) = template::check_tags(template) {
        report.push(Diagnostic::error(
            Code::PKG050,
            file,
            field,
            format!("the chat template is refused before it is compiled: {e}"),
            "split the expression (`{% set %}` its parts)",
        ));
        return;
    }
    let env = minijinja::Environment::new();
    if let Err(e) = env.template_from_str(template) {
        report.push(Diagnostic::error(
            Code::PKG050,
            file,
            field,
            format!("the chat template does not parse: {e}"),
            "fix the Jinja syntax",
        ));
    }
}

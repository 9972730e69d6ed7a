//! The declared workflow of a multi-component package: its steps and
//! application inputs name real components and ports, and its image
//! input's geometry is one the runtime can preprocess and fit in the
//! context.

use onnx_genai_onnx::Model;

use super::Ctx;
use crate::diagnostics::{Code, Diagnostic, Report};
use crate::manifest::Manifest;

/// Reports what is wrong with the manifest's `workflow`, if it has one.
pub(super) fn check(ctx: &Ctx, m: &Manifest, models: &[Option<Model>], report: &mut Report) {
    let Some(workflow) = &m.workflow else { return };
    let known = |name: &str| m.components.iter().position(|c| c.name == name);
    for (i, step) in workflow.steps.iter().enumerate() {
        if known(&step.component).is_none() {
            report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                format!("workflow.steps[{i}].component"),
                format!("workflow step names unknown component `{}`", step.component),
                "name one of the package's components",
            ));
        }
    }
    if let Some(image) = &workflow.image {
        let field = "workflow.image.features";
        match known(&image.features.component) {
            None => report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                format!("{field}.component"),
                format!("image features name unknown component `{}`", image.features.component),
                "name one of the package's components",
            )),
            Some(ci) => {
                if let Some(model) = &models[ci] {
                    if model.graph.output(&image.features.port).is_none() {
                        report.push(Diagnostic::error(
                            Code::PKG060,
                            ctx.manifest_file(),
                            format!("{field}.port"),
                            format!("`{}` is not an output of {}", image.features.port, m.components[ci].file),
                            "name a graph output of that component",
                        ));
                    }
                }
            }
        }
        if image.tokens == 0
            || image.preprocess.width == 0
            || image.preprocess.height == 0
            || image.preprocess.std.contains(&0.0)
        {
            report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                "workflow.image",
                "image tokens, preprocess size and std must be positive",
                "fix the declared image geometry",
            ));
        }
        let side = crate::manifest::MAX_IMAGE_SIDE;
        if image.preprocess.width > side || image.preprocess.height > side {
            report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                "workflow.image.preprocess",
                format!(
                    "the image preprocessing resizes to {}x{} pixels, more than {side} on a side",
                    image.preprocess.width, image.preprocess.height
                ),
                format!("declare the size the vision component takes, at most {side}x{side}"),
            ));
        }
        if image.tokens >= m.architecture.max_sequence_length {
            report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                "workflow.image.tokens",
                format!(
                    "an image takes {} positions, no fewer than the whole context of {}",
                    image.tokens, m.architecture.max_sequence_length
                ),
                "declare the positions the vision component's features fill (fewer than the context)",
            ));
        }
    }
    for (i, input) in workflow.application_inputs.iter().enumerate() {
        let field = format!("workflow.application_inputs[{i}]");
        let Some(ci) = m.components.iter().position(|c| c.name == input.component) else {
            report.push(Diagnostic::error(
                Code::PKG060,
                ctx.manifest_file(),
                format!("{field}.component"),
                format!("application input `{}` names unknown component `{}`", input.name, input.component),
                "name one of the package's components",
            ));
            continue;
        };
        if let Some(model) = &models[ci] {
            if model.graph.input(&input.port).is_none() {
                report.push(Diagnostic::error(
                    Code::PKG060,
                    ctx.manifest_file(),
                    format!("{field}.port"),
                    format!(
                        "application input `{}` feeds `{}`, which is not an input of {}",
                        input.name, input.port, m.components[ci].file
                    ),
                    "name a graph input of that component",
                ));
            }
        }
    }
}

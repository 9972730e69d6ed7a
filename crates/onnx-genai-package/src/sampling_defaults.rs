//! A package's sampling defaults (`generation.sampling`, or an ONNX
//! Runtime GenAI package's `search` section): each in the range the
//! engine's sampler accepts, so a request that leaves it unset is never
//! refused for a value it did not send.

use crate::diagnostics::{Code, Diagnostic, Report};
use crate::manifest::Manifest;
use crate::validate::{Ctx, Dialect};

pub(crate) fn check(ctx: &Ctx, m: &Manifest, report: &mut Report) {
    let d = &m.generation.sampling;
    let prefix = match ctx.dialect {
        Dialect::Native => "generation.sampling.",
        Dialect::GenaiConfig => "search.",
    };
    for (key, v, range) in d.out_of_range() {
        report.push(Diagnostic::error(
            Code::PKG044,
            ctx.manifest_file(),
            format!("{prefix}{key}"),
            format!("{key} {v} is out of range: it must be {range}"),
            "set it within the range, or remove it to use the server's default",
        ));
    }
}

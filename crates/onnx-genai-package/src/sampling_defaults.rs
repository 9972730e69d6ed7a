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
    let ranged = [
        (
            "temperature",
            d.temperature,
            "a finite number >= 0 (0 is greedy)",
            d.temperature.is_none_or(|t| t.is_finite() && t >= 0.0),
        ),
        ("top_p", d.top_p, "in (0, 1]", d.top_p.is_none_or(|p| p > 0.0 && p <= 1.0)),
        (
            "repetition_penalty",
            d.repetition_penalty,
            "a finite number > 0 (1 leaves logits alone)",
            d.repetition_penalty.is_none_or(|r| r.is_finite() && r > 0.0),
        ),
    ];
    for (key, value, range, ok) in ranged {
        if let (false, Some(v)) = (ok, value) {
            report.push(Diagnostic::error(
                Code::PKG044,
                ctx.manifest_file(),
                format!("{prefix}{key}"),
                format!("{key} {v} is out of range: it must be {range}"),
                "set it within the range, or remove it to use the server's default",
            ));
        }
    }
}

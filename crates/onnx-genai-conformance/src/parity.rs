//! Parity of one backend against the reference on one token sequence:
//! logits after the prefill and after every greedy decode step must stay
//! within the tier, and greedy tokens must be identical.

use onnx_genai_backend::{BackendError, DecodeBackend};
use serde::Serialize;

use crate::tolerance::{compare, top2, Deviation, Tier};

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Divergence {
    /// Logits left the tier at `step` (0 = prefill).
    Logits { step: usize, deviation: Deviation },
    /// The greedy tokens differ at `step`; `near_tie` when the reference's
    /// top-2 gap is inside the tolerance (then either choice is defensible,
    /// and the report says so rather than passing it).
    Token { step: usize, reference: u32, candidate: u32, top2_gap: f32, max_abs: f32, near_tie: bool },
    /// A backend failed.
    Error { step: usize, backend: String, message: String },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParityOutcome {
    pub steps: usize,
    /// Worst deviation over every compared step.
    pub worst: Deviation,
    /// Smallest reference top-2 gap seen (how close greedy came to a tie).
    pub min_top2_gap: f32,
    pub tokens: Vec<u32>,
    pub divergence: Option<Divergence>,
}

impl ParityOutcome {
    pub fn passed(&self) -> bool {
        self.divergence.is_none()
    }
}

fn fail(step: usize, backend: &dyn DecodeBackend, e: BackendError) -> Divergence {
    Divergence::Error { step, backend: backend.name().into(), message: e.to_string() }
}

/// Prefills `prompt` on both backends, then decodes `steps` greedy tokens,
/// comparing at every step. Stops at the first divergence.
pub fn run(
    reference: &mut dyn DecodeBackend,
    candidate: &mut dyn DecodeBackend,
    prompt: &[u32],
    steps: usize,
    tier: Tier,
) -> ParityOutcome {
    reference.reset();
    candidate.reset();
    let mut out = ParityOutcome {
        steps: 0,
        worst: Deviation { max_abs: 0.0, worst_index: 0, worst_ratio: 0.0 },
        min_top2_gap: f32::INFINITY,
        tokens: Vec::new(),
        divergence: None,
    };
    let mut input: Vec<u32> = prompt.to_vec();
    for step in 0..=steps {
        let r = match reference.forward(&input) {
            Ok(r) => r,
            Err(e) => {
                out.divergence = Some(fail(step, reference, e));
                return out;
            }
        };
        let c = match candidate.forward(&input) {
            Ok(c) => c,
            Err(e) => {
                out.divergence = Some(fail(step, candidate, e));
                return out;
            }
        };
        let dev = compare(&r, &c, tier);
        if dev.worst_ratio > out.worst.worst_ratio {
            out.worst = dev;
        }
        out.worst.max_abs = out.worst.max_abs.max(dev.max_abs);
        out.steps = step;
        let ((rt, gap), (ct, _)) = (top2(&r), top2(&c));
        out.min_top2_gap = out.min_top2_gap.min(gap);
        if rt != ct {
            let (atol, rtol) = tier.bounds();
            let allowance = 2.0 * (atol + rtol * r[rt as usize].abs());
            out.divergence = Some(Divergence::Token {
                step,
                reference: rt,
                candidate: ct,
                top2_gap: gap,
                max_abs: dev.max_abs,
                near_tie: gap <= allowance,
            });
            return out;
        }
        if dev.worst_ratio > 1.0 {
            out.divergence = Some(Divergence::Logits { step, deviation: dev });
            return out;
        }
        if step == steps {
            break;
        }
        out.tokens.push(rt);
        input = vec![rt];
    }
    out
}

//! Parity of one backend against the reference on one token sequence:
//! logits after the prefill and after every greedy decode step must stay
//! within the tier, and greedy tokens must be identical.

use onnx_genai_backend::{BackendError, Decoder};
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
    /// For a near-tie in a reduced-precision export: what the f32 export
    /// of the same model picks at that step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arbitration: Option<Arbitration>,
}

/// The f32 export's verdict on a near-tie flip.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arbitration {
    /// The f32 greedy choice at the diverging step.
    pub choice: u32,
    /// `reference`, `candidate`, or `neither`.
    pub sides_with: &'static str,
    /// f32 logit of the reference's token minus the candidate's.
    pub margin: f32,
}

/// Runs the f32 export over the prompt and the tokens both sides agreed on,
/// and says which of the two diverging tokens it prefers.
pub fn arbitrate(
    f32_backend: &mut Decoder,
    prompt: &[u32],
    agreed: &[u32],
    reference: u32,
    candidate: u32,
) -> Result<Arbitration, BackendError> {
    f32_backend.reset();
    let input: Vec<u32> = prompt.iter().chain(agreed).copied().collect();
    let logits = f32_backend.forward(&input)?;
    let at = |t: u32| logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let (choice, _) = top2(&logits);
    let sides_with = if choice == reference {
        "reference"
    } else if choice == candidate {
        "candidate"
    } else {
        "neither"
    };
    Ok(Arbitration { choice, sides_with, margin: at(reference) - at(candidate) })
}

impl ParityOutcome {
    pub fn passed(&self) -> bool {
        self.divergence.is_none()
    }
}

fn fail(step: usize, backend: &Decoder, e: BackendError) -> Divergence {
    Divergence::Error { step, backend: backend.name().into(), message: e.to_string() }
}

/// Prefills `prompt` on both backends, then decodes `steps` greedy tokens,
/// comparing at every step. Stops at the first divergence.
pub fn run(
    reference: &mut Decoder,
    candidate: &mut Decoder,
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
        arbitration: None,
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
        out.steps = step;
        let judged = judge_step(&r, &c, tier, step, &mut out.worst);
        out.min_top2_gap = out.min_top2_gap.min(judged.top2_gap);
        let rt = match judged.token {
            Ok(token) => token,
            Err(divergence) => {
                out.divergence = Some(divergence);
                return out;
            }
        };
        if step == steps {
            break;
        }
        out.tokens.push(rt);
        input = vec![rt];
    }
    out
}

/// One line for a divergence of the `candidate` side from the `reference`
/// side (how the check names each: `ort` and a backend, `alone` and
/// `batched on ...`).
pub fn describe(d: &Divergence, tier: Tier, reference_side: &str, candidate: &str) -> String {
    match d {
        Divergence::Logits { step, deviation } => format!(
            "logits out of tier {} at step {step}: max |d| {:.3e} at token {} ({:.1}x the tolerance)",
            tier.name(),
            deviation.max_abs,
            deviation.worst_index,
            deviation.worst_ratio
        ),
        Divergence::Token { step, reference, candidate: c, top2_gap, max_abs, near_tie } => format!(
            "{}greedy token differs at step {step}: {reference_side} {reference}, {candidate} {c}; reference top-2 gap {top2_gap:.3e}, max |d| {max_abs:.3e}",
            if *near_tie { "NEAR-TIE: " } else { "" },
        ),
        Divergence::Error { step, backend, message } => format!("{backend} failed at step {step}: {message}"),
    }
}

/// One compared step: its deviation, folded into a running worst, and its
/// verdict.
pub(crate) struct Judged {
    /// The greedy token both chose, or how they parted: a token flip (its
    /// near-tie flag set when the reference's top-2 gap is inside twice the
    /// tier's allowance at the winner) before logits outside the tier.
    pub token: Result<u32, Divergence>,
    /// The reference's top-2 gap at this step.
    pub top2_gap: f32,
}

/// Judges one step of any comparison (parity, batching, chunked prefill)
/// by the same rule, so a flip or a tier breach means the same everywhere.
pub(crate) fn judge_step(
    reference: &[f32],
    candidate: &[f32],
    tier: Tier,
    step: usize,
    worst: &mut Deviation,
) -> Judged {
    let dev = compare(reference, candidate, tier);
    if dev.worst_ratio > worst.worst_ratio {
        *worst = dev;
    }
    worst.max_abs = worst.max_abs.max(dev.max_abs);
    let ((rt, gap), (ct, _)) = (top2(reference), top2(candidate));
    let token = if rt != ct {
        let (atol, rtol) = tier.bounds();
        // (A gap an infinity made, or NaN, is no near-tie: an infinite
        // allowance would have passed any parting.)
        let near_tie = gap.is_finite() && gap <= 2.0 * (atol + rtol * reference[rt as usize].abs());
        Err(Divergence::Token { step, reference: rt, candidate: ct, top2_gap: gap, max_abs: dev.max_abs, near_tie })
    } else if dev.worst_ratio > 1.0 {
        Err(Divergence::Logits { step, deviation: dev })
    } else {
        Ok(rt)
    };
    Judged { token, top2_gap: gap }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;

    use onnx_genai_backend::{downcast, DecodeModel, Entry, Sequence};

    /// A scripted model: a sequence at position `i` gets row `i` of the
    /// given logits (the harness logic under test is the comparison, not a
    /// model).
    struct Scripted {
        rows: Vec<Vec<f32>>,
    }

    struct At(usize);

    impl Sequence for At {
        fn kv_len(&self) -> usize {
            self.0
        }
        fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
            self.0 = self.0.min(len);
            Ok(())
        }
        fn reset(&mut self) {
            self.0 = 0;
        }
        fn resident_bytes(&self) -> u64 {
            0
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    impl DecodeModel for Scripted {
        fn name(&self) -> &'static str {
            "scripted"
        }
        fn vocab_size(&self) -> usize {
            self.rows[0].len()
        }
        fn context_length(&self) -> usize {
            self.rows.len()
        }
        fn new_sequence(&self) -> Box<dyn Sequence> {
            Box::new(At(0))
        }
        fn step(&self, batch: &mut [Entry<'_>]) -> Result<(), BackendError> {
            for e in batch {
                let at = downcast::<At>(&mut *e.sequence, "scripted")?;
                let row = self
                    .rows
                    .get(at.0)
                    .ok_or(BackendError::Run { backend: "scripted", reason: "out of rows".into() })?;
                at.0 += 1;
                e.logits.clone_from(row);
            }
            Ok(())
        }
        fn batch_width(&self) -> usize {
            1
        }
        fn kv_granularity(&self) -> usize {
            1
        }
        fn kv_bytes_per_token(&self) -> Option<u64> {
            None
        }

        fn release_idle_memory(&self) -> Option<std::time::Duration> {
            None
        }

        fn kept_memory_bytes(&self) -> u64 {
            0
        }
    }

    fn scripted(rows: Vec<Vec<f32>>) -> Decoder {
        Decoder::new(Arc::new(Scripted { rows }))
    }

    fn run_pair(reference: Vec<Vec<f32>>, candidate: Vec<Vec<f32>>) -> ParityOutcome {
        let steps = reference.len() - 1;
        run(&mut scripted(reference), &mut scripted(candidate), &[1], steps, Tier::F32)
    }

    #[test]
    fn identical_logits_pass_and_record_tokens() {
        let rows = vec![vec![0.0, 2.0, 1.0], vec![3.0, 0.0, 1.0], vec![0.0, 0.0, 5.0]];
        let out = run_pair(rows.clone(), rows);
        assert!(out.passed());
        assert_eq!(out.tokens, vec![1, 0]);
        assert_eq!(out.steps, 2);
    }

    /// A token flip with a wide reference gap is a plain mismatch with the
    /// step, both ids, the gap and max |d|.
    #[test]
    fn a_token_flip_reports_step_ids_gap_and_deviation() {
        let reference = vec![vec![0.0, 2.0, 1.0], vec![3.0, 0.0, 1.0]];
        let candidate = vec![vec![0.0, 2.0, 1.0], vec![0.0, 3.0, 1.0]];
        let out = run_pair(reference, candidate);
        assert_eq!(
            out.divergence,
            Some(Divergence::Token {
                step: 1,
                reference: 0,
                candidate: 1,
                top2_gap: 2.0,
                max_abs: 3.0,
                near_tie: false
            })
        );
    }

    /// When the reference's top two are closer than the tolerance, a flip is
    /// reported as a near-tie — still a divergence, never a pass.
    #[test]
    fn a_flip_inside_the_tolerance_is_a_near_tie_not_a_pass() {
        let reference = vec![vec![1.0, 1.00005, 0.0]];
        let candidate = vec![vec![1.00005, 1.0, 0.0]];
        let out = run_pair(reference, candidate);
        match out.divergence {
            Some(Divergence::Token { near_tie: true, step: 0, .. }) => {}
            other => panic!("expected a near-tie, got {other:?}"),
        }
    }

    /// A reference whose winner is infinite parts from a candidate that
    /// picks another token as a plain mismatch: the gap an infinity makes
    /// is no near-tie (its allowance, twice `rtol · inf`, was infinite, so
    /// the flip passed as a near-tie; audit of `check`); and logits both
    /// sides mask to minus infinity agree.
    #[test]
    fn an_infinite_winner_is_no_near_tie() {
        let (inf, ninf) = (f32::INFINITY, f32::NEG_INFINITY);
        let out = run_pair(vec![vec![inf, 1.0, ninf]], vec![vec![5.0, 6.0, ninf]]);
        match out.divergence {
            Some(Divergence::Token { near_tie: false, reference: 0, candidate: 1, .. }) => {}
            other => panic!("expected a plain token mismatch, got {other:?}"),
        }
        let masked = vec![vec![ninf, 2.0, 1.0, ninf], vec![ninf, 0.5, 3.0, ninf]];
        assert!(run_pair(masked.clone(), masked).passed());
    }

    /// The arbiter names the side whose token the f32 run prefers, with the
    /// f32 margin between the two tokens.
    #[test]
    fn arbitration_names_the_side_f32_prefers() {
        let mut f32_run = scripted(vec![vec![0.0, 2.0, 2.5]]);
        let a = arbitrate(&mut f32_run, &[1], &[], 1, 2).unwrap();
        assert_eq!((a.choice, a.sides_with, a.margin), (2, "candidate", -0.5));
        let mut f32_run = scripted(vec![vec![0.0, 2.0, 2.5]]);
        assert_eq!(arbitrate(&mut f32_run, &[1], &[], 2, 0).unwrap().sides_with, "reference");
        let mut f32_run = scripted(vec![vec![3.0, 2.0, 2.5]]);
        assert_eq!(arbitrate(&mut f32_run, &[1], &[], 1, 2).unwrap().sides_with, "neither");
    }

    /// Same greedy token but logits beyond the tier: a logits divergence at
    /// that step.
    #[test]
    fn logits_outside_the_tier_fail_even_when_tokens_agree() {
        let reference = vec![vec![0.0, 5.0, 1.0], vec![0.0, 5.0, 1.0]];
        let candidate = vec![vec![0.0, 5.0, 1.0], vec![0.01, 5.0, 1.0]];
        match run_pair(reference, candidate).divergence {
            Some(Divergence::Logits { step: 1, deviation }) => assert!(deviation.worst_ratio > 1.0),
            other => panic!("expected a logits divergence, got {other:?}"),
        }
    }
}

//! Parity under batching (INVARIANTS B1): every sequence of a batched run
//! must decode what the same prompt decodes alone on the same backend (how
//! close that is to ONNX Runtime is the parity suite's question). The
//! sequences have mixed prompt lengths and join mid-flight, so one model
//! step mixes a newcomer's prefill with the others' decode tokens, and they
//! leave at different steps.

use std::sync::Arc;

use onnx_genai_backend::{DecodeModel, Decoder, Entry, Input, Sequence};
use serde::Serialize;

use crate::parity::{judge_step, Divergence};
use crate::tolerance::{top2, Deviation, Tier};

/// A sequence joins the batch this many model steps after the one before
/// it: late enough that the earlier ones are decoding when it prefills.
pub const JOIN_EVERY: usize = 3;

/// The prompts a batch check runs: each suite prompt, and each one's first
/// half (so lengths differ even within one prompt's family).
pub fn mixed_lengths(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = prompts.to_vec();
    for p in prompts {
        if p.len() >= 4 {
            out.push(p[..p.len() / 2].to_vec());
        }
    }
    out
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BatchOutcome {
    /// Sequences in the batch.
    pub sequences: usize,
    /// Model steps run.
    pub model_steps: usize,
    /// Most sequences one model step advanced.
    pub widest: usize,
    /// Worst deviation of any sequence's logits from the same prompt alone.
    pub worst: Deviation,
    /// The first divergence, with the index of the sequence it hit.
    pub divergence: Option<(usize, Divergence)>,
}

impl BatchOutcome {
    pub fn passed(&self) -> bool {
        self.divergence.is_none() && self.widest >= 2
    }
}

/// What one prompt decodes alone: the logits after the prefill and after
/// each of `steps` greedy tokens.
fn decode_alone(decoder: &mut Decoder, prompt: &[u32], steps: usize) -> Result<Vec<Vec<f32>>, Divergence> {
    decoder.reset();
    let name = decoder.name();
    let fail = |step, e: onnx_genai_backend::BackendError| Divergence::Error {
        step,
        backend: name.into(),
        message: e.to_string(),
    };
    let mut logits = vec![decoder.forward(prompt).map_err(|e| fail(0, e))?];
    for step in 1..=steps {
        let (token, _) = top2(&logits[step - 1]);
        logits.push(decoder.forward(&[token]).map_err(|e| fail(step, e))?);
    }
    Ok(logits)
}

struct Lane {
    sequence: Box<dyn Sequence>,
    input: Vec<u32>,
    logits: Vec<f32>,
    /// Steps of this sequence compared so far (0 = its prefill).
    done: usize,
    joins_at: usize,
}

/// Runs every prompt alone on `alone` (one sequence of a model loaded like
/// `model`), then all of them as one batch on `model` (sequence `i` joining
/// at model step `JOIN_EVERY * i`), comparing
/// each sequence's logits at each of its steps within `tier` and its greedy
/// tokens exactly. Stops at the first divergence.
pub fn run(
    alone: &mut Decoder,
    model: &Arc<dyn DecodeModel>,
    prompts: &[Vec<u32>],
    steps: usize,
    tier: Tier,
) -> BatchOutcome {
    let mut out = BatchOutcome {
        sequences: prompts.len(),
        model_steps: 0,
        widest: 0,
        worst: Deviation { max_abs: 0.0, worst_index: 0, worst_ratio: 0.0 },
        divergence: None,
    };
    let mut expected = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        match decode_alone(alone, p, steps) {
            Ok(l) => expected.push(l),
            Err(d) => {
                out.divergence = Some((i, d));
                return out;
            }
        }
    }
    let mut lanes: Vec<Lane> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Lane {
            sequence: model.new_sequence(),
            input: p.clone(),
            logits: Vec::new(),
            done: 0,
            joins_at: JOIN_EVERY * i,
        })
        .collect();
    let mut t = 0;
    while lanes.iter().any(|l| l.done <= steps) {
        let active: Vec<usize> = (0..lanes.len()).filter(|&i| active_lane(&lanes[i], t, steps)).collect();
        if active.is_empty() {
            t += 1;
            continue;
        }
        out.widest = out.widest.max(active.len());
        out.model_steps += 1;
        let mut entries: Vec<Entry<'_>> = lanes
            .iter_mut()
            .filter(|l| active_lane(l, t, steps))
            .map(|Lane { sequence, input, logits, .. }| Entry {
                sequence: sequence.as_mut(),
                input: Input::Tokens(input),
                logits,
            })
            .collect();
        if let Err(e) = model.step(&mut entries) {
            let step = lanes[active[0]].done;
            out.divergence =
                Some((active[0], Divergence::Error { step, backend: model.name().into(), message: e.to_string() }));
            return out;
        }
        drop(entries);
        t += 1;
        for &i in &active {
            let lane = &mut lanes[i];
            let reference = &expected[i][lane.done];
            match judge_step(reference, &lane.logits, tier, lane.done, &mut out.worst).token {
                Ok(token) => {
                    lane.input.clear();
                    lane.input.push(token);
                }
                Err(divergence) => {
                    out.divergence = Some((i, divergence));
                    return out;
                }
            }
            lane.done += 1;
        }
    }
    out
}

/// Chunks a continuing prompt arrives in: 5 tokens, then 1 at position 5,
/// 7 at position 64 and 31 at position 200 (with fillers between), as a
/// session's later turns arrive mid-sequence. Every chunk's rotary
/// positions and KV appends start at a nonzero offset.
pub const CHUNKS: [usize; 6] = [5, 1, 58, 7, 129, 31];

/// The worst deviation of a chunked prefill from one-shot prefills of the
/// same prefixes, and the first divergence.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChunkedOutcome {
    pub worst: Deviation,
    pub divergence: Option<Divergence>,
}

/// Feeds `prompt` (cycled to the chunks' total length) to `decoder` in
/// [`CHUNKS`], and compares the logits after each chunk with a one-shot
/// prefill of the same prefix: within `tier`, the same greedy token (a
/// near tie of the reference excepted). A wrong rotary offset or an
/// off-by-one KV append for a multi-token chunk past position 0 shows
/// here, on each backend, where the suites' prompt-then-single-tokens runs
/// cannot see it (issue 21).
pub fn chunked(decoder: &mut Decoder, prompt: &[u32], tier: Tier) -> ChunkedOutcome {
    let mut out =
        ChunkedOutcome { worst: Deviation { max_abs: 0.0, worst_index: 0, worst_ratio: 0.0 }, divergence: None };
    let total: usize = CHUNKS.iter().sum();
    let tokens: Vec<u32> = prompt.iter().copied().cycle().take(if prompt.is_empty() { 0 } else { total }).collect();
    if tokens.len() < total {
        out.divergence = Some(Divergence::Error {
            step: 0,
            backend: decoder.name().into(),
            message: "an empty prompt cannot be chunked".into(),
        });
        return out;
    }
    let name = decoder.name();
    let fail = |step, e: onnx_genai_backend::BackendError| Divergence::Error {
        step,
        backend: name.into(),
        message: e.to_string(),
    };
    // The one-shot references first (each from an empty sequence).
    let mut references = Vec::with_capacity(CHUNKS.len());
    let mut end = 0;
    for (step, chunk) in CHUNKS.iter().enumerate() {
        end += chunk;
        decoder.reset();
        match decoder.forward(&tokens[..end]) {
            Ok(l) => references.push(l),
            Err(e) => {
                out.divergence = Some(fail(step, e));
                return out;
            }
        }
    }
    decoder.reset();
    let mut start = 0;
    for (step, (chunk, reference)) in CHUNKS.iter().zip(&references).enumerate() {
        let logits = match decoder.forward(&tokens[start..start + chunk]) {
            Ok(l) => l,
            Err(e) => {
                out.divergence = Some(fail(step, e));
                return out;
            }
        };
        start += chunk;
        if let Err(divergence) = judge_step(reference, &logits, tier, step, &mut out.worst).token {
            out.divergence = Some(divergence);
            return out;
        }
    }
    out
}

/// Whether `lane` is in the batch at model step `t`: joined, not finished.
fn active_lane(lane: &Lane, t: usize, steps: usize) -> bool {
    lane.joins_at <= t && lane.done <= steps
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mixed lengths: every prompt plus the first half of each long enough
    /// one, so a batch never holds only equal lengths.
    #[test]
    fn mixed_lengths_adds_halves() {
        let got = mixed_lengths(&[vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
        assert_eq!(got, vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8], vec![1, 2, 3]]);
    }
}

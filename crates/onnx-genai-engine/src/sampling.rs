//! Token selection: greedy, or seeded sampling with temperature, top-k,
//! top-p and min-p; before either, the request's logit adjustments
//! (repetition, presence and frequency penalties, logit bias).

use std::collections::HashMap;

/// Sampling options. `temperature` 0 (the default) is greedy decoding; every
/// adjustment's default leaves the logits as they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// Drops tokens less likely than `min_p` times the likeliest (after
    /// temperature); 0 keeps every token.
    pub min_p: f32,
    pub seed: u64,
    /// OpenAI's: subtracted once from the logit of every token generated so
    /// far, in [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was
    /// generated so far, in [-2, 2].
    pub frequency_penalty: f32,
    /// The CTRL/Hugging Face rule: a token of the prompt or the generated
    /// text has a positive logit divided by it and a negative one multiplied
    /// by it; 1 leaves logits alone, > 1 discourages repeats.
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (OpenAI's `logit_bias`, each
    /// in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

/// OpenAI's range of `presence_penalty` and `frequency_penalty`.
pub const PENALTY_RANGE: std::ops::RangeInclusive<f32> = -2.0..=2.0;
/// OpenAI's range of a `logit_bias` value.
pub const BIAS_RANGE: std::ops::RangeInclusive<f32> = -100.0..=100.0;

impl Sampling {
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !PENALTY_RANGE.contains(&v) {
                return Err(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!("repetition_penalty must be a finite number > 0, got {}", self.repetition_penalty));
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !BIAS_RANGE.contains(b)) {
            return Err(format!("logit_bias of token {id} must be between -100 and 100, got {b}"));
        }
        Ok(())
    }

    /// Refuses a `logit_bias` token id outside a `vocab`-token vocabulary.
    pub fn check_vocabulary(&self, vocab: usize) -> Result<(), String> {
        match self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            Some((id, _)) => Err(format!(
                "logit_bias names token {id}, outside the model's vocabulary of {vocab} tokens (ids 0 to {})",
                vocab.saturating_sub(1)
            )),
            None => Ok(()),
        }
    }

    fn adjusts(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// Draws tokens from logits; owns the random stream of one request and the
/// counts its penalties read.
pub struct Sampler {
    options: Sampling,
    state: u64,
    /// How often each token was generated (presence, frequency).
    generated: HashMap<u32, u32>,
    /// Tokens of the prompt (the repetition penalty reads them too).
    prompt: std::collections::HashSet<u32>,
    /// The adjusted logits (reused from step to step).
    adjusted: Vec<f32>,
}

impl Sampler {
    pub fn new(options: Sampling) -> Self {
        // xorshift's one stuck state is 0: the seed that maps there (the
        // multiplier itself) would draw 0 for ever, greedy in disguise.
        let state = match options.seed ^ 0x2545_F491_4F6C_DD1D {
            0 => 0x9E37_79B9_7F4A_7C15,
            state => state,
        };
        Self { options, state, generated: HashMap::new(), prompt: Default::default(), adjusted: Vec::new() }
    }

    /// Tokens of the prompt (a session's carried history included), for the
    /// repetition penalty.
    pub fn with_prompt(mut self, tokens: impl IntoIterator<Item = u32>) -> Self {
        if self.options.repetition_penalty != 1.0 {
            self.prompt.extend(tokens);
        }
        self
    }

    /// Uniform in [0, 1) (xorshift64*).
    fn next_unit(&mut self) -> f64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token and counts it as generated.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let token = if self.options.adjusts() {
            let mut adjusted = std::mem::take(&mut self.adjusted);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            self.adjust(&mut adjusted);
            let token = self.select(&adjusted);
            self.adjusted = adjusted;
            token
        } else {
            self.select(logits)
        };
        *self.generated.entry(token).or_default() += 1;
        token
    }

    fn adjust(&self, logits: &mut [f32]) {
        let o = &self.options;
        if o.repetition_penalty != 1.0 {
            // Each seen token once, whether it came from the prompt, the
            // output or both.
            let generated_only = self.generated.keys().filter(|id| !self.prompt.contains(id));
            let seen = self.prompt.iter().chain(generated_only);
            for &id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / o.repetition_penalty } else { *l * o.repetition_penalty };
                }
            }
        }
        for (&id, &count) in &self.generated {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= o.presence_penalty + o.frequency_penalty * count as f32;
            }
        }
        for &(id, bias) in &o.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
    }

    fn select(&mut self, logits: &[f32]) -> u32 {
        if self.options.temperature == 0.0 {
            return argmax(logits);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        // Ties break by lower id so sampling is reproducible across sorts.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.options.top_k > 0 {
            order.truncate(self.options.top_k);
        }
        let max = logits[order[0]];
        let t = f64::from(self.options.temperature);
        let mut weights: Vec<f64> = order.iter().map(|&i| (f64::from(logits[i] - max) / t).exp()).collect();
        // min-p: the likeliest token has weight 1 (it is the maximum).
        let floor = f64::from(self.options.min_p);
        let above = weights.iter().take_while(|w| **w >= floor).count().max(1);
        weights.truncate(above);
        let total: f64 = weights.iter().sum();
        let mut kept = 0;
        let mut mass = 0.0;
        for w in &weights {
            kept += 1;
            mass += w / total;
            if mass >= f64::from(self.options.top_p) {
                break;
            }
        }
        let kept_total: f64 = weights[..kept].iter().sum();
        let mut draw = self.next_unit() * kept_total;
        for (w, &id) in weights[..kept].iter().zip(&order) {
            if draw < *w {
                return id as u32;
            }
            draw -= w;
        }
        // Rounding left the draw past the end: the last token with any
        // weight (never one a mask set to -inf).
        let last = weights[..kept].iter().rposition(|w| *w > 0.0).unwrap_or(0);
        order[last] as u32
    }
}

/// A generated token's log-probability under the model's own distribution
/// (its logits before penalties, bias, a response format's mask and
/// temperature: what vLLM calls raw logprobs), with the likeliest tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The likeliest tokens, likeliest first (a tie goes to the lower id).
    pub top: Vec<(u32, f32)>,
}

/// Most alternatives a token may report (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-sum-exp of `logits` and their `k` likeliest tokens with their
/// log-probabilities.
pub fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (id, &l) in logits.iter().enumerate() {
        if top.len() == k && top.last().is_none_or(|&(_, worst)| l <= worst) {
            continue;
        }
        let at = top.partition_point(|&(_, v)| v >= l);
        top.insert(at, (id as u32, l));
        top.truncate(k);
    }
    (lse, top.into_iter().map(|(id, l)| (id, l - lse)).collect())
}

/// Index of the largest logit; the lowest index wins a tie (and `±0` tie).
/// NaN logits are passed over, unless the first one is NaN: nothing
/// compares greater than it, so it stays the answer, as in the one-pass
/// loop "replace the best when strictly greater" that this equals.
///
/// Two passes of fixed-width chunks, which the compiler turns into vector
/// compares: the largest value, then the first chunk holding it. (The
/// one-pass loop, a branch and a reload per logit, was 3% of the driver
/// thread's time serving 16 greedy clients of SmolLM2: 16 x 49,152 logits
/// a step, while the model's other threads wait for the next step.)
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let Some(&first) = logits.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            // `>` passes NaN over (a comparison with NaN is false).
            *m = if *v > *m { *v } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(first, |m, v| if *v > m { *v } else { m });
    let at = logits.chunks(LANES).position(|chunk| chunk.iter().fold(false, |seen, v| seen | (*v == max))).unwrap_or(0);
    let within = logits[at * LANES..].iter().position(|v| *v == max).unwrap_or(0);
    (at * LANES + within) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed draws: the one whose state would be xorshift's fixed
    /// point 0 (seed 0x2545F4914F6CDD1D) gets varied draws like any other.
    #[test]
    fn no_seed_sticks_the_generator() {
        for seed in [0, 1, 0x2545_F491_4F6C_DD1D, u64::MAX] {
            let mut s = Sampler::new(Sampling { seed, ..Sampling::default() });
            let draws: Vec<f64> = (0..8).map(|_| s.next_unit()).collect();
            assert!(
                draws.windows(2).any(|w| w[0] != w[1]) && draws.iter().any(|d| *d > 0.0),
                "seed {seed:#x}: {draws:?}"
            );
        }
    }

    /// The log-probabilities are those of the softmax, computed apart:
    /// they exponentiate to probabilities summing to one, the top list is
    /// the likeliest in order (ties to the lower id), and it is cut at `k`.
    #[test]
    fn log_softmax_top_matches_the_softmax() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let (lse, top) = log_softmax_top(&logits, 3);
        let total: f32 = logits.iter().map(|l| (l - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0]);
        for (id, lp) in top {
            assert!((lp - (logits[id as usize].exp() / z).ln()).abs() < 1e-6, "{id}: {lp}");
        }
        assert!(log_softmax_top(&logits, 0).1.is_empty());
        assert_eq!(log_softmax_top(&logits, 9).1.len(), logits.len());
    }

    /// Greedy decoding's choice is the one-pass definition "the first
    /// logit strictly greater than every earlier best", on every length
    /// around the chunk width and with ties, `±0`, `±inf` and NaN placed
    /// anywhere, the first position included.
    #[test]
    fn argmax_is_the_first_strict_maximum() {
        fn one_pass(logits: &[f32]) -> u32 {
            let mut best = 0;
            for (i, v) in logits.iter().enumerate() {
                if *v > logits[best] {
                    best = i;
                }
            }
            best as u32
        }
        let specials = [f32::NAN, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 7.0, 7.0, -3.5];
        let mut state = 0x9e37_79b9_u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for len in [0, 1, 2, 15, 16, 17, 31, 32, 33, 100, 49_152] {
            for _ in 0..40 {
                let mut logits: Vec<f32> = (0..len).map(|_| (next() % 21) as f32 - 10.0).collect();
                for _ in 0..next() % 4 {
                    if len > 0 {
                        let at = next() as usize % len;
                        logits[at] = specials[next() as usize % specials.len()];
                    }
                }
                assert_eq!(argmax(&logits), one_pass(&logits), "{logits:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0, 5.0]), 2);
        assert_eq!(argmax(&[-1.0, -0.0, 0.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(Sampling::default());
        assert_eq!(s.pick(&[0.0, 1.0, 5.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_temperature() {
        let mut s = Sampler::new(Sampling { temperature: 5.0, top_k: 1, seed: 9, ..Sampling::default() });
        for _ in 0..50 {
            assert_eq!(s.pick(&[0.0, 1.0, 5.0, 4.9]), 2);
        }
    }

    #[test]
    fn same_seed_same_draws_and_sampling_spreads() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let opts = Sampling { temperature: 1.0, seed: 7, ..Sampling::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(opts.clone());
            (0..64).map(|_| s.pick(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(opts);
            (0..64).map(|_| s.pick(&logits)).collect()
        };
        assert_eq!(a, b);
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), 4, "uniform logits should reach every token: {a:?}");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let mut s = Sampler::new(Sampling { temperature: 1.0, top_p: 0.5, seed: 3, ..Sampling::default() });
        // Token 0 holds far more than half of the mass.
        for _ in 0..50 {
            assert_eq!(s.pick(&[10.0, 0.0, 0.0]), 0);
        }
    }

    /// Issue 19: OpenAI's presence and frequency penalties subtract from the
    /// logits of generated tokens (once, and once per occurrence), so a
    /// greedy decode that would repeat one token moves on; at 0 nothing
    /// changes.
    #[test]
    fn presence_and_frequency_penalties_push_repeats_down() {
        let logits = [3.0, 2.5, 0.0];
        let mut plain = Sampler::new(Sampling::default());
        assert_eq!((0..3).map(|_| plain.pick(&logits)).collect::<Vec<_>>(), [0, 0, 0]);
        let mut presence = Sampler::new(Sampling { presence_penalty: 1.0, ..Sampling::default() });
        // 0 (3.0), then 0 is at 2.0 < 2.5: 1, then both penalized once: 0 again.
        assert_eq!((0..3).map(|_| presence.pick(&logits)).collect::<Vec<_>>(), [0, 1, 0]);
        let mut frequency = Sampler::new(Sampling { frequency_penalty: 0.4, ..Sampling::default() });
        // 0: 3.0; 0 at 2.6 > 2.5: 0; 0 at 2.2 < 2.5: 1; 1 at 2.1 < 2.2: 0.
        assert_eq!((0..4).map(|_| frequency.pick(&logits)).collect::<Vec<_>>(), [0, 0, 1, 0]);
    }

    /// The repetition penalty divides a seen token's positive logit and
    /// multiplies a negative one, prompt tokens included.
    #[test]
    fn the_repetition_penalty_reads_the_prompt_and_both_signs() {
        let opts = Sampling { repetition_penalty: 2.0, ..Sampling::default() };
        let mut s = Sampler::new(opts.clone()).with_prompt([0]);
        // 0 seen in the prompt: 4.0 / 2 = 2.0 < 3.0.
        assert_eq!(s.pick(&[4.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(opts.clone()).with_prompt([2]);
        // A negative logit is pushed further down: -0.5 * 2 = -1.0 < -0.8.
        assert_eq!(s.pick(&[-2.0, -0.8, -0.5]), 1);
        // A token both in the prompt and generated is penalized once: it
        // is generated (8.0 / 2 = 4.0 > 3.5), then 6.0 / 2 = 3.0 > 2.9
        // (twice would be 1.5).
        let mut s = Sampler::new(opts).with_prompt([0]);
        assert_eq!(s.pick(&[8.0, 3.5]), 0);
        assert_eq!(s.pick(&[6.0, 2.9]), 0);
    }

    /// Logit bias is added before greedy and sampled choices alike: +100
    /// forces a token, -100 bans one.
    #[test]
    fn logit_bias_forces_and_bans_tokens() {
        let mut s = Sampler::new(Sampling { logit_bias: vec![(2, 100.0)], ..Sampling::default() });
        assert_eq!(s.pick(&[5.0, 1.0, 0.0]), 2);
        let opts = Sampling { temperature: 1.0, seed: 5, logit_bias: vec![(0, -100.0)], ..Sampling::default() };
        let mut s = Sampler::new(opts);
        assert!((0..100).all(|_| s.pick(&[0.0, 0.0, 0.0]) != 0));
    }

    /// min-p keeps only tokens at least `min_p` times as likely as the
    /// likeliest; with it off, the unlikely token is drawn sometimes.
    #[test]
    fn min_p_drops_the_unlikely_tail() {
        // exp(-3) ~ 0.05 of the top token's weight.
        let logits = [0.0, 0.0, -3.0];
        let opts = Sampling { temperature: 1.0, seed: 11, ..Sampling::default() };
        let mut off = Sampler::new(opts.clone());
        assert!((0..400).any(|_| off.pick(&logits) == 2));
        let mut on = Sampler::new(Sampling { min_p: 0.1, ..opts });
        assert!((0..400).all(|_| on.pick(&logits) != 2));
    }

    /// Out-of-range adjustments and bias ids outside the vocabulary are
    /// refused, naming the field.
    #[test]
    fn bad_adjustments_are_refused_by_name() {
        let bad = [
            Sampling { presence_penalty: 2.5, ..Sampling::default() },
            Sampling { frequency_penalty: -3.0, ..Sampling::default() },
            Sampling { repetition_penalty: 0.0, ..Sampling::default() },
            Sampling { min_p: 1.5, ..Sampling::default() },
            Sampling { logit_bias: vec![(1, 101.0)], ..Sampling::default() },
        ];
        for (s, name) in
            bad.iter().zip(["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"])
        {
            let e = s.check().unwrap_err();
            assert!(e.starts_with(name), "{e}");
        }
        let bias = Sampling { logit_bias: vec![(3, 1.0), (384, 1.0)], ..Sampling::default() };
        assert!(bias.check().is_ok());
        assert!(bias.check_vocabulary(384).unwrap_err().contains("token 384, outside the model's vocabulary of 384"));
        assert!(bias.check_vocabulary(385).is_ok());
    }
}

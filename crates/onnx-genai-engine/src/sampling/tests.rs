//! The sampler against its definitions: the full sort, the softmax,
//! the seeds' independence.
use super::*;

/// Every seed draws: the one whose state would be xorshift's fixed
/// point 0 (seed 0x2545F4914F6CDD1D) gets varied draws like any other.
#[test]
fn no_seed_sticks_the_generator() {
    assert_eq!(mix(0x61C8_8646_80B5_83EB), 0, "the seed xorshift would stick on");
    for seed in [0, 1, 0x61C8_8646_80B5_83EB, u64::MAX] {
        let mut s = Sampler::new(Sampling { seed, ..Sampling::default() });
        let draws: Vec<f64> = (0..8).map(|_| s.next_unit()).collect();
        assert!(draws.windows(2).any(|w| w[0] != w[1]) && draws.iter().any(|d| *d > 0.0), "seed {seed:#x}: {draws:?}");
    }
}

/// The choices of one request draw apart: four choices (`seed + k`)
/// of a flat distribution of four tokens all open with one token about
/// as often as chance says (1/64 of requests), over 10,000 base seeds.
/// Seeding xorshift with the seed itself made it 6x as often (970).
#[test]
fn adjacent_seeds_draw_apart() {
    let same = (0..10_000u64)
        .filter(|base| {
            let firsts: Vec<u32> = (0..4)
                .map(|k| {
                    let options = Sampling { temperature: 1.0, seed: base + k, ..Sampling::default() };
                    Sampler::new(options).pick(&[0.0; 4])
                })
                .collect();
            firsts.iter().all(|t| *t == firsts[0])
        })
        .count();
    assert!((80..300).contains(&same), "{same} of 10,000 requests' four choices opened alike (156 expected)");
}

/// The draw sorts only the likeliest tokens unless it must, and draws
/// what sorting the whole vocabulary draws: for every option (top-k,
/// top-p, min-p, temperature) on peaked and flat logits of 5,000
/// tokens — flat ones put most draws past the first 1,024 — the same
/// token from the same random stream as the full sort.
#[test]
fn drawing_from_the_likeliest_equals_sorting_everything() {
    /// The draw over the whole vocabulary sorted (the definition).
    fn everything(options: &Sampling, unit: f64, logits: &[f32]) -> u32 {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if options.top_k > 0 {
            order.truncate(options.top_k);
        }
        let max = logits[order[0]];
        let inv_t = 1.0 / options.temperature;
        let mut weights: Vec<f64> =
            order.iter().map(|&i| f64::from(exp_nonpositive((logits[i] - max) * inv_t))).collect();
        let above = weights.iter().take_while(|w| **w >= f64::from(options.min_p)).count().max(1);
        weights.truncate(above);
        let total: f64 = weights.iter().sum();
        let mut kept = weights.len();
        if options.top_p < 1.0 {
            let mut mass = 0.0;
            kept = 0;
            for w in &weights {
                kept += 1;
                mass += w / total;
                if mass >= f64::from(options.top_p) {
                    break;
                }
            }
        }
        let mut draw = unit * weights[..kept].iter().sum::<f64>();
        for (w, &id) in weights[..kept].iter().zip(&order) {
            if draw < *w {
                return id as u32;
            }
            draw -= w;
        }
        order[weights[..kept].iter().rposition(|w| *w > 0.0).unwrap_or(0)] as u32
    }
    let mut noise = Sampler::new(Sampling { seed: 7, ..Sampling::default() });
    let (mut past_sorted, mut past_near) = (0, 0);
    for case in 0..216u64 {
        // Flat, spread, wide, and one likely token over a heavy tail
        // past the near ones (a quarter of the weight, at every
        // temperature).
        let shape = case as usize % 4;
        let temperature = [0.5f32, 1.0, 1.7][(case / 4) as usize % 3];
        let logits: Vec<f32> = (0..5_000)
            .map(|i| {
                let u = noise.next_unit() - 0.5;
                match shape {
                    3 if i == 1_234 => 9.6 * temperature,
                    3 => u as f32 * 0.1,
                    _ => (u * [0.01, 1.0, 8.0][shape]) as f32,
                }
            })
            .collect();
        let options = Sampling {
            temperature,
            top_k: [0usize, 40, 3_000][(case / 12) as usize % 3],
            top_p: [1.0f32, 0.9, 0.3][(case / 36) as usize % 3],
            min_p: [0.0f32, 0.05][(case / 108) as usize % 2],
            seed: case,
            ..Sampling::default()
        };
        let mut sampler = Sampler::new(options.clone());
        let mut twin = Sampler::new(options.clone());
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for _ in 0..if shape == 3 { 8 } else { 2 } {
            let want = everything(&options, twin.next_unit(), &logits);
            assert_eq!(sampler.select(&logits), want, "case {case}: {options:?}");
            let rank = logits.iter().filter(|l| **l > logits[want as usize]).count();
            past_sorted += usize::from(rank >= SORTED_FIRST);
            past_near += usize::from(logits[want as usize] < max - NEAR_LOGITS * options.temperature);
        }
    }
    assert!(past_sorted > 20, "only {past_sorted} draws went past the sorted tokens: that path went untried");
    assert!(past_near > 3, "only {past_near} draws went past the near tokens: that path went untried");
}

/// Degenerate requests draw a token the definition allows and never
/// panic: a temperature whose reciprocal overflows (1e-45, with a min-p
/// cut: every weight was 0 and the cut left no token — an index out of
/// bounds) draws greedily; masked (-inf) tokens are never drawn, even
/// where the draw walks past every weighted token; a top-k beyond the
/// vocabulary keeps it all.
#[test]
fn degenerate_requests_draw_what_the_definition_allows() {
    let mut logits: Vec<f32> =
        (0..6_000).map(|i| if i % 3 == 0 { f32::NEG_INFINITY } else { (i % 7) as f32 * 0.01 }).collect();
    // One likeliest token, alone within 9 temperatures of itself.
    logits[4_001] = 1.0;
    let best = argmax(&logits);
    for min_p in [0.0, 0.5] {
        let tiny = Sampling { temperature: 1e-45, min_p, top_p: 0.9, ..Sampling::default() };
        assert_eq!(Sampler::new(tiny).pick(&logits), best);
    }
    for (top_k, top_p) in [(0, 1.0), (0, 0.999_999), (10_000, 1.0)] {
        let mut s = Sampler::new(Sampling { temperature: 2.0, top_k, top_p, seed: 5, ..Sampling::default() });
        for _ in 0..50 {
            let t = s.pick(&logits);
            assert!(logits[t as usize].is_finite(), "a masked token {t} was drawn");
        }
    }
}

/// A small top-k kept in order as the logits are read is the first k
/// of the whole vocabulary sorted, ties (many here: integer logits) to
/// the lower id.
#[test]
fn the_likeliest_k_are_the_sorted_first_k() {
    let mut noise = Sampler::new(Sampling { seed: 3, ..Sampling::default() });
    for round in 0..20 {
        let logits: Vec<f32> = (0..3_000)
            .map(|_| {
                let u = noise.next_unit() * 40.0 - 20.0;
                if round % 2 == 0 {
                    u.round() as f32
                } else {
                    u as f32
                }
            })
            .collect();
        let mut sorted: Vec<u32> = (0..logits.len() as u32).collect();
        sorted.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        for k in [1, 7, 40, SMALL_TOP_K] {
            let mut order = Vec::new();
            likeliest(&logits, k, &mut order);
            assert_eq!(order, sorted[..k], "round {round}, k {k}");
        }
    }
}

/// The weights' exponential is `exp` to 3e-7 relative over f32's
/// normal range, exactly 1 at 0, and 0 for -inf and below -87.
#[test]
fn the_weights_exponential_is_exp() {
    for i in 0..=87_000 {
        let x = -(i as f32) / 1000.0;
        let (got, want) = (f64::from(exp_nonpositive(x)), f64::from(x).exp());
        assert!((got - want).abs() <= 3e-7 * want, "e^{x}: {got} vs {want}");
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-0.0), 1.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_nonpositive(-88.0), 0.0);
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

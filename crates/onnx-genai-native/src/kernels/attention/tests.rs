//! Attention against direct definitions: ragged batches, long contexts
//! in parts, and batch invariance.

use super::*;
use crate::kernels::Runtime;
use crate::kv::{KvLayout, KvPool};

/// Attention of one query row at position `pos` against keys and values
/// `0..=pos` of one sequence, computed directly (per head: scores,
/// softmax, weighted sum).
fn naive(q: &[f32], keys: &[f32], values: &[f32], pos: usize, spec: &AttentionSpec) -> Vec<f32> {
    let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
    let mut out = vec![0.0; heads * hd];
    for h in 0..heads {
        let g = h / (heads / kvh);
        let key = |t: usize| &keys[(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
        let s: Vec<f32> = (0..=pos)
            .map(|t| q[h * hd..(h + 1) * hd].iter().zip(key(t)).map(|(a, b)| a * b).sum::<f32>() * spec.scale)
            .collect();
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        for (t, w) in e.iter().enumerate() {
            for d in 0..hd {
                out[h * hd + d] += w / sum * values[(t * kvh + g) * hd + d];
            }
        }
    }
    out
}

/// A spec of `heads` query heads over `kvh` KV heads of `hd`, every
/// tensor seq-first.
fn seq_first((heads, kvh, hd): (usize, usize, usize), scale: f32, bias: Bias) -> AttentionSpec {
    AttentionSpec {
        heads,
        kv_heads: kvh,
        head_dim: hd,
        scale,
        q_layout: Layout::SeqFirst,
        kv_layout: Layout::SeqFirst,
        out_layout: Layout::SeqFirst,
        bias,
    }
}

/// A step over several sequences with ragged row counts and histories
/// (a 37-row prefill beside a 3-row one, then a 1-row decode beside a
/// 20-row chunk, then a decode step of both; and five sequences whose
/// steps run one job per sequence with its append, once every segment
/// fits one chunk) equals direct attention row by row, serial and on
/// two threads: the row chunks of a long segment and the claimed jobs
/// (INVARIANTS B1: a sequence's result does not depend on its batch)
/// cover every (sequence, row, head) exactly once, and every new key
/// and value lands at its position.
#[test]
fn ragged_batches_equal_direct_attention() {
    let (heads, kvh, hd) = (6, 2, 8);
    let spec = seq_first((heads, kvh, hd), 0.35, Bias::Causal);
    let value = |i: usize| ((i * 2654435761) % 1000) as f32 / 500.0 - 1.0;
    let batches: [&[&[usize]]; 2] =
        [&[&[37, 3], &[1, 20], &[1, 1]], &[&[37, 3, 1, 5, 16], &[1, 1, 1, 1, 1], &[2, 1, 16, 1, 3]]];
    for steps in batches {
        let n = steps[0].len();
        for rt in [Runtime::serial(), Runtime::new(2).unwrap()] {
            let pool = KvPool::new(KvLayout::new(&[(kvh, hd)], false), 0, std::time::Duration::ZERO);
            let mut caches: Vec<SeqKv> = (0..n).map(|_| SeqKv::new(pool.clone(), 64)).collect();
            // Every key and value each sequence has been given, by position.
            let mut history: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); n];
            let mut seed = 0;
            for lens in steps {
                let rows: usize = lens.iter().sum();
                let mut gen = |n: usize| -> Vec<f32> {
                    seed += n;
                    (0..n).map(|i| value(seed + i)).collect()
                };
                let (q, k, v) = (gen(rows * heads * hd), gen(rows * kvh * hd), gen(rows * kvh * hd));
                let mut segments = Vec::new();
                for (cache, len) in caches.iter().zip(lens.iter()) {
                    let start = segments.last().map_or(0, |s: &Segment| s.start + s.len);
                    segments.push(Segment { start, len: *len, past: cache.len() });
                }
                for (s, seg) in segments.iter().enumerate() {
                    caches[s].reserve(seg.past + seg.len);
                    let span = seg.start * kvh * hd..(seg.start + seg.len) * kvh * hd;
                    history[s].0.extend_from_slice(&k[span.clone()]);
                    history[s].1.extend_from_slice(&v[span]);
                }
                let step = plain_step(&segments, [&q, &k, &v], (heads, kvh, hd), rows);
                let mut out = vec![f32::NAN; rows * heads * hd];
                let mut refs: Vec<&mut SeqKv> = caches.iter_mut().collect();
                attention(&spec, &step, &mut refs, &mut out, &rt.ctx()).unwrap();
                for (s, seg) in segments.iter().enumerate() {
                    caches[s].set_len(seg.past + seg.len);
                    for i in 0..seg.len {
                        let r = seg.start + i;
                        let want = naive(
                            &q[r * heads * hd..(r + 1) * heads * hd],
                            &history[s].0,
                            &history[s].1,
                            seg.past + i,
                            &spec,
                        );
                        let got = &out[r * heads * hd..(r + 1) * heads * hd];
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                                "{n} sequences, seq {s} row {i}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A row that sees more than [`PART_POSITIONS`] positions attends them
/// in parts merged by their softmax maxima and sums: a 1,100-position
/// prefill (its rows past the first part) and decode rows after it
/// equal direct attention; and a decode step of one long sequence,
/// whose parts run as separate jobs on two threads, gives the same bits
/// as the same step of that sequence beside three others (one job
/// running its parts in turn) and as the step on one thread (INVARIANTS
/// B1: a sequence's result does not depend on its batch).
#[test]
fn long_contexts_attend_in_parts() {
    let (heads, kvh, hd) = (6, 2, 16);
    let spec = seq_first((heads, kvh, hd), 0.3, Bias::Causal);
    let value = |i: usize| ((i * 2654435761) % 1000) as f32 / 400.0 - 1.25;
    let gen = |seed: usize, n: usize| -> Vec<f32> { (0..n).map(|i| value(seed * 7919 + i)).collect() };
    let run = |rt: &Runtime, caches: &mut [&mut SeqKv], lens: &[usize], seed: usize| {
        let rows: usize = lens.iter().sum();
        let (q, k, v) = (gen(seed, rows * heads * hd), gen(seed + 1, rows * kvh * hd), gen(seed + 2, rows * kvh * hd));
        let mut segments = Vec::new();
        for (cache, len) in caches.iter_mut().zip(lens) {
            let start = segments.last().map_or(0, |s: &Segment| s.start + s.len);
            segments.push(Segment { start, len: *len, past: cache.len() });
            cache.reserve(cache.len() + len);
        }
        let step = plain_step(&segments, [&q, &k, &v], (heads, kvh, hd), rows);
        let mut out = vec![f32::NAN; rows * heads * hd];
        attention(&spec, &step, caches, &mut out, &rt.ctx()).unwrap();
        for (cache, seg) in caches.iter_mut().zip(&segments) {
            cache.set_len(seg.past + seg.len);
        }
        (q, k, v, out)
    };
    let close = |got: &[f32], want: &[f32], what: &str| {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}: {g} vs {w}");
        }
    };
    let two = Runtime::new(2).unwrap();
    let pool = KvPool::new(KvLayout::new(&[(kvh, hd)], false), 0, std::time::Duration::ZERO);
    let mut long = SeqKv::new(pool.clone(), 2048);
    let prompt = 1100;
    let (q, keys, values, out) = run(&two, &mut [&mut long], &[prompt], 1);
    for i in [0, PART_POSITIONS - 1, PART_POSITIONS, 2 * PART_POSITIONS + 3, prompt - 1] {
        let want = naive(&q[i * heads * hd..(i + 1) * heads * hd], &keys, &values, i, &spec);
        close(&out[i * heads * hd..(i + 1) * heads * hd], &want, &format!("prefill row {i}"));
    }
    let mut alone_serial = long.fork();
    let mut beside = long.fork();
    let mut beside_one = long.fork();
    let mut others: Vec<SeqKv> = (0..3).map(|_| SeqKv::new(pool.clone(), 2048)).collect();
    for (o, other) in others.iter_mut().enumerate() {
        run(&two, &mut [other], &[5 + o], 10 + o);
    }
    let mut short = others[0].fork();
    let (q, k, v, alone) = run(&two, &mut [&mut long], &[1], 20);
    let mut all_keys = keys.clone();
    all_keys.extend_from_slice(&k);
    let mut all_values = values.clone();
    all_values.extend_from_slice(&v);
    close(&alone, &naive(&q, &all_keys, &all_values, prompt, &spec), "a decode row alone");
    let (_, _, _, serial) = run(&Runtime::serial(), &mut [&mut alone_serial], &[1], 20);
    assert_eq!(bits(&alone), bits(&serial), "one thread and two differ");
    let mut batch: Vec<&mut SeqKv> = vec![&mut beside];
    batch.extend(others.iter_mut());
    // The long sequence's row first, then one row of each other; its
    // query, key and value rows are the ones it had alone.
    let rows = 4;
    let (mut q4, mut k4, mut v4) = (gen(30, rows * heads * hd), gen(31, rows * kvh * hd), gen(32, rows * kvh * hd));
    q4[..heads * hd].copy_from_slice(&q);
    k4[..kvh * hd].copy_from_slice(&k);
    v4[..kvh * hd].copy_from_slice(&v);
    let segments: Vec<Segment> =
        batch.iter().enumerate().map(|(s, c)| Segment { start: s, len: 1, past: c.len() }).collect();
    for c in batch.iter_mut() {
        c.reserve(c.len() + 1);
    }
    let step = plain_step(&segments, [&q4, &k4, &v4], (heads, kvh, hd), rows);
    let mut out4 = vec![f32::NAN; rows * heads * hd];
    attention(&spec, &step, &mut batch, &mut out4, &two.ctx()).unwrap();
    assert_eq!(bits(&alone), bits(&out4[..heads * hd]), "the long sequence's row alone and beside others differ");
    // A short sequence first, then the long one: the long one's parts are
    // jobs after the short one's, each merged from its own slots.
    let (q2, k2, v2) = (
        [&q4[heads * hd..2 * heads * hd], &q[..]].concat(),
        [&k4[kvh * hd..2 * kvh * hd], &k[..]].concat(),
        [&v4[kvh * hd..2 * kvh * hd], &v[..]].concat(),
    );
    let segments =
        [Segment { start: 0, len: 1, past: short.len() }, Segment { start: 1, len: 1, past: beside_one.len() }];
    short.reserve(short.len() + 1);
    beside_one.reserve(beside_one.len() + 1);
    let step = plain_step(&segments, [&q2, &k2, &v2], (heads, kvh, hd), 2);
    let mut out2 = vec![f32::NAN; 2 * heads * hd];
    attention(&spec, &step, &mut [&mut short, &mut beside_one], &mut out2, &two.ctx()).unwrap();
    assert_eq!(bits(&out2[heads * hd..]), bits(&alone), "the long sequence's row beside a short one differs");
    assert_eq!(bits(&out2[..heads * hd]), bits(&out4[heads * hd..2 * heads * hd]), "the short sequence's row differs");
}

/// A part whose every key an additive bias masks with -inf weighs nothing
/// in the merge: a 600-position prefill under an explicit causal bias (rows
/// before 88 see no key of their second part) equals direct attention, with
/// no NaN.
#[test]
fn a_masked_part_weighs_nothing() {
    let (heads, kvh, hd) = (4, 2, 8);
    let spec = seq_first((heads, kvh, hd), 0.4, Bias::PerQuery);
    let rows = 600;
    let value = |i: usize| ((i * 2654435761) % 1000) as f32 / 500.0 - 1.0;
    let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        (0..rows * heads * hd).map(value).collect(),
        (0..rows * kvh * hd).map(|i| value(i + 7)).collect(),
        (0..rows * kvh * hd).map(|i| value(i + 13)).collect(),
    );
    let bias: Vec<f32> = (0..rows * rows).map(|i| if i % rows <= i / rows { 0.0 } else { f32::NEG_INFINITY }).collect();
    let pool = KvPool::new(KvLayout::new(&[(kvh, hd)], false), 0, std::time::Duration::ZERO);
    let mut cache = SeqKv::new(pool, 1024);
    cache.reserve(rows);
    let segments = [Segment { start: 0, len: rows, past: 0 }];
    let step = Step {
        bias: Some(AdditiveBias { data: &bias, mode: Bias::PerQuery, shared: true }),
        ..plain_step(&segments, [&q, &k, &v], (heads, kvh, hd), rows)
    };
    let mut out = vec![f32::NAN; rows * heads * hd];
    attention(&spec, &step, &mut [&mut cache], &mut out, &Runtime::new(2).unwrap().ctx()).unwrap();
    for i in [0, 87, 88, 300, 511, 512, rows - 1] {
        let want = naive(&q[i * heads * hd..(i + 1) * heads * hd], &k, &v, i, &spec);
        for (g, w) in out[i * heads * hd..(i + 1) * heads * hd].iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "row {i}: {g} vs {w}");
        }
    }
}

/// Segments must lie in order and apart, inside the step: two segments
/// over one row would have two jobs write its output at once (a race on
/// the output through `Disjoint`), and an end past `usize` wrapped under
/// the bound. Each is refused by name, nothing written.
#[test]
fn overlapping_or_outside_segments_are_refused() {
    let (heads, kvh, hd) = (2, 1, 8);
    let spec = seq_first((heads, kvh, hd), 0.4, Bias::Causal);
    let rows = 4;
    let (q, k, v) = (vec![0.5; rows * heads * hd], vec![0.25; rows * kvh * hd], vec![1.0; rows * kvh * hd]);
    let cases: [(&[Segment], &str); 3] = [
        (&[Segment { start: 0, len: 1, past: 0 }, Segment { start: 0, len: 1, past: 0 }], "overlaps"),
        (&[Segment { start: 2, len: 2, past: 0 }, Segment { start: 0, len: 1, past: 0 }], "overlaps"),
        (&[Segment { start: 1, len: usize::MAX, past: 0 }], "outside"),
    ];
    for (segments, why) in cases {
        let pool = KvPool::new(KvLayout::new(&[(kvh, hd)], false), 0, std::time::Duration::ZERO);
        let mut caches: Vec<SeqKv> = segments.iter().map(|_| SeqKv::new(pool.clone(), 64)).collect();
        caches.iter_mut().for_each(|c| c.reserve(4));
        let mut kvs: Vec<&mut SeqKv> = caches.iter_mut().collect();
        let step = plain_step(segments, [&q, &k, &v], (heads, kvh, hd), rows);
        let mut out = vec![f32::NAN; rows * heads * hd];
        let err = attention(&spec, &step, &mut kvs, &mut out, &Runtime::new(2).unwrap().ctx()).unwrap_err();
        assert!(err.contains(why), "{segments:?}: {err}");
        assert!(out.iter().all(|v| v.is_nan()), "{segments:?}: written before refused");
    }
}

/// Layer 0 of a step over `rows` rows of plain (seq-first) query, key and
/// value tensors, no rotary, no bias.
fn plain_step<'a>(
    segments: &'a [Segment],
    [q, k, v]: [&'a [f32]; 3],
    (heads, kvh, hd): (usize, usize, usize),
    rows: usize,
) -> Step<'a> {
    Step {
        layer: 0,
        segments,
        q: Heads::plain(q, Layout::SeqFirst, heads, rows, hd),
        k: Heads::plain(k, Layout::SeqFirst, kvh, rows, hd),
        v: Heads::plain(v, Layout::SeqFirst, kvh, rows, hd),
        rotary: None,
        bias: None,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

//! Where a batched decode step spends its time: loads a package, prefills
//! B sequences (the first one's prefill timed per op kind), then times
//! decode steps of all B together, per op kind and per projection size.
//!
//! `cargo run --release -p onnx-genai-native --example batch_profile -- DIR [THREADS] [B...] [isa=NAME] [kv=f16] [prompt=N]`
//! (`isa=avx2` and so on: a lower kernel path than the best this CPU has;
//! `kv=f16`: the KV cache in f16; `prompt=N`: prompts of about N tokens,
//! 12 by default).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use onnx_genai_backend::{DecodeModel, Entry, Input};
use onnx_genai_native::NativeModel;
use onnx_genai_package::Package;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: batch_profile DIR [THREADS] [B...]")?;
    let threads: usize = args.next().map_or(Ok(2), |t| t.parse())?;
    let (options, batches): (Vec<String>, Vec<String>) = args.partition(|a| a.contains('='));
    let option = |key: &str| options.iter().rev().find_map(|a| a.strip_prefix(key)?.strip_prefix('='));
    let mut batches: Vec<usize> = batches.iter().map(|b| b.parse()).collect::<Result<_, _>>()?;
    if batches.is_empty() {
        batches = vec![1, 8, 16];
    }
    let kv: onnx_genai_backend::KvCache = option("kv").unwrap_or("model").parse()?;
    let prompt: u32 = option("prompt").map_or(Ok(12), str::parse)?;
    let package = Package::open(std::path::Path::new(&dir))?;
    let model = NativeModel::load_with(&package, threads, kv)?;
    if let Some(name) = option("isa") {
        let isa = onnx_genai_native::kernels::isa::Isa::parse(name).ok_or_else(|| format!("unknown isa {name}"))?;
        model.set_isa(isa)?;
    }
    let ops = model.plan().step_ops();
    let steps = 32;
    for b in batches {
        let mut seqs: Vec<_> = (0..b).map(|_| model.new_sequence()).collect();
        let mut logits = vec![Vec::new(); b];
        let prompts: Vec<Vec<u32>> =
            (0..b).map(|i| (0..prompt + i as u32).map(|t| 100 + (7 * t) % 9000).collect()).collect();
        for (i, ((s, p), l)) in seqs.iter_mut().zip(&prompts).zip(logits.iter_mut()).enumerate() {
            model.set_profiling(i == 0);
            let t = Instant::now();
            model.step(&mut [Entry { sequence: &mut **s, input: Input::Tokens(p), logits: l }])?;
            if i == 0 {
                // The first sequence's prefill, per op kind.
                let wall = t.elapsed();
                let sorted = by_op_kind(&ops, &model.profile());
                let top: Vec<String> =
                    sorted.iter().take(4).map(|(op, d)| format!("{op} {:.1}", d.as_secs_f64() * 1e3)).collect();
                println!("prefill of {} tokens: {:.1} ms ({} ms)", p.len(), wall.as_secs_f64() * 1e3, top.join(", "));
            }
        }
        model.set_profiling(false);
        let next: Vec<Vec<u32>> = (0..b).map(|i| vec![200 + i as u32]).collect();
        let mut run = |n: usize| -> Result<Duration, Box<dyn std::error::Error>> {
            let t = Instant::now();
            for _ in 0..n {
                let mut batch: Vec<Entry> = seqs
                    .iter_mut()
                    .zip(&next)
                    .zip(logits.iter_mut())
                    .map(|((s, t), l)| Entry { sequence: &mut **s, input: Input::Tokens(t), logits: l })
                    .collect();
                model.step(&mut batch)?;
            }
            Ok(t.elapsed())
        };
        run(4)?;
        let wall = run(steps)?;
        model.set_profiling(true);
        run(steps)?;
        let profile = model.profile();
        model.set_profiling(false);
        let profiled: Duration = profile.iter().sum();
        let per_step = wall.as_secs_f64() / steps as f64;
        println!(
            "B={b}: {:.2} ms/step, {:.0} tok/s aggregate (profiled steps sum {:.2} ms/step)",
            per_step * 1e3,
            b as f64 / per_step,
            profiled.as_secs_f64() * 1e3 / steps as f64
        );
        // Every sequence's last logits, hashed: a change meant to be exact
        // (a kernel, a narrowing) must leave this the same.
        let hash = logits
            .iter()
            .flatten()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3));
        println!("    logits after {} steps: hash {hash:016x}", 4 + 2 * steps);
        let sorted = by_op_kind(&ops, &profile);
        for (op, d) in sorted.iter().take(10) {
            println!("    {op:<24} {:>8.3} ms/step", d.as_secs_f64() * 1e3 / steps as f64);
        }
        // Projections summed per size (n x k): a small one's time against
        // its bytes shows what each region costs beside its weights.
        let shapes = model.plan().step_shapes();
        let mut by_shape: BTreeMap<String, (Duration, usize)> = BTreeMap::new();
        for (i, d) in profile.iter().enumerate() {
            if let Some((n, k)) = shapes[i] {
                let e = by_shape.entry(format!("{} {n}x{k}", ops[i])).or_default();
                e.0 += *d;
                e.1 += 1;
            }
        }
        for (name, (d, count)) in &by_shape {
            let ms = d.as_secs_f64() * 1e3 / steps as f64;
            println!("    {name:<32} x{count:<3} {ms:>8.3} ms/step, {:.1} us each", ms * 1e3 / *count as f64);
        }
        // Each attention op in plan order (one a layer): a layer whose KV
        // lies on small pages, or whose cache misses more, stands out.
        let by_layer: Vec<String> = (0..profile.len())
            .filter(|&i| ops[i] == "Attention")
            .map(|i| format!("{:.0}", profile[i].as_secs_f64() * 1e6 / steps as f64))
            .collect();
        println!("    attention by layer, us a step: {}", by_layer.join(" "));
        // The costliest single steps, with the projection sizes (n x k).
        let mut single: Vec<(usize, Duration)> = profile.iter().copied().enumerate().collect();
        single.sort_by_key(|s| std::cmp::Reverse(s.1));
        for (i, d) in single.iter().take(4) {
            let shape = shapes[*i].map(|(n, k)| format!(" {n}x{k}")).unwrap_or_default();
            println!("    step {i:>4} {}{shape}: {:.3} ms/step", ops[*i], d.as_secs_f64() * 1e3 / steps as f64);
        }
    }
    Ok(())
}

/// A profile's time summed per op kind, costliest first.
fn by_op_kind<'a>(ops: &'a [String], profile: &[Duration]) -> Vec<(&'a str, Duration)> {
    let mut by_op: BTreeMap<&str, Duration> = BTreeMap::new();
    for (op, d) in ops.iter().zip(profile) {
        *by_op.entry(op.as_str()).or_default() += *d;
    }
    let mut sorted: Vec<_> = by_op.into_iter().collect();
    sorted.sort_by_key(|b| std::cmp::Reverse(b.1));
    sorted
}

//! Packages the suite has never seen: architecture specs drawn from a seed
//! across the space the builder claims (llama and gpt2; f32 and f16; MHA,
//! GQA and MQA; head dims from 8 to 64, including ones ONNX Runtime's
//! GroupQueryAttention refuses; hidden and FFN sizes off the 32-block;
//! odd vocabularies; rope theta from 1e4 to 1e6; tied and untied; every
//! genai quantization), each run through parity on every export the spec
//! is built as, at that export's tier. A failing spec is shrunk (fewer
//! layers, heads, widths, tokens) while it still fails, and reported as the
//! YAML to reproduce it with.
//!
//! The tiers' error model, which these specs probe: every backend computes
//! in f32, so an f32 export's logits differ only by accumulation order
//! (relative error ~ sqrt(width) * 2^-24 per layer, far inside 1e-4); f16
//! weights are identical on both sides, but an f16 KV cache rounds each
//! stored value, and a value within a hair of a rounding boundary can land
//! one f16 ulp (2^-11) apart, after which the difference travels through
//! every later layer (so it grows with depth: `f16deep` for 30 layers);
//! 4-bit weights dequantize to the same f32 values on both sides (order
//! only again); int8 activations (`accuracy_level` 4) can flip one int8
//! step of one block, moving a logit by about `scale_x * scale_w * 8`.

use std::fmt::Write;

use onnx_genai_backend::Decoder;
use onnx_genai_build::rng::SplitMix64;
use onnx_genai_build::{Spec, Variant};
use onnx_genai_engine::BackendKind;
use onnx_genai_package::Package;

use crate::parity::{self, ParityOutcome};
use crate::tolerance::Tier;

/// Head dims drawn (12 and 24: not multiples of 8, so no GroupQueryAttention
/// export; 40: not a power of two).
const HEAD_DIMS: [u32; 7] = [8, 12, 16, 24, 32, 40, 64];

/// The spec drawn from `seed`, as the YAML a spec file would hold.
pub fn draw(seed: u64) -> String {
    let mut rng = SplitMix64::new(seed ^ 0x5eed_5eed_5eed_5eed);
    let mut pick = |n: u64| (rng.next_u64() % n) as u32;
    let llama = pick(10) < 7;
    let heads = 1 + pick(6);
    let head_dim = HEAD_DIMS[pick(HEAD_DIMS.len() as u64) as usize];
    let divisors: Vec<u32> = (1..=heads).filter(|d| heads.is_multiple_of(*d)).collect();
    let kv_heads = divisors[pick(divisors.len() as u64) as usize];
    let f16 = pick(3) == 0;
    let tied = pick(2) == 0;
    let layers = 1 + pick(3);
    let intermediate = 16 + pick(240);
    let vocab = 300 + pick(300);
    let context = [64u32, 128, 256, 512][pick(4) as usize];
    let theta = 10f64.powf(4.0 + f64::from(pick(1001)) / 500.0);
    let accuracy_level = [0u32, 4][pick(2) as usize];
    let symmetric = pick(2) == 0;
    let shared = tied && pick(2) == 0;
    let weights_seed = pick(1 << 20);
    // Drawn last, so the draws before it stay what they were.
    let qkv_bias = llama && pick(2) == 0;
    let mut y = String::new();
    let _ = writeln!(y, "name: random-{seed}\nseed: {weights_seed}");
    let _ = writeln!(y, "family: {}\ndtype: {}", if llama { "llama" } else { "gpt2" }, if f16 { "f16" } else { "f32" });
    let _ = writeln!(y, "hidden_size: {}\nnum_layers: {layers}\nnum_attention_heads: {heads}", heads * head_dim);
    if llama {
        let _ = writeln!(y, "num_kv_heads: {kv_heads}\nrope_theta: {theta:.1}");
    }
    let _ = writeln!(y, "intermediate_size: {intermediate}\nvocab_size: {vocab}\nmax_sequence_length: {context}");
    let _ = writeln!(y, "norm_epsilon: 1.0e-5\ntie_embeddings: {tied}");
    if qkv_bias {
        let _ = writeln!(y, "qkv_bias: true");
    }
    if llama {
        let _ = writeln!(
            y,
            "genai:\n  accuracy_level: {accuracy_level}\n  symmetric: {symmetric}\n  shared_embeddings: {shared}"
        );
    }
    y
}

/// The tier an export of `spec` is held to (as the shipped packages': see
/// `conformance/parity/*.yaml` and `conformance/tiers.yaml`).
pub fn tier_of(spec: &Spec, variant: Variant) -> Tier {
    let f16 = spec.dtype == onnx_genai_package::ElementType::F16;
    match variant {
        Variant::Genai if spec.genai.accuracy_level == 4 => Tier::Int8Act,
        Variant::Genai => Tier::Int4,
        _ if f16 => Tier::F16,
        Variant::Contrib => Tier::Int4,
        Variant::Decomposed | Variant::Opset23 => Tier::F32,
    }
}

/// One export's verdict.
pub struct ExportOutcome {
    pub variant: Variant,
    pub tier: Tier,
    /// The parity run, or why the export could not be built or run.
    pub outcome: Result<ParityOutcome, String>,
}

impl ExportOutcome {
    pub fn passed(&self) -> bool {
        self.outcome.as_ref().is_ok_and(|o| o.divergence.is_none())
    }

    /// Failed only on a greedy flip where the reference's top-2 gap is
    /// inside the tolerance.
    pub fn near_tie(&self) -> bool {
        matches!(&self.outcome, Ok(o) if matches!(o.divergence, Some(parity::Divergence::Token { near_tie: true, .. })))
    }

    pub fn summary(&self) -> String {
        let head = format!("{} at tier {}", self.variant.name(), self.tier.name());
        match &self.outcome {
            Ok(o) => match &o.divergence {
                None => {
                    format!("{head}: {} steps, worst {:.1}% of the tolerance", o.steps, 100.0 * o.worst.worst_ratio)
                }
                Some(d) => format!(
                    "{head}: {}",
                    parity::describe(d, self.tier, crate::cases::REFERENCE, BackendKind::NativeCpu.name())
                ),
            },
            Err(e) => format!("{head}: {e}"),
        }
    }
}

/// Builds every export of the spec in `yaml` and runs parity (native-cpu
/// against ONNX Runtime) on each: a prompt drawn from the spec's name, then
/// `steps` greedy steps.
pub fn check(yaml: &str, steps: usize, threads: usize) -> Result<Vec<ExportOutcome>, String> {
    let spec = Spec::parse(yaml, "a generated spec").map_err(|e| e.to_string())?;
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut rng = SplitMix64::new(spec.name.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))));
    let prompt: Vec<u32> = (0..3 + rng.next_u64() % 10).map(|_| (rng.next_u64() % 256) as u32).collect();
    let mut outcomes = Vec::new();
    for variant in spec.variants() {
        let tier = tier_of(&spec, variant);
        let dir = work.path().join(variant.name());
        let outcome = onnx_genai_build::build_variant(&spec, variant, &dir)
            .map_err(|e| format!("build: {e}"))
            .and_then(|()| Package::open(&dir).map_err(|e| format!("open: {e}")))
            .and_then(|package| {
                let open = |b: &str| crate::run::open_backend(b, &package, threads).map_err(|e| e.to_string());
                let (mut reference, mut candidate): (Decoder, Decoder) =
                    (open(crate::cases::REFERENCE)?, open(BackendKind::NativeCpu.name())?);
                Ok(parity::run(&mut reference, &mut candidate, &prompt, steps, tier))
            });
        outcomes.push(ExportOutcome { variant, tier, outcome });
    }
    Ok(outcomes)
}

/// Smaller specs than `yaml`, one change each, most drastic first.
fn smaller(yaml: &str) -> Vec<String> {
    let mut out = Vec::new();
    let field = |key: &str| -> Option<u64> {
        yaml.lines().find_map(|l| l.strip_prefix(&format!("{key}: ")).and_then(|v| v.trim().parse().ok()))
    };
    let set = |key: &str, value: u64| -> String {
        yaml.lines()
            .map(|l| if l.starts_with(&format!("{key}: ")) { format!("{key}: {value}") } else { l.to_string() })
            .collect::<Vec<_>>()
            .join("\n")
            + "\n"
    };
    if let Some(layers) = field("num_layers").filter(|l| *l > 1) {
        out.push(set("num_layers", layers - 1));
    }
    if let (Some(hidden), Some(heads)) = (field("hidden_size"), field("num_attention_heads")) {
        let head_dim = hidden / heads.max(1);
        let kv = field("num_kv_heads");
        // Fewer heads at the same head dim (KV heads: what still divides).
        if heads > 1 {
            let fewer = heads / 2;
            let mut s = set("num_attention_heads", fewer);
            s = s.replace(&format!("hidden_size: {hidden}"), &format!("hidden_size: {}", fewer * head_dim));
            if let Some(kv) = kv {
                let kv_fewer = (1..=kv.min(fewer)).rev().find(|d| fewer % d == 0).unwrap_or(1);
                s = s.replace(&format!("num_kv_heads: {kv}"), &format!("num_kv_heads: {kv_fewer}"));
            }
            out.push(s);
        }
        // A smaller head dim of the drawn set.
        if let Some(&smaller_dim) = HEAD_DIMS.iter().rev().find(|d| u64::from(**d) < head_dim) {
            out.push(set("hidden_size", heads * u64::from(smaller_dim)));
        }
    }
    if let Some(ffn) = field("intermediate_size") {
        if ffn > 16 {
            out.push(set("intermediate_size", (ffn / 2).max(16)));
        }
    }
    if let Some(vocab) = field("vocab_size") {
        if vocab > 300 {
            out.push(set("vocab_size", 300));
        }
    }
    out.push(yaml.replace("dtype: f16", "dtype: f32"));
    out.push(yaml.replace("qkv_bias: true\n", ""));
    out.push(
        yaml.replace("tie_embeddings: true", "tie_embeddings: false")
            .replace("shared_embeddings: true", "shared_embeddings: false"),
    );
    out.retain(|s| s != yaml && Spec::parse(s, "a shrunk spec").is_ok());
    out
}

/// Shrinks a failing spec: takes any smaller spec that `fails` still, until
/// none does (or `budget` attempts are spent).
pub fn shrink(yaml: &str, mut budget: usize, mut fails: impl FnMut(&str) -> bool) -> String {
    let mut current = yaml.to_string();
    'outer: while budget > 0 {
        for candidate in smaller(&current) {
            if budget == 0 {
                break 'outer;
            }
            budget -= 1;
            if fails(&candidate) {
                current = candidate;
                continue 'outer;
            }
        }
        break;
    }
    current
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generator's draws are valid specs, the same for the same seed,
    /// and cover the space it claims: both families and dtypes, MQA, GQA
    /// and MHA, head dims a GroupQueryAttention export cannot take, FFN
    /// widths off the 32-block, odd vocabularies, tied and untied, llamas
    /// with and without Q/K/V biases (Qwen2's layout).
    #[test]
    fn draws_are_valid_repeatable_and_cover_the_space() {
        assert_eq!(draw(7), draw(7));
        let specs: Vec<Spec> = (0..200).map(|s| Spec::parse(&draw(s), "draw").unwrap()).collect();
        let any = |f: &dyn Fn(&Spec) -> bool| specs.iter().any(f);
        use onnx_genai_package::{ElementType, Family};
        assert!(any(&|s| s.family == Family::Gpt2) && any(&|s| s.family == Family::Llama));
        assert!(any(&|s| s.dtype == ElementType::F16) && any(&|s| s.dtype == ElementType::F32));
        assert!(any(&|s| s.family == Family::Llama && s.kv_heads() == 1 && s.num_attention_heads > 1));
        assert!(any(&|s| s.kv_heads() > 1 && s.kv_heads() < s.num_attention_heads));
        assert!(any(&|s| s.kv_heads() == s.num_attention_heads && s.num_attention_heads > 1));
        assert!(any(&|s| !s.head_dim().is_multiple_of(8)));
        assert!(any(&|s| !s.intermediate_size.is_multiple_of(32)) && any(&|s| !s.hidden_size.is_multiple_of(32)));
        assert!(any(&|s| s.vocab_size % 2 == 1));
        assert!(any(&|s| s.tie_embeddings) && any(&|s| !s.tie_embeddings));
        assert!(any(&|s| s.rope_theta.is_some_and(|t| t > 5e5)));
        assert!(any(&|s| s.genai.accuracy_level == 4) && any(&|s| s.genai.accuracy_level == 0));
        assert!(any(&|s| s.qkv_bias) && any(&|s| s.family == Family::Llama && !s.qkv_bias));
    }

    /// A generated export is held to the tier the shipped packages' suite
    /// files give the same kind of export: `tier_of` agrees with every
    /// `conformance/parity/*.yaml` on every variant of its package.
    #[test]
    fn generated_tiers_are_the_suite_files_tiers() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = root.join("conformance/parity");
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let file: crate::cases::ParityFile = crate::cases::read_yaml(&path).unwrap();
            let spec =
                onnx_genai_build::read_spec(&root.join("packages").join(&file.package).join("spec.yaml")).unwrap();
            for variant in &file.variants {
                let want = file.tiers.get(variant).copied().unwrap_or(file.tier);
                assert_eq!(tier_of(&spec, *variant), want, "{} {}", file.package, variant.name());
            }
            files += 1;
        }
        assert!(files >= 3, "{files} suite files");
    }

    /// Shrinking keeps only specs that still fail and ends at a local
    /// minimum: with "fails while it has 3+ heads" as the property, a
    /// 3-layer 6-head spec shrinks to one layer, 3 heads and the smallest
    /// widths.
    #[test]
    fn shrinking_keeps_failing_and_gets_small() {
        let big = (0..500)
            .map(draw)
            .find(|y| {
                let s = Spec::parse(y, "draw").unwrap();
                s.num_layers == 3 && s.num_attention_heads == 6
            })
            .expect("a 3-layer spec with 6 heads among 500 draws");
        let fails = |y: &str| {
            let s = Spec::parse(y, "shrunk").unwrap();
            s.num_attention_heads >= 3
        };
        let small = Spec::parse(&shrink(&big, 100, fails), "shrunk").unwrap();
        assert!(small.num_attention_heads >= 3, "shrinking kept a passing spec");
        assert_eq!(small.num_layers, 1);
        assert_eq!((small.num_attention_heads, small.intermediate_size, small.vocab_size), (3, 16, 300));
    }
}

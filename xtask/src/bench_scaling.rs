//! `cargo xtask bench --scaling`: native-cpu's decode and prefill at one
//! thread and at N, on every export of the real models, in one run.
//!
//! Two runs minutes apart cannot measure what threads buy on these
//! machines: a VM's neighbours move a memory-bound decode by 20–50 %
//! between minutes (one afternoon: SmolLM2's genai-int8 export at one
//! thread decoded 271 tok/s, ten minutes later 144, while ONNX Runtime
//! GenAI stayed within 5 %), so a ratio of two such runs mostly measures
//! the minutes. Here the model is loaded three times — at 1 thread, at N,
//! and at 1 again (the control) — and each round measures all three (the
//! order rotating through all six, so none always runs first or in
//! another's wake): a round's ratios compare measurements seconds apart,
//! and the report gives their min and median beside each model's own
//! rates. The control's ratio (~1.0x where the method is sound) shows
//! drift within a round and any bias of order; what it cannot show is a
//! slowdown that hits one thread harder than N (a core the host slows
//! stalls a lone thread, while N threads claim its share of the work),
//! which stays in the scaling ratio.

use std::fmt::Write as _;

use anyhow::{Context as _, Result};
use onnx_genai_engine::BackendKind;
use onnx_genai_package::Package;

use crate::bench_real::{measure, min_median, CONTEXT, PREFILL};
use crate::{real, util};

/// `(decode, prefill)` tokens/s of one measurement.
type Rates = (f64, f64);

/// One export's rounds: each model's decode and prefill tokens/s, and each
/// round's ratios to the one-thread model's rates in the same round.
#[derive(Debug, Default, PartialEq)]
struct Paired {
    one: (Vec<f64>, Vec<f64>),
    many: (Vec<f64>, Vec<f64>),
    ratio: (Vec<f64>, Vec<f64>),
    /// A second one-thread model over the first: the ratio the method shows
    /// where there is nothing to find (its noise, and any bias of order).
    control: (Vec<f64>, Vec<f64>),
}

impl Paired {
    /// Adds a round: the one-thread model's rates, the many-thread model's
    /// and the control's (a second one-thread model's).
    fn push(&mut self, one: Rates, many: Rates, control: Rates) {
        self.one.0.push(one.0);
        self.one.1.push(one.1);
        self.many.0.push(many.0);
        self.many.1.push(many.1);
        self.ratio.0.push(many.0 / one.0);
        self.ratio.1.push(many.1 / one.1);
        self.control.0.push(control.0 / one.0);
        self.control.1.push(control.1 / one.1);
    }

    /// The report's row for `name`: min / median of each series.
    fn row(&self, name: &str) -> String {
        let mm = |v: &Vec<f64>| min_median(v.clone());
        let (d1, dn, dr, dc) = (mm(&self.one.0), mm(&self.many.0), mm(&self.ratio.0), mm(&self.control.0));
        let (p1, pn, pr, pc) = (mm(&self.one.1), mm(&self.many.1), mm(&self.ratio.1), mm(&self.control.1));
        format!(
            "| {name} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2}x / {:.2}x | {:.2}x / {:.2}x | {:.0} / {:.0} | {:.0} / {:.0} \
             | {:.2}x / {:.2}x | {:.2}x / {:.2}x |",
            d1.0, d1.1, dn.0, dn.1, dr.0, dr.1, dc.0, dc.1, p1.0, p1.1, pn.0, pn.1, pr.0, pr.1, pc.0, pc.1
        )
    }
}

/// The order in which round `round` measures the one-thread model (0), the
/// many-thread model (1) and the control (2): each of the six orders in
/// turn, so that no model always runs first or in another's wake.
fn order(round: usize) -> [usize; 3] {
    const ORDERS: [[usize; 3]; 6] = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 2, 1], [2, 1, 0], [1, 0, 2]];
    ORDERS[round % ORDERS.len()]
}

/// Measures every real export at 1 and at `threads` threads (and a second
/// one-thread model, the control), `rounds` rounds of `steps` decode steps
/// each; writes `target/bench/scaling.md`.
pub fn run(threads: usize, rounds: usize, steps: usize) -> Result<()> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = util::cpuinfo_field(&info, "model name");
    let kernels = onnx_genai_native::kernels::isa::Isa::best();
    let mut md = format!(
        "# Thread scaling of native-cpu\n\nOn `{cpu}` (kernels `{kernels}`), one run: each export loaded three \
         times — at 1 thread, at {threads}, and at 1 again (the control); {rounds} rounds, each measuring the three \
         in turn (round by round through the six orders); a measurement is a prefill of {PREFILL} tokens and {steps} \
         decode steps after a {CONTEXT}-token context (its decode rate: one over the median step). Rates are min / \
         median tokens/s over the rounds; a ratio divides a rate by the first 1-thread model's in the same round \
         (min / median over the rounds). The control's ratio is what this method shows where there is nothing to \
         find (drift within a round, a bias of order); a slowdown that hits one thread harder than {threads} is \
         not in it.\n\n\
         | export | decode 1T | decode {threads}T | decode {threads}T/1T | decode control | prefill 1T | \
         prefill {threads}T | prefill {threads}T/1T | prefill control |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for model in real::models()? {
        for (export, dir) in real::ensure_built_with_bench(&model)? {
            let name = model.package(&export);
            let package = Package::open(&dir)?;
            let load = |t: usize| {
                BackendKind::NativeCpu
                    .decoder(&package, t)
                    .with_context(|| format!("native-cpu on {name}, {t} threads"))
            };
            let mut models = [load(1)?, load(threads)?, load(1)?];
            let mut paired = Paired::default();
            for round in 0..rounds {
                let mut rates = [(0.0, 0.0); 3];
                for m in order(round) {
                    let s = measure(&mut models[m], 1, steps)?;
                    rates[m] = (s.decode.1, s.prefill.1);
                }
                paired.push(rates[0], rates[1], rates[2]);
            }
            let row = paired.row(&name);
            println!("{row}");
            let _ = writeln!(md, "{row}");
        }
    }
    let path = util::target().join("bench/scaling.md");
    std::fs::create_dir_all(path.parent().context("bench report path has no parent")?)?;
    std::fs::write(&path, &md)?;
    println!("\n{md}\nreport: {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round's ratios are to its own one-thread rates (the pairing this
    /// mode is for): rounds whose rates drift together keep a steady ratio,
    /// which a ratio of the counts' medians would not show.
    #[test]
    fn a_rounds_ratio_is_within_the_round() {
        let mut p = Paired::default();
        // The machine halves its speed between the rounds; two threads
        // stay 1.9x one thread within each, the control 1.0x.
        p.push((200.0, 1000.0), (380.0, 1800.0), (200.0, 1000.0));
        p.push((100.0, 500.0), (190.0, 900.0), (100.0, 500.0));
        p.push((150.0, 750.0), (285.0, 1350.0), (150.0, 750.0));
        assert_eq!(p.ratio.0, vec![1.9, 1.9, 1.9]);
        assert_eq!(p.ratio.1, vec![1.8, 1.8, 1.8]);
        assert_eq!(p.control.0, vec![1.0, 1.0, 1.0]);
        let row = p.row("x");
        assert_eq!(
            row,
            "| x | 100.0 / 150.0 | 190.0 / 285.0 | 1.90x / 1.90x | 1.00x / 1.00x | 500 / 750 | 900 / 1350 | 1.80x / \
             1.80x | 1.00x / 1.00x |"
        );
    }

    /// Six rounds run each model first twice and in each place twice, so
    /// no model always measures first or right after the same one.
    #[test]
    fn rounds_rotate_through_every_order() {
        let orders: Vec<[usize; 3]> = (0..6).map(order).collect();
        for m in 0..3 {
            for place in 0..3 {
                assert_eq!(orders.iter().filter(|o| o[place] == m).count(), 2, "model {m} at place {place}");
            }
        }
        let mut sorted = orders.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 6, "every order once: {orders:?}");
        assert_eq!(order(6), order(0));
    }
}

//! Token selection: greedy, or seeded sampling with temperature, top-k, top-p.

/// Sampling options. `temperature` 0 (the default) is greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl Sampling {
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

/// Draws tokens from logits; owns the random stream of one request.
pub struct Sampler {
    options: Sampling,
    state: u64,
}

impl Sampler {
    pub fn new(options: Sampling) -> Self {
        let state = options.seed ^ 0x2545_F491_4F6C_DD1D;
        Self { options, state }
    }

    /// Uniform in [0, 1) (xorshift64*).
    fn next_unit(&mut self) -> f64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn pick(&mut self, logits: &[f32]) -> u32 {
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
        let weights: Vec<f64> = order.iter().map(|&i| (f64::from(logits[i] - max) / t).exp()).collect();
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
        order[kept - 1] as u32
    }
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(Sampling::default());
        assert_eq!(s.pick(&[0.0, 1.0, 5.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_temperature() {
        let mut s = Sampler::new(Sampling { temperature: 5.0, top_k: 1, top_p: 1.0, seed: 9 });
        for _ in 0..50 {
            assert_eq!(s.pick(&[0.0, 1.0, 5.0, 4.9]), 2);
        }
    }

    #[test]
    fn same_seed_same_draws_and_sampling_spreads() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let opts = Sampling { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 };
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
        let mut s = Sampler::new(Sampling { temperature: 1.0, top_k: 0, top_p: 0.5, seed: 3 });
        // Token 0 holds far more than half of the mass.
        for _ in 0..50 {
            assert_eq!(s.pick(&[10.0, 0.0, 0.0]), 0);
        }
    }
}

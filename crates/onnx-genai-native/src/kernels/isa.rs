//! Which instruction set the kernels use. Detected once at run time (the
//! best the CPU has), or forced lower for tests and comparisons: every path
//! is tested on every machine that can run it, so an AVX-512 machine still
//! tests the AVX2 and portable kernels.

use std::sync::OnceLock;

/// A kernel path, from the most capable down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust: every machine.
    Portable,
    /// x86-64 AVX2 + FMA + F16C (256-bit).
    Avx2,
    /// AVX2 plus AVX-VNNI: 256-bit integer dot products for int8 inputs.
    Avx2Vnni,
    /// AVX-512 F/BW/VL/DQ (512-bit).
    Avx512,
    /// AVX-512 plus AVX-512 VNNI.
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX-INT8 (granted by the OS): int8-input products
    /// of several rows run on tiles ([`super::amx`]); everything else is
    /// AVX-512 VNNI's.
    Avx512Amx,
}

impl Isa {
    pub const ALL: [Isa; 6] = [Isa::Portable, Isa::Avx2, Isa::Avx2Vnni, Isa::Avx512, Isa::Avx512Vnni, Isa::Avx512Amx];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx2Vnni => "avx2-vnni",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Avx512Amx => "avx512-amx",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        let f = features();
        match self {
            Isa::Portable => true,
            Isa::Avx2 => f.avx2,
            Isa::Avx2Vnni => f.avx2 && f.avx_vnni,
            Isa::Avx512 => f.avx512,
            Isa::Avx512Vnni => f.avx512 && f.avx512_vnni,
            Isa::Avx512Amx => f.avx512 && f.avx512_vnni && amx_granted(),
        }
    }

    /// The best path this CPU has.
    pub fn best() -> Self {
        Self::ALL.into_iter().rev().find(|i| i.available()).unwrap_or(Isa::Portable)
    }

    /// Every path this CPU can run (for tests that compare them).
    pub fn all_available() -> Vec<Self> {
        Self::ALL.into_iter().filter(|i| i.available()).collect()
    }

    /// Whether the path has 512-bit registers.
    pub fn wide(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx512Vnni | Isa::Avx512Amx)
    }

    /// Whether the path has integer dot products (VNNI) for int8 inputs.
    pub fn vnni(self) -> bool {
        matches!(self, Isa::Avx2Vnni | Isa::Avx512Vnni | Isa::Avx512Amx)
    }

    /// Whether the path has at least AVX2/FMA/F16C.
    pub fn x86(self) -> bool {
        self != Isa::Portable
    }
}

/// The summed rate of `threads` threads each running `probe` at the same
/// time (started together on a barrier), best of three. Measured at once
/// rather than one thread times `threads`: virtual CPUs may be hyperthreads
/// of one core, which share its vector units, and then two threads reach
/// what one does.
fn concurrent_rate(threads: usize, probe: &(dyn Fn() -> f64 + Sync)) -> f64 {
    let threads = threads.max(1);
    let round = || -> f64 {
        let start = std::sync::Barrier::new(threads);
        std::thread::scope(|scope| {
            let others: Vec<_> = (1..threads)
                .map(|_| {
                    scope.spawn(|| {
                        start.wait();
                        probe()
                    })
                })
                .collect();
            start.wait();
            // A probe thread cannot panic (it only runs arithmetic); a rate
            // it fails to return counts as nothing.
            probe() + others.into_iter().map(|h| h.join().unwrap_or(0.0)).sum::<f64>()
        })
    };
    (0..3).map(|_| round()).fold(0.0, f64::max)
}

/// Multiply-adds per second `threads` threads sustain together with this
/// path's widest FMAs ([`concurrent_rate`]): the compute roofline reports
/// compare against.
pub fn peak_macs(isa: Isa, threads: usize) -> f64 {
    let reps = 4_000_000;
    let once = || -> f64 {
        #[cfg(target_arch = "x86_64")]
        {
            if isa.wide() && isa.available() {
                // SAFETY: AVX-512 is available (checked).
                return unsafe { super::avx512::fma_rate(reps) };
            }
            if isa.x86() && isa.available() {
                // SAFETY: AVX2/FMA are available (checked).
                return unsafe { super::avx2::fma_rate(reps) };
            }
        }
        let mut acc = [1.0f32; 16];
        let started = std::time::Instant::now();
        for _ in 0..reps / 16 {
            for a in acc.iter_mut() {
                *a = *a * 1.000_000_1 + 1e-7;
            }
        }
        std::hint::black_box(acc);
        (reps / 16 * 16) as f64 / started.elapsed().as_secs_f64()
    };
    concurrent_rate(threads, &once)
}

/// Int8 multiply-adds per second `threads` threads sustain together with
/// AVX-512 VNNI's `vpdpbusd`, or on the AMX path with tile products of the
/// AMX kernel's shape ([`concurrent_rate`]): the ceiling of the
/// `accuracy_level` 4 kernels; `None` on a path without them.
pub fn peak_int8_macs(isa: Isa, threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Amx && isa.available() {
        // SAFETY: AMX is granted (checked by `available`).
        let once = || unsafe { super::amx::int8_rate(2_000_000) };
        return Some(concurrent_rate(threads, &once));
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni && isa.available() {
        // SAFETY: AVX-512 F and VNNI are available (checked).
        let once = || unsafe { super::avx512::int8_rate(4_000_000) };
        return Some(concurrent_rate(threads, &once));
    }
    let _ = (isa, threads);
    None
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether AMX-INT8 is there and this process may use it.
fn amx_granted() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Features {
    avx2: bool,
    avx_vnni: bool,
    avx512: bool,
    avx512_vnni: bool,
}

fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
            Features { avx2, avx_vnni: avx2 && has!("avxvnni"), avx512, avx512_vnni: avx512 && has!("avx512vnni") }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Features::default()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Detection is ordered: a path implies the ones below it, the best is
    /// available, and names round-trip.
    #[test]
    fn paths_are_ordered_and_named() {
        let best = Isa::best();
        assert!(best.available());
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            if isa.available() && isa != Isa::Portable {
                assert!(Isa::Avx2.available(), "{isa} without AVX2");
            }
        }
        assert!(Isa::all_available().contains(&Isa::Portable));
    }

    /// A peak for `threads` threads is every thread's rate summed while
    /// they all run at once (a probe here returns 1 only when it sees all
    /// of them inside together), not one thread's rate times `threads`.
    #[test]
    fn peaks_are_probed_on_every_thread_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        for threads in [1, 2, 3] {
            let inside = AtomicUsize::new(0);
            let probe = || -> f64 {
                // This round's probes have all arrived when the count
                // reaches the end of the round this one counted in.
                let round_end = (inside.fetch_add(1, Ordering::SeqCst) / threads + 1) * threads;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while std::time::Instant::now() < deadline {
                    if inside.load(Ordering::SeqCst) >= round_end {
                        return 1.0;
                    }
                    std::hint::spin_loop();
                }
                0.0
            };
            assert_eq!(concurrent_rate(threads, &probe), threads as f64, "{threads} threads");
        }
    }

    /// The int8 ceiling is probed exactly where the AVX-512 VNNI or AMX
    /// kernels run (and is a rate; how it compares with f32 is the load
    /// report's to say, not a timed assertion's).
    #[test]
    fn int8_peak_is_probed_only_with_vnni() {
        for isa in Isa::ALL {
            let peak = peak_int8_macs(isa, 2);
            let probed = matches!(isa, Isa::Avx512Vnni | Isa::Avx512Amx) && isa.available();
            assert_eq!(peak.is_some(), probed, "{isa}");
            if let Some(p) = peak {
                assert!(p.is_finite() && p > 0.0, "{isa}: {p}");
            }
        }
    }
}

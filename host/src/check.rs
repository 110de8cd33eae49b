//! Comparing results with references, and inputs for doing so.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};

/// ‖got − want‖₂ / ‖want‖₂ over all elements (the metric the tests' tolerances are stated in).
/// NaN if any element of `got` is NaN, so a poisoned, unwritten output never passes; NaN too if
/// the lengths differ.
pub fn relative_l2_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w).powi(2);
        norm += w * w;
    }
    if norm == 0.0 { diff.sqrt() } else { (diff / norm).sqrt() }
}

/// Relative L2 error of a logsumexp: rows whose reference is −∞ (they see no key) must be −∞
/// exactly (else the result is +∞); the others are compared as [`relative_l2_error`] does (NaN
/// if the lengths differ).
pub fn lse_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let mut finite = (Vec::new(), Vec::new());
    for (&g, &w) in got.iter().zip(want) {
        if w == f64::NEG_INFINITY {
            if g != f32::NEG_INFINITY {
                return f64::INFINITY;
            }
        } else {
            finite.0.push(g);
            finite.1.push(w);
        }
    }
    relative_l2_error(&finite.0, &finite.1)
}

/// max_i |got_i − want_i|; NaN if any element of `got` is NaN or the lengths differ.
pub fn max_abs_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, |m, e| if e.is_nan() || m.is_nan() { f64::NAN } else { m.max(e) })
}

/// `n` samples of the standard normal distribution from seeded generators: the same seed gives
/// the same data on every machine, however many threads it has. Drawn in parallel, in chunks of
/// 2^16 values, each from its own generator (the first chunk's seed is `seed` itself), so that
/// the hundreds of millions of inputs of a benchmark take well under a second.
pub fn random_normal(n: usize, seed: u64) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut values = vec![0.0; n];
    values.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        // Distinct, well-spread seeds per chunk (the golden-ratio increment of splitmix64).
        let mut rng = StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        chunk.iter_mut().for_each(|x| *x = StandardNormal.sample(&mut rng));
    });
    values
}

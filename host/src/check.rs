//! Comparing results with references, and inputs for doing so; the tolerances the tests, the
//! main job and `attn --check` judge results by ([`Tolerance`]).

use std::fmt;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};

use crate::dtype::DType;

/// The relative L2 errors against the `f64` reference (see [`relative_l2_error`]) that a kernel's
/// outputs may have, per element type: the bar of the test suite (issue 4), which the main job
/// and `attn --check` apply too, so that a row they print as PASS would pass the tests.
///
/// The 16-bit rows are judged against the reference on the inputs rounded to 16 bits, so the
/// error is the kernels' own (rounding of P, dS and the outputs, `f32` accumulation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// O.
    pub o: f64,
    /// The logsumexp (`f32` in every type; see [`lse_error`]).
    pub lse: f64,
    /// dQ, dK and dV (see [`gradient_error`]).
    pub grad: f64,
}

impl Tolerance {
    /// The `f32` kernels (CUDA cores), naive and flash.
    pub const F32: Self = Self { o: 1e-5, lse: 1e-5, grad: 1e-4 };
    /// The `f16` tensor-core kernels.
    pub const F16: Self = Self { o: 3e-3, lse: 1e-4, grad: 1e-2 };
    /// The `bf16` tensor-core kernels (3 fewer mantissa bits than `f16`).
    pub const BF16: Self = Self { o: 1e-2, lse: 1e-4, grad: 2e-2 };

    /// The tolerances of kernels running in `dtype`.
    pub const fn of(dtype: DType) -> Self {
        match dtype {
            DType::F32 => Self::F32,
            DType::F16 => Self::F16,
            DType::Bf16 => Self::BF16,
        }
    }

    /// The limit for one output.
    pub const fn limit(&self, output: Output) -> f64 {
        match output {
            Output::O => self.o,
            Output::Lse => self.lse,
            Output::Dq | Output::Dk | Output::Dv | Output::DSinks | Output::DBias => self.grad,
        }
    }

    /// "O ≤ 1e-5, LSE ≤ 1e-5, dQ/dK/dV ≤ 1e-4", for the lines under a table.
    pub fn describe(&self) -> String {
        format!("O ≤ {:.0e}, LSE ≤ {:.0e}, dQ/dK/dV ≤ {:.0e}", self.o, self.lse, self.grad)
    }
}

/// The tiled CPU FlashAttention (`cpu::flash_attention`) against the plain formula, both in
/// `f64`: every element within `CPU_TILED_TOLERANCE · (1 + |plain|)`.
pub const CPU_TILED_TOLERANCE: f64 = 1e-12;

/// An output of attention, as [`Tolerance`] names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// The attention output.
    O,
    /// The logsumexp of each score row.
    Lse,
    /// ∂loss/∂Q.
    Dq,
    /// ∂loss/∂K.
    Dk,
    /// ∂loss/∂V.
    Dv,
    /// ∂loss/∂sinks ([`crate::Sinks`]).
    DSinks,
    /// ∂loss/∂bias ([`crate::Bias`]).
    DBias,
}

impl Output {
    /// "O", "LSE", "dQ", "dK", "dV", "dSinks", "dBias".
    pub const fn name(self) -> &'static str {
        match self {
            Self::O => "O",
            Self::Lse => "LSE",
            Self::Dq => "dQ",
            Self::Dk => "dK",
            Self::Dv => "dV",
            Self::DSinks => "dSinks",
            Self::DBias => "dBias",
        }
    }
}

/// One output's error against the reference and the limit it is judged by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Which output.
    pub output: Output,
    /// Its error (relative L2; see [`relative_l2_error`], [`lse_error`], [`gradient_error`]).
    pub error: f64,
    /// The most it may be.
    pub limit: f64,
}

impl Measured {
    /// `output`'s `error`, judged by `tolerance`.
    pub const fn new(output: Output, error: f64, tolerance: Tolerance) -> Self {
        Self { output, error, limit: tolerance.limit(output) }
    }

    /// Whether the error is within the limit (a NaN error never is).
    pub fn passes(&self) -> bool {
        self.error <= self.limit
    }
}

impl fmt::Display for Measured {
    /// "O 2.5e-7", or with the limit when it fails: "O 5.4e-1 > 1e-5".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:.1e}", self.output.name(), self.error)?;
        if !self.passes() {
            write!(f, " > {:.0e}", self.limit)?;
        }
        Ok(())
    }
}

/// The errors of one row of a table (a forward's O and LSE, a backward's dQ, dK and dV) and its
/// verdict: PASS when every error is within its limit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Checked(pub Vec<Measured>);

impl Checked {
    /// Whether every output is within its limit.
    pub fn passes(&self) -> bool {
        self.0.iter().all(Measured::passes)
    }

    /// "PASS" or "FAIL".
    pub fn verdict(&self) -> &'static str {
        if self.passes() { "PASS" } else { "FAIL" }
    }
}

impl fmt::Display for Checked {
    /// "O 2.5e-7, LSE 8.0e-8".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, measured) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{measured}")?;
        }
        Ok(())
    }
}

/// ‖got − want‖₂ / ‖want‖₂ over all elements (the metric the tests' tolerances are stated in).
/// NaN if any element of `got` is NaN, so a poisoned, unwritten output never passes; NaN too if
/// the lengths differ.
pub fn relative_l2_error(got: &[f32], want: &[f64]) -> f64 {
    relative_l2_error_above(got, want, 0.0)
}

/// [`relative_l2_error`] with a floor under the denominator: ‖got − want‖₂ / max(‖want‖₂,
/// `floor`), an absolute tolerance below `floor` (numpy's `atol`). For a quantity that can
/// cancel to almost nothing while its parts do not (dQ and dK of rows whose softmax is one-hot:
/// dS = P ∘ (dP − D) ≈ 0), judged against the scale of something that does not cancel. With
/// `floor` 0 and a zero reference, the absolute ‖got − want‖₂.
pub fn relative_l2_error_above(got: &[f32], want: &[f64], floor: f64) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w).powi(2);
        norm += w * w;
    }
    let scale = norm.sqrt().max(floor);
    if scale == 0.0 { diff.sqrt() } else { diff.sqrt() / scale }
}

/// ‖x‖₂.
pub fn l2_norm(x: &[f64]) -> f64 {
    x.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Relative L2 error of a logsumexp: rows whose reference is infinite (−∞: they see no key; +∞:
/// a +∞ score or sink) must be that infinity exactly (else the result is +∞); the others are
/// compared as [`relative_l2_error`] does (NaN if the lengths differ).
pub fn lse_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let mut finite = (Vec::new(), Vec::new());
    for (&g, &w) in got.iter().zip(want) {
        if w.is_infinite() {
            // An empty row's −∞, or the +∞ of a row with a +∞ score or sink: exactly that.
            if g as f64 != w {
                return f64::INFINITY;
            }
        } else {
            finite.0.push(g);
            finite.1.push(w);
        }
    }
    relative_l2_error(&finite.0, &finite.1)
}

/// The error of a gradient: [`relative_l2_error`], except against an exactly zero reference
/// (one visible key: P ≡ 1, so dS = P ∘ (dP − D) ≡ 0), which has no relative error: there it is
/// the root mean square of `got`, the rounding left by dP − D, judged per element against the
/// unit-normal inputs' scale. NaN if the lengths differ or `got` holds a NaN.
pub fn gradient_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    if !want.is_empty() && want.iter().all(|&w| w == 0.0) {
        (got.iter().map(|&g| (g as f64).powi(2)).sum::<f64>() / got.len() as f64).sqrt()
    } else {
        relative_l2_error(got, want)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_fails_beyond_its_limit_and_on_nan() {
        let within = Measured::new(Output::O, 2.5e-7, Tolerance::F32);
        let beyond = Measured::new(Output::O, 5.4e-1, Tolerance::F32);
        let nan = Measured::new(Output::Dq, f64::NAN, Tolerance::BF16);
        assert!(within.passes() && !beyond.passes() && !nan.passes());
        assert_eq!(within.to_string(), "O 2.5e-7");
        assert_eq!(beyond.to_string(), "O 5.4e-1 > 1e-5");
        assert_eq!(nan.limit, 2e-2);
        let row = Checked(vec![within, Measured::new(Output::Lse, 1e-3, Tolerance::F16)]);
        assert_eq!((row.verdict(), row.to_string().as_str()), ("FAIL", "O 2.5e-7, LSE 1.0e-3 > 1e-4"));
        assert_eq!(Checked(vec![within]).verdict(), "PASS");
    }

    #[test]
    fn a_floor_bounds_the_relative_error_from_below_only() {
        // A reference of norm 1e-11 (a cancelled dQ): against it an error of 1e-5 is relative
        // 1e6; under a floor of 1e-2 it is 1e-3. Above the floor nothing changes.
        let want = [1e-11, 0.0];
        let got = [1e-5f32, 0.0];
        let floored = super::relative_l2_error_above(&got, &want, 1e-2);
        assert!((floored - 1e-3).abs() < 1e-8, "{floored}");
        assert!(super::relative_l2_error(&got, &want) > 1e5);
        assert_eq!(super::relative_l2_error_above(&[2.0], &[1.0], 0.5), super::relative_l2_error(&[2.0], &[1.0]));
        assert!(super::relative_l2_error_above(&[f32::NAN], &[1.0], 1.0).is_nan());
        assert!(super::relative_l2_error_above(&[1.0], &[1.0, 2.0], 1.0).is_nan());
        assert_eq!(super::l2_norm(&[3.0, 4.0]), 5.0);
    }

    #[test]
    fn gradient_error_of_a_zero_reference_is_the_rms() {
        let rms = gradient_error(&[3e-8, -4e-8], &[0.0, 0.0]);
        assert!((rms - 12.5e-16f64.sqrt()).abs() < 1e-14, "{rms}");
        assert_eq!(gradient_error(&[1.0, 1.0], &[1.0, 1.0]), 0.0);
        assert!(gradient_error(&[1.0], &[1.0, 2.0]).is_nan());
    }
}

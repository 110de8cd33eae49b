//! Exercise 2: `cargo test --release --manifest-path exercises/Cargo.toml ex02`.

mod common;

use attn_kernels::emu::Arg;
use common::{launch, ptr, random};
use exercises::ex02_softmax::emu_softmax_rows;

const COLS: usize = 37;

/// The test's rows and what is special about each.
fn rows() -> Vec<(&'static str, Vec<f32>)> {
    let mut masked = random(COLS, 11);
    for j in (0..COLS).step_by(3) {
        masked[j] = f32::NEG_INFINITY;
    }
    vec![
        ("random scores", random(COLS, 10)),
        ("random scores", random(COLS, 12).iter().map(|x| 3.0 * x).collect()),
        ("scores near 200", random(COLS, 13).iter().map(|x| 200.0 + x).collect()),
        ("every third score masked (−∞)", masked),
        ("every score masked (−∞)", vec![f32::NEG_INFINITY; COLS]),
    ]
}

/// p in f64 (all 0 for a fully masked row).
fn reference(s: &[f32]) -> Vec<f64> {
    let max = s.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    if max == f64::NEG_INFINITY {
        return vec![0.0; s.len()];
    }
    let e: Vec<f64> = s.iter().map(|&x| (x as f64 - max).exp2()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

#[test]
fn ex02_softmax_row() {
    let rows = rows();
    let mut s: Vec<f32> = rows.iter().flat_map(|(_, r)| r.iter().copied()).collect();
    let mut p = vec![f32::NAN; s.len()];
    // One block of 32 threads: 5 rows, so 27 threads have no row.
    launch(&emu_softmax_rows, (1, 1, 1), 32, 0, &[ptr(&mut s), ptr(&mut p), Arg::Usize(rows.len()), Arg::Usize(COLS)]);
    for (r, (what, scores)) in rows.iter().enumerate() {
        let (got, want) = (&p[r * COLS..(r + 1) * COLS], reference(scores));
        let fully_masked = scores.iter().all(|&x| x == f32::NEG_INFINITY);
        if let Some(j) = got.iter().position(|x| !x.is_finite()) {
            let hint = if fully_masked {
                "its maximum is −∞ and 2^(−∞ − (−∞)) is NaN: when the maximum is −∞, measure from 0 \
                 instead, so that every p is 0"
            } else if r == 2 {
                "2^200 overflows f32: subtract the row's maximum before exp2"
            } else {
                "a NaN or ∞ where every score is finite: is the division by a sum of 0?"
            };
            panic!("row {r} ({what}): p[{j}] = {}, expected {:.4}: {hint} (guide: Level 2)", got[j], want[j]);
        }
        let sum: f64 = got.iter().map(|&x| x as f64).sum();
        let want_sum = if fully_masked { 0.0 } else { 1.0 };
        if (sum - want_sum).abs() > 1e-5 {
            panic!(
                "row {r} ({what}): softmax sums to {sum:.2}, expected {want_sum:.2} — did you normalise by the sum?"
            );
        }
        for j in 0..COLS {
            if scores[j] == f32::NEG_INFINITY && got[j] != 0.0 {
                panic!("row {r} ({what}): p[{j}] = {} for a masked score (−∞), expected 0", got[j]);
            }
            if (got[j] as f64 - want[j]).abs() > 1e-6 + 1e-5 * want[j] {
                panic!(
                    "row {r} ({what}): p[{j}] = {:.6}, expected {:.6} (the row sums to 1, but the values are off): \
                     p_j = exp2(s_j − max) / Σ_k exp2(s_k − max), with exp2 (scores are in base-2 units), not exp",
                    got[j], want[j]
                );
            }
        }
    }
}

//! Exercise 3: `cargo test --release --manifest-path exercises/Cargo.toml ex03`.

mod common;

use attn_kernels::emu::Arg;
use common::{launch, ptr, random};
use exercises::ex03_online_softmax::emu_online_softmax_rows;

const COLS: usize = 40;
const BLOCK_N: usize = 16; // 3 tiles: 16, 16 and a ragged 8

/// The test's rows and what is special about each.
fn rows() -> Vec<(&'static str, Vec<f32>)> {
    let mut first_tile_masked = random(COLS, 21);
    first_tile_masked[..BLOCK_N].fill(f32::NEG_INFINITY);
    vec![
        ("random scores", random(COLS, 20)),
        // The maximum rises in every tile, so a missing rescale shows.
        ("scores rising along the row", (0..COLS).map(|j| j as f32 * 0.5).collect()),
        ("scores near 200", random(COLS, 22).iter().map(|x| 200.0 + 4.0 * x).collect()),
        ("first tile masked (−∞)", first_tile_masked),
        ("every score masked (−∞)", vec![f32::NEG_INFINITY; COLS]),
    ]
}

/// o = Σ_j p_j v_j and the natural LSE, in f64.
fn reference(s: &[f32], v: &[f32]) -> (f64, f64) {
    let max = s.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    if max == f64::NEG_INFINITY {
        return (0.0, f64::NEG_INFINITY);
    }
    let e: Vec<f64> = s.iter().map(|&x| (x as f64 - max).exp2()).collect();
    let sum: f64 = e.iter().sum();
    let o = e.iter().zip(v).map(|(p, &v)| p * v as f64).sum::<f64>() / sum;
    (o, (max + sum.log2()) * std::f64::consts::LN_2)
}

/// Runs the kernel with tiles of `block_n`; returns (o, lse) per row.
fn run(s: &[f32], v: &[f32], rows: usize, block_n: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut s, mut v) = (s.to_vec(), v.to_vec());
    let (mut o, mut lse) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
    let args =
        [ptr(&mut s), ptr(&mut v), ptr(&mut o), ptr(&mut lse), Arg::Usize(rows), Arg::Usize(COLS), Arg::Usize(block_n)];
    launch(&emu_online_softmax_rows, (1, 1, 1), 32, 0, &args);
    (o, lse)
}

fn close(got: f32, want: f64) -> bool {
    (got as f64 == want) || (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs())
}

#[test]
fn ex03_online_softmax_update() {
    let rows = rows();
    let s: Vec<f32> = rows.iter().flat_map(|(_, r)| r.iter().copied()).collect();
    let v = random(COLS, 23);
    let (o, lse) = run(&s, &v, rows.len(), BLOCK_N);
    for (r, (what, scores)) in rows.iter().enumerate() {
        let (want_o, want_lse) = reference(scores, &v);
        if close(o[r], want_o) && close(lse[r], want_lse) {
            continue;
        }
        let found =
            format!("row {r} ({what}): o = {}, LSE = {}, expected o = {want_o:.5}, LSE = {want_lse:.5}", o[r], lse[r]);
        let hint = if o[r].is_nan() || lse[r].is_nan() {
            if r == 3 {
                "a NaN in a row whose first tile is all −∞: m_new is still −∞ there, and 2^(−∞ − (−∞)) \
                 is NaN; measure from 0 when m_new is −∞"
            } else {
                "a NaN: is alpha or a probability computed from −∞ − (−∞), or from ∞?"
            }
        } else if lse[r] == f32::NEG_INFINITY && want_lse.is_finite() {
            "the running sum is still 0 after every tile: update must add the tile's Σ 2^(s_j − m_new) to it"
        } else if want_lse == f64::NEG_INFINITY {
            "a row that sees no score must end with sum 0 (so o = 0 and LSE = −∞)"
        } else if !lse[r].is_finite() || !o[r].is_finite() {
            "an overflow: subtract the new maximum before exp2 (2^200 is inf in f32)"
        } else if close(lse[r], want_lse) {
            "the sum (so LSE) is right but o is not: replace each score in the tile by its probability \
             2^(s_j − m_new), and return alpha so that the caller rescales o's accumulator"
        } else if r == 1 || r == 3 {
            "the maximum rises from tile to tile in this row: rescale the old sum by alpha = 2^(m_old − m_new) \
             before adding the tile's sum, and update max"
        } else {
            "l = l · alpha + Σ_j 2^(s_j − m_new), with m_new = max(m, the tile's max), then m = m_new"
        };
        panic!("{found}: {hint} (guide: The online softmax, derived)");
    }
}

//! Exercise 5: `cargo test --release --manifest-path exercises/Cargo.toml ex05`.

mod common;

use attn_kernels::emu::Arg;
use common::{launch, ptr, random};
use exercises::ex05_tile_loop::{BLOCK_M, HEAD_DIM, SHARED_BYTES, emu_flash_forward};

const HEADS: usize = 2;
/// Two query blocks, the second ragged (padding rows); three key tiles, the last ragged.
const SEQLEN_Q: usize = 37;
const SEQLEN_K: usize = 21;

/// O and the natural LSE of every head in f64: query `i` sees key `j` iff `sees(i, j)`; keys
/// past seqlen_k count (as zero keys with zero values) if `pad_keys_to` is larger.
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sees: impl Fn(usize, usize) -> bool,
    pad_keys_to: usize,
) -> (Vec<f64>, Vec<f64>) {
    let d = HEAD_DIM;
    let (mut o, mut lse) = (vec![0.0; HEADS * SEQLEN_Q * d], vec![f64::NEG_INFINITY; HEADS * SEQLEN_Q]);
    let scale = 1.0 / (d as f64).sqrt();
    for h in 0..HEADS {
        for i in 0..SEQLEN_Q {
            let q_row = &q[(h * SEQLEN_Q + i) * d..][..d];
            let s: Vec<Option<f64>> = (0..pad_keys_to.max(SEQLEN_K))
                .map(|j| {
                    sees(i, j).then(|| {
                        if j >= SEQLEN_K {
                            return 0.0;
                        }
                        let k_row = &k[(h * SEQLEN_K + j) * d..][..d];
                        scale * q_row.iter().zip(k_row).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                    })
                })
                .collect();
            let max = s.iter().flatten().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            if max == f64::NEG_INFINITY {
                continue;
            }
            let sum: f64 = s.iter().flatten().map(|x| (x - max).exp()).sum();
            lse[h * SEQLEN_Q + i] = max + sum.ln();
            for (j, s_j) in s.iter().enumerate() {
                let (Some(s_j), true) = (s_j, j < SEQLEN_K) else { continue };
                let p = (s_j - max).exp() / sum;
                for c in 0..d {
                    o[(h * SEQLEN_Q + i) * d + c] += p * v[(h * SEQLEN_K + j) * d + c] as f64;
                }
            }
        }
    }
    (o, lse)
}

/// Whether every row of (o, lse) matches the reference: the first row that does not, if any.
fn first_bad_row(o: &[f32], lse: &[f32], want: &(Vec<f64>, Vec<f64>)) -> Option<usize> {
    (0..HEADS * SEQLEN_Q).find(|&r| {
        let (w_lse, g_lse) = (want.1[r], lse[r] as f64);
        let lse_ok = if w_lse == f64::NEG_INFINITY {
            g_lse == w_lse
        } else {
            (g_lse - w_lse).abs() <= 1e-5 * (1.0 + w_lse.abs())
        };
        let o_ok = (0..HEAD_DIM).all(|c| (o[r * HEAD_DIM + c] as f64 - want.0[r * HEAD_DIM + c]).abs() <= 1e-5);
        !(lse_ok && o_ok)
    })
}

#[test]
fn ex05_tile_loop() {
    let (mut q, mut k, mut v) = (
        random(HEADS * SEQLEN_Q * HEAD_DIM, 30),
        random(HEADS * SEQLEN_K * HEAD_DIM, 31),
        random(HEADS * SEQLEN_K * HEAD_DIM, 32),
    );
    let scale_log2 = std::f32::consts::LOG2_E / (HEAD_DIM as f32).sqrt();
    for (name, causal, offset) in [
        ("not causal", 0, 0isize),
        ("causal (top-left)", 1, 0),
        ("causal (bottom-right)", 1, SEQLEN_K as isize - SEQLEN_Q as isize),
    ] {
        let sees = |i: usize, j: usize| j < SEQLEN_K && (causal == 0 || j as isize <= i as isize + offset);
        let want = reference(&q, &k, &v, sees, 0);
        let (mut o, mut lse) = (vec![f32::NAN; q.len()], vec![f32::NAN; HEADS * SEQLEN_Q]);
        let args = [
            ptr(&mut q),
            ptr(&mut k),
            ptr(&mut v),
            ptr(&mut o),
            ptr(&mut lse),
            Arg::Usize(SEQLEN_Q),
            Arg::Usize(SEQLEN_K),
            Arg::Usize(causal),
            Arg::Isize(offset),
            Arg::F32(scale_log2),
        ];
        launch(&emu_flash_forward, (SEQLEN_Q.div_ceil(BLOCK_M), HEADS, 1), BLOCK_M, SHARED_BYTES, &args);
        let Some(r) = first_bad_row(&o, &lse, &want) else { continue };
        let (h, i) = (r / SEQLEN_Q, r % SEQLEN_Q);
        let row = &o[r * HEAD_DIM..][..HEAD_DIM];
        let found = format!(
            "{name}, head {h}, query {i}: O[..3] = {:?}, LSE = {}; expected O[..3] = {:.4?}, LSE = {:.5}",
            &row[..3],
            lse[r],
            &want.0[r * HEAD_DIM..][..3],
            want.1[r]
        );
        // Tell the usual bugs apart by the reference they match instead.
        let unmasked_tail =
            reference(&q, &k, &v, |i, j| j < 24 && (causal == 0 || j as isize <= i as isize + offset), 24);
        let no_causal = reference(&q, &k, &v, |_, j| j < SEQLEN_K, 0);
        let hint = if row.iter().all(|&x| x == 0.0) && lse[r] == f32::NEG_INFINITY && want.1[r].is_finite() {
            "O is all 0 and LSE = −inf: nothing was accumulated — write the tile loop's body".to_string()
        } else if row.iter().any(|x| x.is_nan()) || lse[r].is_nan() {
            "a NaN: masked scores must be −∞ before the maximum, and while m_new is −∞ measure from 0 \
             (2^(−∞ − (−∞)) is NaN)"
                .to_string()
        } else if first_bad_row(&o, &lse, &unmasked_tail).is_none() {
            format!(
                "the zero-filled keys past seqlen_k = {SEQLEN_K} in the last tile were counted: mask every key \
                 with !mask.visible(query, k_start + j)"
            )
        } else if causal == 1 && first_bad_row(&o, &lse, &no_causal).is_none() {
            "this is the result without the causal mask: a key with !mask.visible(query, key) gets s = −∞".to_string()
        } else {
            "check the scores, s_j = (q · k_j) · scale_log2 with k_j the tile's row j, and the rescaling: when \
             the maximum rises in a later tile, both l and acc are multiplied by alpha = 2^(m_old − m_new) before \
             the tile's p_j and p_j · v_j are added"
                .to_string()
        };
        panic!("{found}: {hint} (guide: Level 3; exercise 3 for the online softmax)");
    }
}

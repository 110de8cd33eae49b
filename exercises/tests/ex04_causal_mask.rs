//! Exercise 4: `cargo test --release --manifest-path exercises/Cargo.toml ex04`.

mod common;

use attn_kernels::emu::Arg;
use common::{launch, ptr};
use exercises::ex04_causal_mask::emu_mask_matrix;

/// Padding query rows past seqlen_q, as in a last query tile.
const PADDING: usize = 3;

/// The expected key limit of query `i`.
fn expected_limit(i: usize, seqlen_q: usize, seqlen_k: usize, causal: bool, offset: isize) -> usize {
    if i >= seqlen_q {
        0
    } else if causal {
        (i as isize + 1 + offset).clamp(0, seqlen_k as isize) as usize
    } else {
        seqlen_k
    }
}

/// The mask as a picture: one line per query, `#` visible, `.` hidden.
fn picture(visible: &[f32], rows: usize, seqlen_k: usize) -> String {
    (0..rows)
        .map(|i| {
            let line: String =
                (0..seqlen_k).map(|j| if visible[i * seqlen_k + j] == 1.0 { '#' } else { '.' }).collect();
            format!("    query {i:2}  {line}\n")
        })
        .collect()
}

#[test]
fn ex04_causal_mask() {
    for (seqlen_q, seqlen_k) in [(5, 8), (8, 5), (6, 6)] {
        for (name, causal, offset) in [
            ("not causal", false, 0),
            ("causal (top-left)", true, 0),
            ("causal (bottom-right)", true, seqlen_k as isize - seqlen_q as isize),
        ] {
            let rows = seqlen_q + PADDING;
            let (mut limits, mut visible) = (vec![f32::NAN; rows], vec![f32::NAN; rows * seqlen_k]);
            let args = [
                ptr(&mut limits),
                ptr(&mut visible),
                Arg::Usize(rows),
                Arg::Usize(seqlen_q),
                Arg::Usize(seqlen_k),
                Arg::Usize(causal as usize),
                Arg::Isize(offset),
            ];
            launch(&emu_mask_matrix, (1, 1, 1), 32, 0, &args);
            let case = format!("{name}, seqlen_q = {seqlen_q}, seqlen_k = {seqlen_k}, offset {offset}");
            let shown = || {
                format!("your mask ({rows} rows, the last {PADDING} padding):\n{}", picture(&visible, rows, seqlen_k))
            };
            for i in 0..rows {
                let want = expected_limit(i, seqlen_q, seqlen_k, causal, offset);
                if limits[i] != want as f32 {
                    let hint = if i >= seqlen_q {
                        format!("query {i} is a padding row (≥ seqlen_q = {seqlen_q}): it sees no key")
                    } else if causal && (i as isize + 1 + offset) <= 0 {
                        "key j is visible iff j ≤ i + offset; here i + 1 + offset ≤ 0, so no key: clamp at 0 \
                         (compute in isize, the offset is negative)"
                            .to_string()
                    } else if causal && (i as isize + 1 + offset) > seqlen_k as isize {
                        format!("i + 1 + offset is past the last key: clamp the limit to seqlen_k = {seqlen_k}")
                    } else if causal {
                        "key j is visible iff j ≤ i + offset, so key_limit(i) = i + 1 + offset".to_string()
                    } else {
                        "without a causal mask every query sees every key".to_string()
                    };
                    panic!(
                        "{case}: query {i} has key_limit {}, expected {want}: {hint} (guide: Level 3)\n{}",
                        limits[i],
                        shown()
                    );
                }
                for j in 0..seqlen_k {
                    let want = j < want;
                    if (visible[i * seqlen_k + j] == 1.0) != want {
                        panic!(
                            "{case}: visible(query {i}, key {j}) is {}, expected {want}: visible(i, j) is \
                             j < key_limit(i)\n{}",
                            !want,
                            shown()
                        );
                    }
                }
            }
        }
    }
}

//! Exercise 1: `cargo test --release --manifest-path exercises/Cargo.toml ex01`.

mod common;

use attn_kernels::emu::Arg;
use common::{launch, ptr, random};
use exercises::ex01_vector_add::emu_vector_add;

/// The grid of the test: 2 blocks of 64 threads.
const BLOCKS: usize = 2;
const THREADS: usize = 64;

#[test]
fn ex01_vector_add() {
    let grid_threads = BLOCKS * THREADS;
    for n in [1, 2, 3, 5, 63, 64, 65, 127, 128, 129, 1000, 4099] {
        let (mut a, mut b) = (random(n, 1), random(n, 2));
        // Four guard elements past the end: a kernel must not write them.
        let mut c = vec![f32::NAN; n + 4];
        launch(&emu_vector_add, (BLOCKS, 1, 1), THREADS, 0, &[ptr(&mut a), ptr(&mut b), ptr(&mut c), Arg::Usize(n)]);
        for i in 0..n {
            let want = a[i] + b[i];
            if c[i] == want {
                continue;
            }
            if !c[i].is_nan() {
                panic!(
                    "n = {n}: c[{i}] = {}, expected a[{i}] + b[{i}] = {want}: is it a + b of the same index i?",
                    c[i]
                );
            }
            let hint = if i == 0 {
                "nothing was written: start with `let mut i = hw::global_thread_idx();` and store \
                 `*c.add(i) = *a.add(i) + *b.add(i)` while `i < n`"
                    .to_string()
            } else if i >= grid_threads {
                format!(
                    "the grid has {grid_threads} threads ({BLOCKS} blocks of {THREADS}), so element {i} needs a \
                     thread's second (or later) step: a grid-stride loop, `i += hw::grid_stride()`"
                )
            } else {
                format!(
                    "thread {i} of the grid should write it: its index is blockIdx.x · blockDim.x + threadIdx.x \
                     (`hw::global_thread_idx()`), not the index within the block"
                )
            };
            panic!("n = {n}: c[{i}] was never written (still NaN), expected {want}: {hint} (guide: Level 1)");
        }
        if let Some(j) = c[n..].iter().position(|x| !x.is_nan()) {
            panic!("n = {n}: c[{}] was written, past the end of the array: stop the loop at i < n", n + j);
        }
    }
}

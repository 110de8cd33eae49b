//! What every exercise test shares: seeded inputs and an emulator launch that fails the test
//! with the emulator's own message (which names the block, the thread and the source line).

#![allow(dead_code)]

use attn_kernels::emu::{self, Arg, HostKernel, Launch};

/// `n` values in [−2, 2) from a seeded generator (xorshift64*): the same on every machine.
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
            bits as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

/// A pointer argument to a buffer the kernel reads or writes.
pub fn ptr(buffer: &mut [f32]) -> Arg {
    Arg::Ptr(buffer.as_mut_ptr())
}

/// Runs `kernel` on the emulator over `grid` blocks of `threads` threads with `shared_bytes`
/// of dynamic shared memory; panics with the emulator's report if it finds a bug.
pub fn launch(kernel: &HostKernel, grid: (usize, usize, usize), threads: usize, shared_bytes: usize, args: &[Arg]) {
    // SAFETY: every test passes buffers as long as its kernel's contract asks.
    if let Err(e) = unsafe { emu::launch(kernel, Launch::new(grid, threads, shared_bytes), args) } {
        panic!("{e}");
    }
}

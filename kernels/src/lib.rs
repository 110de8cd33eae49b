//! # Device crate: attention kernels written in Rust, compiled to PTX by rustc
//!
//! Every kernel here is an `extern "gpu-kernel"` function with an unmangled name, so the host can
//! load it by name from the PTX module that `host/build.rs` produces from this crate. Read the
//! modules in this order; each one adds one idea to the last:
//!
//! | level | module | what it teaches |
//! |---|---|---|
//! | 0 | [`gpu`] | the hardware as a handful of functions: thread and block indices, shared memory, barriers, warp shuffles, fast `exp2`/`log2` |
//! | 1 | [`vector_add`] | one thread per element, a grid-stride loop, 16-byte loads, a guarded tail |
//! | 2 | [`naive_attention`] | "standard" attention (FlashAttention paper, Algorithm 0): S = QKᵀ and P = softmax(S) make a round trip through HBM, N×N floats each |
//! | — | [`layout`] | what host and device must agree on: block sizes, shared-memory layouts, the problem shape (compiled into both crates from this one file) |
//! | 3 | [`flash_forward`] | FlashAttention-2 forward (Dao 2023, Algorithm 1): Q, K, V tiles in shared memory, online softmax, O and the logsumexp written once; causal masks that skip hidden tiles |
//! | 4 | [`flash_backward`] | FlashAttention-2 backward (Algorithm 2): recomputing P from the saved logsumexp instead of storing it; dQ by atomics or by a deterministic second pass |
//!
//! Kernels never touch `core::arch::nvptx` or `asm!` directly: they go through [`gpu`], so the
//! hardware-facing surface is one short file.
//!
//! Tensors are row-major `[batch, heads, seqlen, head_dim]` `f32` arrays (PyTorch's
//! `scaled_dot_product_attention` layout); the host crate validates every shape before a launch.
#![no_std]
#![feature(
    abi_gpu_kernel,
    asm_experimental_arch,
    core_intrinsics,
    gpu_intrinsics,
    gpu_launch_sized_workgroup_mem,
    link_llvm_intrinsics,
    macro_metavar_expr_concat,
    portable_simd,
    stdarch_nvptx
)]
#![allow(internal_features)]
// Kernels index small register arrays by row and column on purpose: `acc[i][g]` with the thread
// mapping's names reads like the algorithm, where iterator chains would hide it.
#![allow(clippy::needless_range_loop)]

/// Calls `$instance!(block_m, block_n, head_dim)` for every compiled FlashAttention tile: the one
/// list of tile shapes, shared by the forward and backward kernels (the host reads the resulting
/// kernel names from the PTX).
macro_rules! for_each_tile {
    ($instance:ident) => {
        for_each_tile!(@m $instance, [16 32 64], [16 32 64], [32 64 128]);
    };
    (@m $instance:ident, [$($block_m:literal)*], $block_n:tt, $head_dim:tt) => {
        $( for_each_tile!(@mn $instance, $block_m, $block_n, $head_dim); )*
    };
    (@mn $instance:ident, $block_m:literal, [$($block_n:literal)*], $head_dim:tt) => {
        $( for_each_tile!(@mnd $instance, $block_m, $block_n, $head_dim); )*
    };
    (@mnd $instance:ident, $block_m:literal, $block_n:literal, [$($head_dim:literal)*]) => {
        $( $instance!($block_m, $block_n, $head_dim); )*
    };
}

pub mod gpu;
pub mod layout;
pub mod tiles;

pub mod flash_backward;
pub mod flash_forward;
pub mod naive_attention;
pub mod vector_add;

/// A panic on the device cannot print: it stops the kernel with `trap`, which the host sees as a
/// launch failure (`CUDA_ERROR_LAUNCH_FAILED`) at its next synchronisation. Kernels are written so
/// that they cannot panic (no slices, no bounds checks, no integer division by a value that can be
/// zero), so this is only reached through a bug.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    gpu::trap()
}

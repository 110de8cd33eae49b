//! # Device crate: attention kernels written in Rust, compiled to PTX by rustc
//!
//! Every kernel here is an `extern "gpu-kernel"` function with an unmangled name, so the host can
//! load it by name from the PTX module that `host/build.rs` produces from this crate. Read the
//! modules in this order; each one adds one idea to the last:
//!
//! | level | module | what it teaches |
//! |---|---|---|
//! | 0 | [`gpu`] | the hardware as a handful of functions: thread and block indices, shared memory, barriers, warp shuffles, fast `exp2`/`log2`; tensor-core fragments (`mma.sync`, `ldmatrix`, `movmatrix`) and `cp.async` |
//! | 1 | [`vector_add`] | one thread per element, a grid-stride loop, 16-byte loads, a guarded tail |
//! | 2 | [`naive_attention`] | "standard" attention (FlashAttention paper, Algorithm 0): S = QKᵀ and P = softmax(S) make a round trip through HBM, N×N floats each |
//! | — | [`layout`] | what host and device must agree on: block sizes, shared-memory layouts, the problem shape (compiled into both crates from this one file) |
//! | 3 | [`flash_forward`] | FlashAttention-2 forward (Dao 2023, Algorithm 1): Q, K, V tiles in shared memory, online softmax, O and the logsumexp written once; causal masks that skip hidden tiles |
//! | 4 | [`flash_backward`] | FlashAttention-2 backward (Algorithm 2): recomputing P from the saved logsumexp instead of storing it; dQ by atomics or by a deterministic second pass |
//! | 5 | [`flash_forward_mma`] | the forward pass on tensor cores in `f16`/`bf16`: `mma.sync` fragments, `ldmatrix`, P kept in registers between the two products, a `cp.async` pipeline |
//! | 6 | [`flash_backward_mma`] | the backward pass on tensor cores: transposed products that keep Pᵀ and dSᵀ in registers, dQ by atomics or deterministic |
//! | 7 | `hopper` (nvptx64 only) | Hopper's asynchronous units (sm_90a): `wgmma` from shared-memory descriptors (plain and 128-byte swizzled), TMA copies completing on `mbarrier`s, named barriers, `setmaxnreg`, the proxy fences between them; probe kernels that check them |
//! | 8 | `flash_forward_wgmma` (nvptx64 only) | the forward pass in FlashAttention-3's shape: a TMA producer warpgroup, two `wgmma` consumer warpgroups, the softmax overlapped with the products |
//! | 9 | `flash_backward_wgmma` (nvptx64 only) | the backward pass on the same machinery: dK, dV in registers, dSᵀ staged in shared memory as dQ's MN-major operand, dQ by vector atomics |
//!
//! Kernels never touch `core::arch::nvptx` or `asm!` directly: they go through [`gpu`] (or, for
//! Hopper's asynchronous units, through the wrappers at the top of `hopper`), so the
//! hardware-facing surface is small, and on the host the same helpers run the kernels
//! in the CPU emulator (`emu`, host builds only), which checks shared-memory bounds, races and
//! barriers. Kernels are declared with the `kernel!` macro, which makes them GPU entry points
//! on nvptx64 and emulator entries on the host.
//!
//! Tensors are row-major `[batch, heads, seqlen, head_dim]` arrays (PyTorch's
//! `scaled_dot_product_attention` layout) of `f32`, or of 16-bit floats (`f16`/`bf16`, passed as
//! their raw bits, `u16`) for the tensor-core kernels; the host crate validates every shape before
//! a launch.
// On nvptx64 the crate is `no_std` and its kernels are GPU entry points; on the host it is an
// ordinary library whose kernels run in the CPU emulator (`emu`), which needs `std`.
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        abi_gpu_kernel,
        asm_experimental_arch,
        core_intrinsics,
        gpu_intrinsics,
        gpu_launch_sized_workgroup_mem,
        link_llvm_intrinsics,
        stdarch_nvptx
    )
)]
#![feature(macro_metavar_expr_concat, portable_simd)]
// The emulator rounds to IEEE half with the host's `f16` type.
#![cfg_attr(not(target_arch = "nvptx64"), feature(f16))]
#![allow(internal_features)]
// Kernels index small register arrays by row and column on purpose: `acc[i][g]` with the thread
// mapping's names reads like the algorithm, where iterator chains would hide it.
#![allow(clippy::needless_range_loop)]

/// Defines a kernel once for both targets. On nvptx64 it is an `extern "gpu-kernel"` function with
/// an unmangled name: an entry of the PTX module that the host loads by name. On the host it is a
/// plain `unsafe fn`, plus a constant `emu_<name>` ([`emu::HostKernel`]) through which the CPU
/// emulator calls it with the launch's arguments.
macro_rules! kernel {
    ($(#[$attr:meta])* pub unsafe fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        #[cfg(target_arch = "nvptx64")]
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name($($arg: $ty),*) $body

        $(#[$attr])*
        #[cfg(not(target_arch = "nvptx64"))]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) $body

        /// The CPU emulator's entry for the kernel of the same name.
        #[cfg(not(target_arch = "nvptx64"))]
        #[allow(non_upper_case_globals)]
        pub const ${concat(emu_, $name)}: $crate::emu::HostKernel = $crate::emu::HostKernel {
            name: stringify!($name),
            run: |args| {
                let expected = [$(stringify!($arg)),*].len();
                if args.len() != expected {
                    return Err(format!("{} arguments given, {} expected", args.len(), expected));
                }
                let mut args = args.iter();
                $(
                    let $arg = args
                        .next()
                        .and_then(<$ty as $crate::emu::FromArg>::from_arg)
                        .ok_or_else(|| format!("argument `{}` has the wrong type", stringify!($arg)))?;
                )*
                // SAFETY: the caller of `emu::launch` guarantees the pointers.
                unsafe { $name($($arg),*) };
                Ok(())
            },
        };
    };
}

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

/// Calls `$instance!(dtype, Format, block_m, block_n, head_dim, stages)` for every listed tile,
/// first in `f16` (`gpu::F16`), then in `bf16` (`gpu::Bf16`): how the tensor-core kernels list
/// their compiled instances (the host reads the resulting kernel names from the PTX).
macro_rules! for_each_half_format {
    ($instance:ident, [$(($block_m:literal, $block_n:literal, $head_dim:literal, $stages:literal)),* $(,)?]) => {
        $( $instance!(f16, F16, $block_m, $block_n, $head_dim, $stages); )*
        $( $instance!(bf16, Bf16, $block_m, $block_n, $head_dim, $stages); )*
    };
}

#[cfg(not(target_arch = "nvptx64"))]
pub mod emu;
pub mod gpu;
pub mod layout;
pub mod tiles;

pub mod flash_backward;
pub mod flash_backward_mma;
#[cfg(target_arch = "nvptx64")]
pub mod flash_backward_wgmma;
pub mod flash_forward;
pub mod flash_forward_mma;
#[cfg(target_arch = "nvptx64")]
pub mod flash_forward_wgmma;
#[cfg(target_arch = "nvptx64")]
pub mod hopper;
pub mod naive_attention;
pub mod vector_add;

/// Every kernel and, on the host, its emulator entry `emu_<name>`, in one namespace (the host
/// crate's build script names them from the PTX's entry list).
pub mod kernels {
    pub use crate::flash_backward::*;
    pub use crate::flash_backward_mma::*;
    pub use crate::flash_forward::*;
    pub use crate::flash_forward_mma::*;
    pub use crate::naive_attention::*;
    pub use crate::vector_add::*;
}

/// A panic on the device cannot print: it stops the kernel with `trap`, which the host sees as a
/// launch failure (`CUDA_ERROR_LAUNCH_FAILED`) at its next synchronisation. Kernels are written so
/// that they cannot panic (no slices, no bounds checks, no integer division by a value that can be
/// zero), so this is only reached through a bug.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    gpu::trap()
}

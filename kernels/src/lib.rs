//! # Device crate: attention kernels written in Rust, compiled to PTX by rustc
//!
//! Every kernel here is an `extern "gpu-kernel"` function with an unmangled name, so the host can
//! load it by name from the PTX module that `host/build.rs` produces from this crate. Read the
//! modules in this order; each one adds one idea to the last:
//!
//! | level | file | what it teaches |
//! |---|---|---|
//! | 0 | [`hw`] (`hw/`) | the hardware as a handful of functions, by who runs them: thread, warp, block, tensor-core fragments (`mma.sync`, `ldmatrix`, `movmatrix`), and on Hopper warpgroup (`wgmma`) and TMA/`mbarrier` |
//! | 1 | [`simt::vector_add`] | one thread per element, a grid-stride loop, 16-byte loads, a guarded tail |
//! | 2 | [`simt::naive`] | "standard" attention (FlashAttention paper, Algorithm 0): S = QKᵀ and P = softmax(S) make a round trip through HBM, N×N floats each |
//! | 3 | [`simt::forward`] | FlashAttention-2 forward (Dao 2023, Algorithm 1): Q, K, V tiles in shared memory, online softmax, O and the logsumexp written once; causal masks that skip hidden tiles |
//! | 4 | [`simt::backward`] | FlashAttention-2 backward (Algorithm 2): recomputing P from the saved logsumexp instead of storing it; dQ by atomics or by a deterministic second pass |
//! | 5 | [`sm80::forward`] | the forward pass on tensor cores in `f16`/`bf16`: `mma.sync` fragments, `ldmatrix`, P kept in registers between the two products, a `cp.async` pipeline |
//! | 6 | [`sm80::backward`] | the backward pass on tensor cores: transposed products that keep Pᵀ and dSᵀ in registers, dQ by atomics or deterministic |
//! | 7 | `sm90::probes` (nvptx64 only) | Hopper's asynchronous units (sm_90a): `wgmma` from shared-memory descriptors (plain and 128-byte swizzled), TMA copies completing on `mbarrier`s; probe kernels that check them |
//! | 8 | `sm90::forward` (nvptx64 only) | the forward pass in FlashAttention-3's shape: a TMA producer warpgroup, `wgmma` consumer warpgroups, the softmax overlapped with the products |
//! | 9 | `sm90::backward` (nvptx64 only) | the backward pass on the same machinery: dK, dV in registers, dSᵀ staged in shared memory as dQ's MN-major operand, dQ by TMA reduce-add |
//! | 10 | [`sm80::decode`] | decoding from a KV cache: split-KV with an LSE merge, grouped-query heads packed into the rows, warps that split the keys, paged and token-major caches |
//!
//! Beside the levels:
//!
//! | file | what |
//! |---|---|
//! | [`attention`] | what every tier shares, one home per concept: the mask and tile ranges, the block schedule, the online softmax, the m16n8 fragment map, the epilogue |
//! | [`layout`] | what host and device must agree on: block sizes, shared-memory layouts, the problem shape (the host crate uses this module) |
//! | [`configs`] | every compiled configuration: tile lists, register budgets, launch bounds (read by `host/build.rs` too) |
//! | `sm90::pipeline` (nvptx64 only), [`sm80::pipeline`] | the shared-memory rings the tiers stream K/V (and Q/dO) through: on Hopper with their barriers and producer/consumer roles |
//!
//! Kernels never touch `core::arch::nvptx` or `asm!` directly: they go through [`hw`], so the
//! hardware-facing surface is small, and on the host the same functions run the kernels in the
//! CPU emulator ([`hw::emu`], host builds only), which checks shared-memory bounds, races and
//! barriers. Kernels are declared with the `kernel!` macro (entries of the PTX on nvptx64,
//! emulator entries on the host), the attention kernels through `attention_kernel!`, which
//! appends the problem arguments every tier shares.
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
        portable_simd,
        stdarch_nvptx
    )
)]
#![allow(internal_features)]
// Kernels index small register arrays by row and column on purpose: `acc[i][g]` with the thread
// mapping's names reads like the algorithm, where iterator chains would hide it.
#![allow(clippy::needless_range_loop)]

// ANCHOR: kernel_macro
/// Defines a kernel once for both targets. On nvptx64 it is an `extern "gpu-kernel"` function with
/// an unmangled name: an entry of the PTX module that the host loads by name. On the host it is a
/// plain `unsafe fn`, plus a constant `emu_<name>` ([`hw::emu::HostKernel`]) through which the CPU
/// emulator calls it with the launch's arguments. Exported: the guide's exercises (`exercises/`)
/// declare their kernels with it too.
#[macro_export]
macro_rules! kernel {
    ($(#[$attr:meta])* pub unsafe fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        #[cfg(target_arch = "nvptx64")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $name($($arg: $ty),*) $body

        $(#[$attr])*
        #[cfg(not(target_arch = "nvptx64"))]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) $body

        // `emu_<name>`: pasted into one identifier by `pastey` (a name made of a macro's
        // arguments is beyond `macro_rules!` on stable Rust).
        #[cfg(not(target_arch = "nvptx64"))]
        $crate::pastey::paste! {
            /// The CPU emulator's entry for the kernel of the same name.
            #[allow(non_upper_case_globals)]
            pub const [<emu_ $name>]: $crate::hw::emu::HostKernel = $crate::hw::emu::HostKernel {
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
                            .and_then(<$ty as $crate::hw::emu::FromArg>::from_arg)
                            .ok_or_else(|| format!("argument `{}` has the wrong type", stringify!($arg)))?;
                    )*
                    // SAFETY: the caller of `emu::launch` guarantees the pointers.
                    unsafe { $name($($arg),*) };
                    Ok(())
                },
            };
        }
    };
}
// ANCHOR_END: kernel_macro

/// `pastey`, for the exported `kernel!` as it expands in other crates (the exercises).
#[doc(hidden)]
pub use pastey;

/// Declares an attention kernel: `kernel!` with the problem arguments that every attention
/// kernel of every tier takes appended after its own, in this order:
///
/// `batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim` (rebuilt into the body's
/// [`layout::AttentionShape`]), `causal, causal_offset, window_offset, mask_table` (rebuilt
/// into its [`attention::mask::Mask`]), `softcap, alibi_max_bias, sinks, bias, bias_grad,
/// bias_batch_stride, bias_head_stride` (its [`attention::score::ScoreArgs`]) and the scale (`f32`, named by the caller: the forward kernels take
/// `scale · log₂e`, the others `scale`). They arrive as plain integers rather than as structs:
/// rustc warns that structs passed by value to `extern "gpu-kernel"` functions may not match what
/// the driver passes. This list is the one place to change when the problem gains an argument
/// (a new kind of mask); the host's launchers push the same list (`ProblemArgs`).
///
/// With `table twin` after the argument list, the kernel comes as two entries: `$name`, whose
/// body sees a mask that never has a band table (the table argument is ignored:
/// [`attention::mask::Mask::specialised`]), and `${name}_table`, whose body reads the table.
/// The body gets a fifth name, a `const bool` that is true in the twin, to pick its own copies
/// by. Why two entries rather than one kernel with two copies: a kernel has one register
/// allocation, the largest any of its copies needs, and the table's copy needed more than the
/// sm_80 kernels had (PERFORMANCE.md, "table twins"). The host launches the twin exactly when a
/// table is bound (`ProblemArgs::entry`); every sm_80-path flash kernel has one.
macro_rules! attention_kernel {
    (
        $(#[$attr:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?)
        |$shape:ident, $mask:ident, $score:ident, $scale:ident| $body:block
    ) => {
        attention_kernel!(@entry $(#[$attr])* fn $name($($arg: $ty),*)
            |$shape, $mask, $score, $scale| any, $body);
    };
    (
        $(#[$attr:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) table twin
        |$shape:ident, $mask:ident, $score:ident, $scale:ident, $table:ident| $body:block
    ) => {
        attention_kernel!(@entry $(#[$attr])* fn $name($($arg: $ty),*)
            |$shape, $mask, $score, $scale| no_table,
            { #[allow(dead_code)] const $table: bool = false; $body });
        $crate::pastey::paste! {
            attention_kernel!(@entry
                $(#[$attr])*
                #[doc = "\n\nThe `_table` twin: for problems with a band table (see `attention_kernel!`)."]
                fn [<$name _table>]($($arg: $ty),*)
                |$shape, $mask, $score, $scale| any,
                { #[allow(dead_code)] const $table: bool = true; $body });
        }
    };
    (
        @entry $(#[$attr:meta])*
        fn $name:ident($($arg:ident: $ty:ty),*)
        |$shape:ident, $mask:ident, $score:ident, $scale:ident| $tables:ident, $body:block
    ) => {
        kernel! {
        $(#[$attr])*
        pub unsafe fn $name(
            $($arg: $ty,)*
            batch: usize,
            num_heads_q: usize,
            num_heads_kv: usize,
            seqlen_q: usize,
            seqlen_k: usize,
            head_dim: usize,
            causal: usize,
            causal_offset: isize,
            window_offset: isize,
            mask_table: *const u32,
            softcap: f32,
            alibi_max_bias: f32,
            sinks: *const f32,
            bias: *const f32,
            bias_grad: *mut f32,
            bias_batch_stride: usize,
            bias_head_stride: usize,
            $scale: f32,
        ) {
            let $shape = $crate::layout::AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
            let $mask = attention_kernel!(@$tables
                $crate::attention::mask::Mask::from_args(seqlen_q, seqlen_k, causal, causal_offset, window_offset)
                    .with_table(mask_table)
            );
            let $score = $crate::attention::score::ScoreArgs {
                softcap, alibi_max_bias, sinks, bias, bias_grad, bias_batch_stride, bias_head_stride,
            };
            $body
        }
        }
    };
    // The mask of an entry that reads a band table if one is bound, and of one that never does.
    (@any $mask:expr) => { $mask };
    (@no_table $mask:expr) => { $mask.specialised::<false>() };
}

/// Calls `$instance!(a, b, c)` for every combination of one value from each of the three lists:
/// how [`configs`] lists the `f32` tiles.
macro_rules! cross_product {
    ($instance:ident, [$($a:literal)*], $b:tt, $c:tt) => {
        $( cross_product!(@a $instance, $a, $b, $c); )*
    };
    (@a $instance:ident, $a:literal, [$($b:literal)*], $c:tt) => {
        $( cross_product!(@b $instance, $a, $b, $c); )*
    };
    (@b $instance:ident, $a:literal, $b:literal, [$($c:literal)*]) => {
        $( $instance!($a, $b, $c); )*
    };
}

/// Calls `$instance!(dtype, Format, config…)` for every listed configuration, first in `f16`
/// (`hw::F16`), then in `bf16` (`hw::Bf16`): how [`configs`] lists the 16-bit tiers.
macro_rules! each_half_format {
    ($instance:ident, [$(($($config:tt)*)),* $(,)?]) => {
        $( $instance!(f16, F16, $($config)*); )*
        $( $instance!(bf16, Bf16, $($config)*); )*
    };
}

#[macro_use]
pub mod configs;

pub mod attention;
pub mod hw;
pub mod layout;
pub mod simt;
pub mod sm80;
#[cfg(target_arch = "nvptx64")]
pub mod sm90;

/// The CPU emulator (host builds only), as the host crate names it.
#[cfg(not(target_arch = "nvptx64"))]
pub use hw::emu;

/// Every kernel and, on the host, its emulator entry `emu_<name>`, in one namespace (the host
/// crate's build script names them from the PTX's entry list).
pub mod kernels {
    pub use crate::simt::backward::*;
    pub use crate::simt::forward::*;
    pub use crate::simt::naive::*;
    pub use crate::simt::vector_add::*;
    pub use crate::sm80::backward::*;
    pub use crate::sm80::decode::*;
    pub use crate::sm80::forward::*;
}

/// A panic on the device cannot print: it stops the kernel with `trap`, which the host sees as a
/// launch failure (`CUDA_ERROR_LAUNCH_FAILED`) at its next synchronisation. Kernels are written so
/// that they cannot panic (no slices, no bounds checks, no integer division by a value that can be
/// zero), so this is only reached through a bug.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    hw::trap()
}

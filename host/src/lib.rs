//! # Host crate: GPU attention kernels written in Rust, launched from Rust
//!
//! The device code lives in the `kernels/` crate; `build.rs` compiles it to PTX with rustc's
//! `nvptx64-nvidia-cuda` target and embeds the PTX here ([`kernels`]). At run time a [`Context`]
//! loads that PTX through the CUDA driver API ([`cudarc`], which loads `libcuda` dynamically, so
//! this crate builds and its CPU parts run on machines without a GPU).
//!
//! ```no_run
//! use attn_host::{AttentionOptions, Causal, Context, check};
//!
//! # fn main() -> attn_host::Result<()> {
//! let ctx = Context::new(0)?; // or Context::cpu_emulated()
//! let shape = [2, 8, 1024, 64]; // [batch, heads, seqlen, head_dim]
//! let n = shape.iter().product();
//! let q = ctx.upload(&check::random_normal(n, 1), &shape)?;
//! let k = ctx.upload(&check::random_normal(n, 2), &shape)?;
//! let v = ctx.upload(&check::random_normal(n, 3), &shape)?;
//! // One call each way: the context picks the kernels, the tile and the dQ mode.
//! let forward = ctx.attention(&q, &k, &v, &AttentionOptions::causal(Causal::TopLeft))?;
//! let d_o = ctx.upload(&check::random_normal(n, 4), &shape)?;
//! let grads = ctx.attention_backward(&forward, &d_o)?;
//! # Ok(()) }
//! ```
//!
//! The same with explicit tiles and dQ mode (for measurements, and as the guide's levels do):
//!
//! ```no_run
//! use attn_host::{AttentionOptions, Causal, Context, DqAccumulation, TileConfig, check};
//!
//! # fn main() -> attn_host::Result<()> {
//! let ctx = Context::new(0)?;
//! let shape = [2, 8, 1024, 64]; // [batch, heads, seqlen, head_dim]
//! let n = shape.iter().product();
//! let q = ctx.upload(&check::random_normal(n, 1), &shape)?;
//! let k = ctx.upload(&check::random_normal(n, 2), &shape)?;
//! let v = ctx.upload(&check::random_normal(n, 3), &shape)?;
//! let options = AttentionOptions::causal(Causal::TopLeft);
//! let out = ctx.flash_attention_forward(&q, &k, &v, &options, TileConfig::default_for(64))?;
//! let (o, lse) = (out.o.to_host()?, out.lse.to_host()?); // [2, 8, 1024, 64] and [2, 8, 1024]
//!
//! // Backward: dO = ∂loss/∂O in, dQ, dK, dV out.
//! let d_o = ctx.upload(&check::random_normal(n, 4), &shape)?;
//! let grads = ctx.flash_attention_backward(
//!     &q, &k, &v, &out.o, &out.lse, &d_o, &options, TileConfig::default_backward_for(64), DqAccumulation::Atomic,
//! )?;
//! let dq = grads.dq.to_host()?;
//! # Ok(()) }
//! ```
//!
//! | item | what |
//! |---|---|
//! | [`Context`] | one device, its stream (or the caller's: [`Context::on_stream`]), the loaded kernels; [`DeviceInfo`], [`GpuProfile`]; or the CPU emulator ([`Context::cpu_emulated`], [`Device`]) |
//! | [`DeviceTensor`] | a buffer of [`Element`]s (`f32`, [`struct@f16`], [`struct@bf16`]; [`DType`]) in device memory with its shape |
//! | [`Context::attention`], [`Context::attention_backward`] ([`Attention`]) | the one-call API: kernels, tile ([`Context::default_tile`]) and dQ mode chosen for the device |
//! | [`Context::vector_add`], [`Context::attention_naive`], [`Context::flash_attention_forward`] | the forward operations |
//! | [`Context::attention_naive_backward`], [`Context::flash_attention_backward`] | the backward operations ([`Gradients`], [`DqAccumulation`]) |
//! | [`AttentionShape`], [`AttentionOptions`], [`Causal`], [`TileConfig`] | the problem, its options and mask, the tile sizes (and pipeline stages of the tensor-core kernels) |
//! | [`dtype`] | the element types and conversions (`f16`/`bf16` tensors run on the tensor cores) |
//! | [`cpu`] | rayon references in `f64`: the plain formula (forward and backward) and a tiled FlashAttention |
//! | [`check`], [`timing`] | error metrics and seeded inputs; CUDA-event timing |
//! | [`Context::has_hopper_kernels`], [`TensorMap`] | the Hopper (`sm_90a`) path: tensor maps for TMA and probes of `wgmma` and TMA |
//! | `tune` (feature `tune`) | tile-size sweeps (time, registers, shared memory, occupancy) and the tuned-tiles cache |
//! | `io` (feature `io`) | tensors in `.npy` and `.safetensors` files (`io::HostTensor`), to and from device tensors |
//! | [`Error`] | every failure, typed; no function here panics on bad input |
//! | `vit` (feature `vit`) | a Vision Transformer's first attention layer on a real photo, with these kernels; attention maps as pictures |
//! | `cli` (feature `cli`) | the `rust-attention` command line |
//!
//! **Features.** `io`, `tune`, `vit` and `cli` (which takes the other three) hold what only the
//! command line and the demos need, with their dependencies (clap, comfy-table, indicatif,
//! image, npyz, safetensors); `dynamic-loading` and `cuda-12080` choose how cudarc finds the
//! driver and for which CUDA API it is built. All are on by default; a library that depends on
//! this crate can turn them off (`default-features = false`) and choose cudarc's linking itself.

#![warn(missing_docs)]

// The modules in layers, each importing only from the layers above it here (checked by
// `tests/module_layers.rs`):
//
//   base      error, dtype, device, layout, problem      plain types; no device, no registry
//   registry  kernels, select                            the embedded kernels; which one runs
//   runtime   runtime (context, tensors, tensor maps,    a device and what lives on it
//             timing)
//   ops       ops (public API, naive, sm80, sm90,        the attention operations on a Context
//             probes)
//   top       io, cpu, check, tune, cli, vit             files, references, tools, apps

// Base.
mod device;
pub mod dtype;
mod error;
/// Argument structs, block sizes and shared-memory layouts shared with the device crate: its
/// module `layout` (`kernels/src/layout.rs`), re-exported.
pub use attn_kernels::layout;
mod problem;

// Registry.
pub mod kernels;
mod select;

// Runtime.
mod runtime;

// Ops.
mod ops;

// Top. (`io`, `tune`, `vit` and `cli` are features, on by default: the core needs none of them.)
pub mod check;
#[cfg(feature = "cli")]
pub mod cli;
pub mod cpu;
#[cfg(feature = "io")]
pub mod io;
#[cfg(feature = "tune")]
pub mod tune;
#[cfg(feature = "vit")]
pub mod vit;

pub use device::{Device, DeviceInfo, GpuProfile};
pub use dtype::{DType, Element, Scalar};
pub use error::{Error, Result};
/// The 16-bit float types of the `half` crate, re-exported: tensors of [`struct@f16`] or [`struct@bf16`] run on
/// the tensor-core kernels.
pub use half::{bf16, f16};
pub use kernels::FlashKernel;
pub use ops::{Attention, AttentionOutput, DecodeOptions, DecodePlan, DescriptorOffsets, Gradients, KvCache, Layout};
pub use problem::{
    Alibi, AttentionOptions, AttentionShape, Bias, Causal, DqAccumulation, MaskTableKind, MaskTableRef, ScoreMod,
    Sinks, SlidingWindow, TileConfig,
};
pub use runtime::{Context, DeviceTensor, MaskTable, TensorMap, timing};
pub use select::KernelPath;

//! Level 0: the hardware, as a handful of small functions, grouped by who executes them.
//!
//! | file | who runs it | what |
//! |---|---|---|
//! | [`thread`] | one thread | its indices in the block and the grid, fast `exp2`/`log2`, `fma`, atomics (`f32` adds, `u32` tickets), 16-byte loads and stores ([`F32x4`]) |
//! | [`warp`] | 32 threads that issue together | the warp barrier, shuffles, votes, reductions over groups of lanes |
//! | [`block`] | the threads of one multiprocessor's block | the block barrier, dynamic shared memory and `f32` tiles carved from it ([`SharedTile`]), cooperative copies, `cp.async` commit groups |
//! | [`mma`] | a warp, on the tensor cores | `mma.sync` m16n8k16 fragments ([`FragA`], [`FragB`], [`FragC`]), 16-bit tiles read with `ldmatrix` ([`SharedTile16`]), `movmatrix`, the formats [`F16`] and [`Bf16`] |
//! | `warpgroup` (sm_90a) | 4 warps | `wgmma` and its matrix descriptors, the accumulator (`Accumulator`), named barriers, `setmaxnreg` |
//! | `tma` (sm_90a) | one thread, for the block | TMA loads and reductions, `mbarrier`s, bulk groups, proxy fences |
//!
//! Every function here is the same on both targets, so a kernel is written once. The primitives
//! underneath live in `backend`: on nvptx64 the file `ptx.rs` (special registers, LLVM's NVPTX
//! intrinsics, `asm!`), on the host the CPU emulator ([`emu`]), which implements the same
//! functions with real threads, barriers and a checked shared memory. Warp-level operations call
//! LLVM's intrinsics rather than `asm!` where they can: LLVM knows them as *convergent* (every
//! lane must reach them together), so the optimiser never moves them into a branch only some
//! lanes take. The Hopper files are nvptx64-only: the emulator does not model asynchronous
//! copies or warpgroup matrix units.
//!
//! Kernels import this module as `hw` and call `hw::sync_threads()`, `hw::exp2(x)`,
//! `hw::mbarrier_wait(…)`: every item of the files above is re-exported here.

pub mod block;
#[cfg(not(target_arch = "nvptx64"))]
pub mod emu;
pub mod mma;
#[cfg(target_arch = "nvptx64")]
mod ptx;
pub mod thread;
#[cfg(target_arch = "nvptx64")]
pub mod tma;
pub mod warp;
#[cfg(target_arch = "nvptx64")]
pub mod warpgroup;

#[cfg(not(target_arch = "nvptx64"))]
use emu as backend;
#[cfg(target_arch = "nvptx64")]
use ptx as backend;

pub use block::*;
pub use mma::*;
pub use thread::*;
#[cfg(target_arch = "nvptx64")]
pub use tma::*;
pub use warp::*;
#[cfg(target_arch = "nvptx64")]
pub use warpgroup::*;

/// One 16-byte `cp.async` from global to shared memory (zero-filled when `valid` is false), for
/// kernels that place the chunks themselves (the Hopper probes' core-matrix layouts).
#[cfg(target_arch = "nvptx64")]
pub use ptx::cp_async_16;

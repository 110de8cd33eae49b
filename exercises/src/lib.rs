//! # Exercises: write the kernels of the guide yourself
//!
//! Each `exNN_*.rs` file here is a stub: it compiles, but the part you are to write does
//! nothing useful yet, so its test fails with a message that says what is wrong and where to
//! look. Fill it in and run its test on the CPU emulator (no GPU needed):
//!
//! ```sh
//! cargo test --release --manifest-path exercises/Cargo.toml ex01
//! ```
//!
//! | exercise | you write | guide chapter |
//! |---|---|---|
//! | [`ex01_vector_add`] | the vector add kernel: a grid-stride loop | Level 1 |
//! | [`ex02_softmax`] | the softmax of one row: max, sum of exp2, normalise | Level 2 |
//! | [`ex03_online_softmax`] | the online-softmax update: new max, rescale, add the tile | The online softmax, derived |
//! | [`ex04_causal_mask`] | the causal mask: `key_limit` and `visible`, both alignments | Level 3 |
//! | [`ex05_tile_loop`] | the key-tile loop of a small flash forward | Level 3 |
//!
//! The solutions are in `exercises/solutions/`; `--features solutions` builds them in place of
//! your files (CI runs the tests that way, so the tests stay honest). Read them after you pass.

// The stubs leave their arguments unused on purpose; the solutions must compile without these.
#![cfg_attr(not(feature = "solutions"), allow(unused_variables, unused_mut, unused_imports, unused_assignments))]
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

/// The device crate's `kernel!` macro (`kernels/src/lib.rs`, explained in the guide's level 0),
/// for every exercise's kernel: on the host, where the exercises run (on the emulator), it makes
/// the kernel a plain `unsafe fn` plus a constant `emu_<name>` through which
/// `attn_kernels::emu::launch` calls it. The kernel's body is written exactly as in the device
/// crate.
#[macro_use]
extern crate attn_kernels;

#[cfg_attr(feature = "solutions", path = "../solutions/ex01_vector_add.rs")]
pub mod ex01_vector_add;
#[cfg_attr(feature = "solutions", path = "../solutions/ex02_softmax.rs")]
pub mod ex02_softmax;
#[cfg_attr(feature = "solutions", path = "../solutions/ex03_online_softmax.rs")]
pub mod ex03_online_softmax;
#[cfg_attr(feature = "solutions", path = "../solutions/ex04_causal_mask.rs")]
pub mod ex04_causal_mask;
#[cfg_attr(feature = "solutions", path = "../solutions/ex05_tile_loop.rs")]
pub mod ex05_tile_loop;

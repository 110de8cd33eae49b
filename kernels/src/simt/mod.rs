//! Levels 1–4: kernels on the CUDA cores, in `f32`, runnable on every GPU and in the emulator.
//!
//! | level | file | kernel |
//! |---|---|---|
//! | 1 | [`vector_add`] | `vector_add_f32`: one thread per element |
//! | 2 | [`naive`] | naive attention: S and P through device memory |
//! | 3 | [`forward`] | FlashAttention-2 forward |
//! | 4 | [`backward`] | FlashAttention-2 backward |
//!
//! [`tile`] holds the tile math of levels 3 and 4: the 16 × 8 thread grid's products of
//! shared-memory tiles.

pub mod backward;
pub mod forward;
pub mod naive;
pub mod tile;
pub mod vector_add;

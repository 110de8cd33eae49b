//! What every attention kernel shares, whatever its tier: one home per concept, called by name
//! from the kernels of levels 3–9.
//!
//! | module | concept | used by |
//! |---|---|---|
//! | [`mask`] | which keys a query sees; the key/query tile ranges of a block; which tiles need the per-element mask | every flash kernel, the naive scores |
//! | [`schedule`] | which block works on what, in which order: query blocks, key blocks, balanced rows, longest first by L2 sections | every flash kernel |
//! | [`score`] | score modifications between Q·Kᵀ and the softmax (softcap, ALiBi) and their derivatives | every flash kernel, the naive scores |
//! | [`softmax`] | the online softmax's running maximum and sum, per thread layout; merging partial results by their LSE | the forward kernels, the decoder and its merge |
//! | [`fragment`] | the m16n8 fragment → (row, column) map, masking and rescaling fragments, packing P | the tensor-core kernels |
//! | [`epilogue`] | stores of O, LSE, dK, dV, dQ to device memory | every flash kernel |

pub mod epilogue;
pub mod fragment;
pub mod mask;
pub mod schedule;
pub mod score;
pub mod softmax;

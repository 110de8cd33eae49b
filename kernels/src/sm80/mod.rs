//! Levels 5, 6 and 10: FlashAttention-2 on the tensor cores with `mma.sync` (compute capability 8.0
//! and later), in `f16` and `bf16`, runnable in the emulator too. The same source is also compiled
//! for Turing (7.5, `f16` only), where `crate::hw` gives `mma`, `cp.async` and the `f16`
//! conversion the forms that architecture has (guide level 5, "On a Turing GPU").
//!
//! | level | file | kernels |
//! |---|---|---|
//! | 5 | [`forward`] | `flash_fwd_{f16,bf16}_m*_n*_d*_s*` |
//! | — | [`pipeline`] | the `cp.async` ring of K/V tiles both Q-outer kernels stream through |
//! | 6 | [`backward`] | `flash_bwd_*`, `flash_bwd_dkdv_*`, `flash_bwd_dq_*`, and the preprocess and dQ conversion kernels |
//! | 10 | [`decode`] | `decode_fwd_{f16,bf16}_d*_s*` (split-KV decoding from a KV cache), `decode_merge_*`, `decode_append_kv` |

pub mod backward;
pub mod decode;
pub mod forward;
pub mod pipeline;

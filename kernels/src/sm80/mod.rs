//! Levels 5 and 6: FlashAttention-2 on the tensor cores with `mma.sync` (compute capability 8.0
//! and later), in `f16` and `bf16`, runnable in the emulator too.
//!
//! | level | file | kernels |
//! |---|---|---|
//! | 5 | [`forward`] | `flash_fwd_{f16,bf16}_m*_n*_d*_s*` |
//! | — | [`pipeline`] | the `cp.async` ring of K/V tiles both Q-outer kernels stream through |
//! | 6 | [`backward`] | `flash_bwd_*`, `flash_bwd_dkdv_*`, `flash_bwd_dq_*`, and the preprocess and dQ conversion kernels |

pub mod backward;
pub mod forward;
pub mod pipeline;

//! Levels 7–9 (sm_90a, nvptx64 only): FlashAttention on Hopper's asynchronous units.
//!
//! | level | file | what |
//! |---|---|---|
//! | 7 | [`probes`] | one probe kernel per building block (`wgmma`, TMA, `mbarrier`) |
//! | — | [`pipeline`] | what levels 8 and 9 share: the aligned shared memory, the ring of slots with full/empty barriers, TMA boxes of swizzled tiles, the producer/consumer roles |
//! | 8 | [`forward`] | the forward pass in FlashAttention-3's shape |
//! | 9 | [`backward`] | the backward pass on the same machinery |

pub mod backward;
pub mod forward;
pub mod pipeline;
pub mod probes;

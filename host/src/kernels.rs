//! The registry of kernels in the embedded PTX.
//!
//! `build.rs` compiles `kernels/` and generates, from the `.entry` names it finds in the PTX, one
//! constant per kernel (in [`entry`]) and the table of FlashAttention instances
//! ([`FLASH_INSTANCES`]). Host code names kernels only through these, so a kernel that is
//! renamed or removed on the device side breaks the host build, not a launch at run time.

use crate::layout;

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The FlashAttention kernel families; each is compiled once per tile shape and head_dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashKernel {
    /// `flash_fwd_f32_*`: the forward pass (O and LSE).
    Forward,
    /// `flash_bwd_f32_*`: dK and dV, and dQ by atomic adds.
    Backward,
    /// `flash_bwd_dkdv_f32_*`: dK and dV only (the deterministic backward's first kernel).
    BackwardDkDv,
    /// `flash_bwd_dq_f32_*`: dQ without atomics (the deterministic backward's second kernel).
    BackwardDq,
}

impl std::fmt::Display for FlashKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Forward => "forward",
            Self::Backward => "backward (dK, dV, atomic dQ)",
            Self::BackwardDkDv => "backward dK/dV",
            Self::BackwardDq => "backward dQ",
        })
    }
}

impl FlashKernel {
    /// Dynamic shared memory per block, in bytes, for this tile.
    pub fn shared_memory_bytes(self, block_m: usize, block_n: usize, head_dim: usize) -> usize {
        match self {
            Self::Forward => layout::flash_forward_smem_bytes(block_m, block_n, head_dim),
            Self::Backward | Self::BackwardDkDv => layout::flash_backward_kv_smem_bytes(block_m, block_n, head_dim),
            Self::BackwardDq => layout::flash_backward_q_smem_bytes(block_m, block_n, head_dim),
        }
    }
}

/// One compiled instance of a FlashAttention kernel: its family, tile shape and entry name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashInstance {
    /// Which kernel.
    pub kernel: FlashKernel,
    /// Query rows per query tile (the paper's Br).
    pub block_m: usize,
    /// Key/value rows per key tile (the paper's Bc).
    pub block_n: usize,
    /// Head dimension the instance is specialised for.
    pub head_dim: usize,
    /// `.entry` name in the PTX, e.g. `flash_fwd_f32_m64_n64_d64`.
    pub entry: &'static str,
}

/// The compiled instance of `kernel` for this tile and head dimension, if there is one.
pub fn flash_instance(
    kernel: FlashKernel,
    block_m: usize,
    block_n: usize,
    head_dim: usize,
) -> Option<&'static FlashInstance> {
    FLASH_INSTANCES
        .iter()
        .find(|i| i.kernel == kernel && i.block_m == block_m && i.block_n == block_n && i.head_dim == head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_in_the_ptx() {
        for name in entry::ALL.iter().copied().chain(FLASH_INSTANCES.iter().map(|i| i.entry)) {
            assert!(PTX_SM_80.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
        }
    }

    #[test]
    fn flash_instances_cover_the_documented_grid() {
        let families = [
            (FlashKernel::Forward, "flash_fwd_f32"),
            (FlashKernel::Backward, "flash_bwd_f32"),
            (FlashKernel::BackwardDkDv, "flash_bwd_dkdv_f32"),
            (FlashKernel::BackwardDq, "flash_bwd_dq_f32"),
        ];
        for (kernel, prefix) in families {
            for block_m in [16, 32, 64] {
                for block_n in [16, 32, 64] {
                    for head_dim in [32, 64, 128] {
                        let instance = flash_instance(kernel, block_m, block_n, head_dim).expect("instance compiled");
                        assert_eq!(instance.entry, format!("{prefix}_m{block_m}_n{block_n}_d{head_dim}"));
                    }
                }
            }
        }
        assert_eq!(FLASH_INSTANCES.len(), 4 * 27);
    }
}

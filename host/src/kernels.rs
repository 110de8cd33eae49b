//! The registry of kernels in the embedded PTX.
//!
//! `build.rs` compiles `kernels/` and generates, from the `.entry` names it finds in the PTX, one
//! constant per kernel (in [`entry`]) and the table of FlashAttention instances
//! ([`FLASH_FORWARD_F32`]). Host code names kernels only through these, so a kernel that is
//! renamed or removed on the device side breaks the host build, not a launch at run time.

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// One compiled instance of the FlashAttention forward kernel: its tile shape and entry name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashInstance {
    /// Query rows per block (the paper's Br).
    pub block_m: usize,
    /// Key/value rows per tile (the paper's Bc).
    pub block_n: usize,
    /// Head dimension the instance is specialised for.
    pub head_dim: usize,
    /// `.entry` name in the PTX, e.g. `flash_fwd_f32_m64_n64_d64`.
    pub entry: &'static str,
}

/// The compiled instance for this tile and head dimension, if there is one.
pub fn flash_forward_instance(block_m: usize, block_n: usize, head_dim: usize) -> Option<&'static FlashInstance> {
    FLASH_FORWARD_F32.iter().find(|i| i.block_m == block_m && i.block_n == block_n && i.head_dim == head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_in_the_ptx() {
        for name in entry::ALL.iter().copied().chain(FLASH_FORWARD_F32.iter().map(|i| i.entry)) {
            assert!(PTX_SM_80.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
        }
    }

    #[test]
    fn flash_instances_cover_the_documented_grid() {
        for block_m in [16, 32, 64] {
            for block_n in [16, 32, 64] {
                for head_dim in [32, 64, 128] {
                    let instance = flash_forward_instance(block_m, block_n, head_dim).expect("instance compiled");
                    assert_eq!(instance.entry, format!("flash_fwd_f32_m{block_m}_n{block_n}_d{head_dim}"));
                }
            }
        }
    }
}

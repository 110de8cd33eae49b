//! Level 0, what a warp does (32 threads that issue together): the warp barrier, shuffles, votes
//! and reductions over groups of lanes.

use super::{WARP_SIZE, backend};

/// Waits until every lane of this warp has reached this point, and orders their shared-memory
/// accesses (`bar.warp.sync`). Enough when the threads that write and read a piece of shared
/// memory are all in one warp; cheaper than [`super::sync_threads`].
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn sync_warp() {
    backend::sync_warp()
}

/// The value of `x` held by lane `lane_id() ^ lane_mask` (`shfl.sync.bfly`): the butterfly
/// exchange that tree reductions are built from. All 32 lanes must call it together.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn shfl_xor(x: f32, lane_mask: u32) -> f32 {
    backend::shfl_xor(x, lane_mask)
}

/// Whether `predicate` holds in any lane of the warp (`vote.sync.any`); every lane receives the
/// same answer, so a branch on it is uniform across the warp. All 32 lanes must call it together.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn warp_any(predicate: bool) -> bool {
    backend::warp_any(predicate)
}

// ANCHOR: group_reductions
/// Maximum of `x` over each aligned group of `LANES` consecutive lanes (LANES = 1, 2, 4, …, 32);
/// every lane of a group receives its group's result. All 32 lanes must call it together.
#[inline(always)]
pub fn group_max<const LANES: usize>(x: f32) -> f32 {
    const { assert!(LANES.is_power_of_two() && LANES <= WARP_SIZE) };
    let mut x = x;
    let mut offset = LANES / 2;
    while offset > 0 {
        x = x.max(shfl_xor(x, offset as u32));
        offset /= 2;
    }
    x
}

/// Sum of `x` over each aligned group of `LANES` consecutive lanes; see [`group_max`].
#[inline(always)]
pub fn group_sum<const LANES: usize>(x: f32) -> f32 {
    const { assert!(LANES.is_power_of_two() && LANES <= WARP_SIZE) };
    let mut x = x;
    let mut offset = LANES / 2;
    while offset > 0 {
        x += shfl_xor(x, offset as u32);
        offset /= 2;
    }
    x
}
// ANCHOR_END: group_reductions

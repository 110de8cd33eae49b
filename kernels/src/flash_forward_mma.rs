//! Level 5: FlashAttention-2 forward on tensor cores (Dao 2023, Algorithm 1), `f16` and `bf16`.
//!
//! The algorithm of [`crate::flash_forward`], with the two matrix products on the tensor cores
//! (`mma.sync.aligned.m16n8k16`, `f32` accumulation; see the fragment table in [`crate::gpu`])
//! and the K/V tiles streamed into shared memory by asynchronous copies (`cp.async`, issued by
//! the threads, completed in the background) while the previous tile is
//! being used. Inputs and O are 16-bit floats, everything computed stays `f32`: scores, the
//! online softmax's max and sum, the O accumulator, the logsumexp.
//!
//! ## Warps and fragments
//!
//! A block has 4 warps. Warp `w` owns `BLOCK_M / 4` consecutive query rows of the tile for the
//! whole pass, as `WARP_TILES = BLOCK_M / 64` m-tiles of 16 rows (the M of one `mma`), so the
//! block's warps never exchange data: each computes its own rows of S = Q·Kᵀ, their softmax and
//! their rows of O. With two m-tiles (`BLOCK_M` = 128), every K and V fragment a warp reads from
//! shared memory feeds two `mma` instead of one, and the warp has two independent softmax chains
//! to interleave: FlashAttention-2's layout, and the step that took the D=128 forward from 264
//! to 311 TFLOP/s (`PERFORMANCE.md`). Within a warp, lane `l` holds rows `g = l / 4` and `g + 8`
//! of each m-tile (see the table in [`crate::gpu`]), so a row's max and sum are reduced over the
//! 4 lanes `4g .. 4g + 4` with two shuffles.
//!
//! * `q_frag[r][ks]`: m-tile `r`'s Q rows as A fragments, one per 16 columns of head_dim. With
//!   one m-tile they are loaded once and kept in registers for the whole pass; with two, the
//!   registers go to the second m-tile's scores and accumulator and Q is re-read from shared
//!   memory at each use;
//! * `s[r][nt]`: scores, then probabilities, of m-tile `r` and keys `8nt .. 8nt + 8` of the
//!   current tile (accumulator fragments);
//! * `acc[r][dt]`: unnormalised O of m-tile `r`, columns `8dt .. 8dt + 8`.
//!
//! P never leaves registers: the accumulator fragments of keys `16kk .. 16kk + 16`, rounded to
//! 16 bits, *are* the A fragment of P for that k-step of P·V (FlashAttention-2, section 3.3).
//!
//! ## Shared memory (16-bit, rows padded by 8 elements; `layout::mma_forward_smem_bytes`)
//!
//! | tile | shape | written by | read by |
//! |---|---|---|---|
//! | K, V ×`STAGES` | BLOCK_N × HEAD_DIM each | `cp.async`, whole block | every warp (`ldmatrix`, `.trans` for V) |
//! | Q | BLOCK_M × HEAD_DIM, in the ring's last slot when it fits | `cp.async`, whole block, once | each warp its 16 rows (`ldmatrix`), before the loop; then reused to stage O |
//!
//! ## The pipeline
//!
//! K/V tiles go round a ring of `STAGES` slots. Each thread's copies of one tile form one
//! `cp.async` group; at the top of iteration `j` a thread waits until its copies of tile `j` have
//! landed, and a block barrier makes everyone's copies visible — and guarantees that every warp
//! has finished iteration `j − 1`, so that its slot can be refilled with tile `j + STAGES − 1`
//! right away. The copies thus fetch up to `STAGES − 1` tiles ahead while the warps
//! compute, with one barrier per tile.

use crate::gpu::{self, FragA, FragC, HalfFloat, LN_2, SharedMemory};
use crate::layout::{
    AttentionShape, MMA_FORWARD_WARPS, MMA_SMEM_PAD, MMA_WARP_ROWS, mma_forward_threads, q_shares_ring,
};
use crate::tiles::{Mask, QueryBlock};

/// Online-softmax state of the two rows a lane holds (rows `g` and `g + 8` of its warp).
pub(crate) struct RowSoftmax {
    /// Largest score seen so far (base-2 units), the same in the 4 lanes of a row.
    max: [f32; 2],
    /// This lane's share of Σ 2^(s − max) (its 2 columns of every 8).
    partial_sum: [f32; 2],
}

impl RowSoftmax {
    #[inline(always)]
    pub(crate) fn new() -> Self {
        Self { max: [f32::NEG_INFINITY; 2], partial_sum: [0.0; 2] }
    }

    /// Replaces the raw scores `s` of one tile by their unnormalised probabilities
    /// 2^(s·c − m_new), with `c` = scale·log₂e > 0, and returns, per row, the factor
    /// `alpha = 2^(m_old − m_new)` that rescales what was accumulated before. Fragment entries
    /// `0, 1` are row `g`, entries `2, 3` row `g + 8`. All lanes of the warp call it together (it
    /// shuffles).
    ///
    /// Because `c > 0`, the largest scaled score is `c` times the largest raw one, so the scale
    /// is applied once per row to the maximum and folded into one fused multiply-add per element
    /// (`s·c − m`), instead of a multiplication per element before the maximum.
    #[inline(always)]
    pub(crate) fn update<const N_TILES: usize>(&mut self, s: &mut [FragC; N_TILES], c: f32) -> [f32; 2] {
        let mut alpha = [0.0; 2];
        for r in 0..2 {
            // Four running maxima and sums instead of one: a single running value would chain
            // 2 · N_TILES dependent instructions, each waiting for the latency of the one before.
            let mut maxima = [f32::NEG_INFINITY; 4];
            for (i, frag) in s.iter().enumerate() {
                maxima[i % 4] = maxima[i % 4].max(frag[2 * r].max(frag[2 * r + 1]));
            }
            let tile_max = maxima[0].max(maxima[1]).max(maxima[2].max(maxima[3]));
            let new_max = self.max[r].max(gpu::group_max::<4>(tile_max) * c);
            // A row that has seen only masked (−∞) scores measures from 0 instead, which keeps
            // 2^(−∞ − (−∞)) = NaN out: its probabilities and alpha are all 0.
            let base = if new_max == f32::NEG_INFINITY { 0.0 } else { new_max };
            alpha[r] = gpu::exp2(self.max[r] - base);
            let mut sums = [0.0; 4];
            for (i, frag) in s.iter_mut().enumerate() {
                for x in &mut frag[2 * r..2 * r + 2] {
                    *x = gpu::exp2(gpu::fma(*x, c, -base));
                    sums[i % 4] += *x;
                }
            }
            let tile_sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
            self.partial_sum[r] = self.partial_sum[r] * alpha[r] + tile_sum;
            self.max[r] = new_max;
        }
        alpha
    }

    /// Per row: 1/l, to normalise O, and LSE = (m + log₂ l)·ln 2 (natural log). A row that saw no
    /// key gets 1/l = 0 (O = 0) and LSE = −∞. All lanes of the warp call it together.
    #[inline(always)]
    pub(crate) fn finish(&self) -> ([f32; 2], [f32; 2]) {
        let (mut inv_sum, mut lse) = ([0.0; 2], [f32::NEG_INFINITY; 2]);
        for r in 0..2 {
            let sum = gpu::group_sum::<4>(self.partial_sum[r]);
            if sum > 0.0 {
                inv_sum[r] = 1.0 / sum;
                lse[r] = (self.max[r] + gpu::log2(sum)) * LN_2;
            }
        }
        (inv_sum, lse)
    }
}

/// The A fragment of P for keys `16kk .. 16kk + 16`: the probabilities of n-tiles `2kk` and
/// `2kk + 1`, rounded to 16 bits and packed in the A layout (a0 = row g of the first n-tile,
/// a1 = row g + 8 of it, a2 and a3 the same of the second).
#[inline(always)]
pub(crate) fn pack_a<T: HalfFloat>(first: FragC, second: FragC) -> FragA {
    [
        T::pack(first[0], first[1]),
        T::pack(first[2], first[3]),
        T::pack(second[0], second[1]),
        T::pack(second[2], second[3]),
    ]
}

/// The kernel body shared by every instance. `WARP_TILES`, `D_STEPS`, `N_TILES` and `D_TILES`
/// size the register arrays (`BLOCK_M / 64`, `HEAD_DIM / 16`, `BLOCK_N / 8`, `HEAD_DIM / 8`; see
/// the module docs); the instance macro derives them, because array lengths must be plain const
/// parameters.
///
/// Grid: `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`; block: 4 warps; dynamic
/// shared memory: `layout::mma_forward_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)` bytes.
///
/// # Safety
/// Pointers hold tensors of the shapes in `shape` (16-bit elements of format `T`; LSE `f32`),
/// 16-byte aligned, with `shape.head_dim == HEAD_DIM`; `o` and `lse` do not overlap the inputs;
/// the launch has the grid, block and shared memory above.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn flash_forward_mma<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const WARP_TILES: usize,
    const D_STEPS: usize,
    const N_TILES: usize,
    const D_TILES: usize,
>(
    q: *const u16,
    k: *const u16,
    v: *const u16,
    o: *mut u16,
    lse: *mut f32,
    shape: AttentionShape,
    mask: Mask,
    scale_log2: f32,
) {
    const {
        assert!(BLOCK_M == MMA_FORWARD_WARPS * MMA_WARP_ROWS * WARP_TILES && BLOCK_N.is_multiple_of(16));
        assert!(D_STEPS * 16 == HEAD_DIM && N_TILES * 8 == BLOCK_N && D_TILES * 8 == HEAD_DIM);
        assert!(STAGES >= 2);
    };
    let threads = mma_forward_threads(BLOCK_M);
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    // SAFETY: the host sized the grid, so these heads exist (offsets are in elements).
    let (q_head, k_head, v_head, o_head, lse_head) = unsafe {
        let (q_offset, kv_offset) = (block.q_offset, block.kv_offset);
        (q.add(q_offset), k.add(kv_offset), v.add(kv_offset), o.add(q_offset), lse.add(q_offset / HEAD_DIM))
    };
    let lane = gpu::lane_id();
    let (g, t) = (lane / 4, lane % 4);
    // The warp's first row in the tile; its m-tile `r` is rows `warp_row + 16r ..`.
    let warp_row = gpu::warp_id() * MMA_WARP_ROWS * WARP_TILES;
    // With one m-tile per warp, Q's fragments stay in registers for the whole pass; with two,
    // the registers go to the second m-tile's scores and accumulator, and Q is re-read from
    // shared memory at every use.
    let q_in_registers = WARP_TILES == 1;

    let stride = HEAD_DIM + MMA_SMEM_PAD;
    let mut smem = SharedMemory::new();
    // The ring: slot `i` holds a K tile at rows `2i·BLOCK_N` and a V tile at `(2i + 1)·BLOCK_N`.
    // (Computed from the slot number rather than kept in an array: an array of tiles indexed by
    // a loop variable would live in local memory.)
    let kv_ring = smem.tile16(2 * STAGES * BLOCK_N, stride);
    // When Q is read once, into registers, before the loop, it can borrow the ring's last slot:
    // that slot is first filled in the loop's first iteration, after a barrier that every warp
    // reaches only once it has its Q fragments (see `layout::q_shares_ring`). Less shared memory
    // per block, more blocks per SM.
    let q_tile = if q_shares_ring(BLOCK_M, BLOCK_N) {
        kv_ring.rows_from(2 * (STAGES - 1) * BLOCK_N)
    } else {
        smem.tile16(BLOCK_M, stride)
    };
    let kv_slot = |tile: usize| {
        let slot = tile % STAGES;
        (kv_ring.rows_from(2 * slot * BLOCK_N), kv_ring.rows_from((2 * slot + 1) * BLOCK_N))
    };

    // The last row of the block sees the most keys, the first row the fewest: keys past
    // `kv_end` are hidden from every row (never loaded), keys before `all_see` from none.
    let kv_end = mask.key_limit(q_start + q_rows - 1);
    let all_see = mask.key_limit(q_start);
    let kv_tiles = kv_end.div_ceil(BLOCK_N);
    // Starts the copies of K/V tile `tile` into its slot, as one cp.async group (empty past the
    // last tile, so that every iteration commits exactly one group).
    let fetch_kv = |tile: usize| {
        if tile < kv_tiles {
            let kv_start = tile * BLOCK_N;
            let valid = BLOCK_N.min(shape.seqlen_k - kv_start);
            let (k_tile, v_tile) = kv_slot(tile);
            // SAFETY: rows kv_start .. kv_start + valid of this head exist.
            unsafe {
                k_tile.copy_rows_async(k_head.add(kv_start * HEAD_DIM), BLOCK_N, HEAD_DIM, valid, threads);
                v_tile.copy_rows_async(v_head.add(kv_start * HEAD_DIM), BLOCK_N, HEAD_DIM, valid, threads);
            }
        }
        gpu::cp_async_commit();
    };

    // Prologue: Q travels in the first group, with K/V tile 0; tiles 1 .. STAGES − 1 follow.
    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe { q_tile.copy_rows_async(q_head.add(q_start * HEAD_DIM), BLOCK_M, HEAD_DIM, q_rows, threads) };
    for tile in 0..STAGES - 1 {
        fetch_kv(tile);
    }
    gpu::cp_async_wait(STAGES - 2);
    gpu::sync_threads();
    // The softmax wants a positive factor c = scale·log₂e (see `RowSoftmax::update`): a negative
    // scale is applied as −Q with |c| (flipping the sign bits of the 16-bit Q values), and a
    // zero scale as the smallest normal float, which gives every finite score the same weight,
    // 2^(s·c) = 1 in f32, as a zero scale does.
    let sign = if scale_log2 < 0.0 { 0x8000_8000 } else { 0 };
    let c = scale_log2.abs().max(f32::MIN_POSITIVE);
    let q_fragment = |r: usize, ks: usize| q_tile.fragment_a(warp_row + 16 * r, 16 * ks).map(|x| x ^ sign);
    let mut q_frag = [[[0u32; 4]; D_STEPS]; WARP_TILES];
    if q_in_registers {
        q_frag = core::array::from_fn(|r| core::array::from_fn(|ks| q_fragment(r, ks)));
    }

    let mut softmax: [RowSoftmax; WARP_TILES] = core::array::from_fn(|_| RowSoftmax::new());
    let mut acc = [[[0.0f32; 4]; D_TILES]; WARP_TILES];
    for tile in 0..kv_tiles {
        // Tile `tile` has landed for everyone, and everyone is done with tile − 1's slot.
        gpu::cp_async_wait(STAGES - 2);
        gpu::sync_threads();
        fetch_kv(tile + STAGES - 1);
        let (k_tile, v_tile) = kv_slot(tile);
        let kv_start = tile * BLOCK_N;

        // S = Q·Kᵀ for the warp's rows and the tile's BLOCK_N keys; each K fragment read from
        // shared memory serves every m-tile of the warp.
        let mut s = [[[0.0f32; 4]; N_TILES]; WARP_TILES];
        for ks in 0..D_STEPS {
            let q_ks: [FragA; WARP_TILES] =
                core::array::from_fn(|r| if q_in_registers { q_frag[r][ks] } else { q_fragment(r, ks) });
            for np in 0..N_TILES / 2 {
                let [b0, b1] = k_tile.fragments_b(16 * np, 16 * ks);
                for r in 0..WARP_TILES {
                    s[r][2 * np] = T::mma(q_ks[r], b0, s[r][2 * np]);
                    s[r][2 * np + 1] = T::mma(q_ks[r], b1, s[r][2 * np + 1]);
                }
            }
        }
        // Only tiles that cross some row's key limit (the causal diagonal, the ragged end of the
        // keys) pay for the per-element mask.
        if kv_start + BLOCK_N > all_see {
            for r in 0..WARP_TILES {
                for nt in 0..N_TILES {
                    for e in 0..4 {
                        let row = q_start + warp_row + 16 * r + g + 8 * (e / 2);
                        if !mask.visible(row, kv_start + 8 * nt + 2 * t + e % 2) {
                            s[r][nt][e] = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        let alpha: [[f32; 2]; WARP_TILES] = core::array::from_fn(|r| softmax[r].update(&mut s[r], c));
        // Once the running maxima settle, most tiles leave them unchanged (alpha = 1 exactly):
        // the warp then skips rescaling its O accumulator, HEAD_DIM / 2 multiplications per lane
        // and m-tile per tile. The vote makes the branch uniform across the warp.
        if gpu::warp_any(alpha.iter().any(|a| a[0] != 1.0 || a[1] != 1.0)) {
            for r in 0..WARP_TILES {
                for frag in acc[r].iter_mut() {
                    for e in 0..4 {
                        frag[e] *= alpha[r][e / 2];
                    }
                }
            }
        }

        // O += P·V, P straight from registers; each V fragment serves every m-tile.
        for kk in 0..N_TILES / 2 {
            let p: [FragA; WARP_TILES] = core::array::from_fn(|r| pack_a::<T>(s[r][2 * kk], s[r][2 * kk + 1]));
            for dp in 0..D_TILES / 2 {
                let [b0, b1] = v_tile.fragments_b_transposed(16 * kk, 16 * dp);
                for r in 0..WARP_TILES {
                    acc[r][2 * dp] = T::mma(p[r], b0, acc[r][2 * dp]);
                    acc[r][2 * dp + 1] = T::mma(p[r], b1, acc[r][2 * dp + 1]);
                }
            }
        }
    }

    // Normalise, round to 16 bits and stage O in the warp's own rows of the Q tile, so that the
    // writes to global memory are whole 16-byte chunks. Those rows may belong to a ring slot that
    // other warps are still reading in their last iteration: wait for them first.
    let finished: [([f32; 2], [f32; 2]); WARP_TILES] = core::array::from_fn(|r| softmax[r].finish());
    gpu::sync_threads();
    for r in 0..WARP_TILES {
        let (inv_sum, _) = finished[r];
        for (dt, frag) in acc[r].iter().enumerate() {
            for h in 0..2 {
                let value = T::pack(frag[2 * h] * inv_sum[h], frag[2 * h + 1] * inv_sum[h]);
                q_tile.store2(warp_row + 16 * r + g + 8 * h, 8 * dt + 2 * t, value);
            }
        }
    }
    gpu::sync_warp();
    let chunks = HEAD_DIM / 8;
    let mut chunk = lane;
    while chunk < MMA_WARP_ROWS * WARP_TILES * chunks {
        let (row, col) = (warp_row + chunk / chunks, (chunk % chunks) * 8);
        if row < q_rows {
            // SAFETY: row < q_rows, col + 8 ≤ HEAD_DIM.
            unsafe { gpu::store16(o_head.add((q_start + row) * HEAD_DIM + col), q_tile.load8(row, col)) };
        }
        chunk += gpu::WARP_SIZE;
    }
    if t == 0 {
        for r in 0..WARP_TILES {
            for h in 0..2 {
                let row = warp_row + 16 * r + g + 8 * h;
                if row < q_rows {
                    // SAFETY: row < q_rows.
                    unsafe { *lse_head.add(q_start + row) = finished[r].1[h] };
                }
            }
        }
    }
}

/// One entry per tile and format, named `flash_fwd_{f16,bf16}_m{block_m}_n{block_n}_d{head_dim}_s{stages}`.
macro_rules! flash_forward_mma_instance {
    ($dtype:ident, $format:ident, $block_m:literal, $block_n:literal, $head_dim:literal, $stages:literal) => {
        kernel! {
        /// FlashAttention-2 forward on tensor cores; see the module docs and `flash_forward_mma`.
        ///
        /// # Safety
        /// As `flash_forward_mma`.
        pub unsafe fn ${concat(flash_fwd_, $dtype, _m, $block_m, _n, $block_n, _d, $head_dim, _s, $stages)}(
            q: *const u16,
            k: *const u16,
            v: *const u16,
            o: *mut u16,
            lse: *mut f32,
            batch: usize,
            num_heads_q: usize,
            num_heads_kv: usize,
            seqlen_q: usize,
            seqlen_k: usize,
            head_dim: usize,
            causal: usize,
            causal_offset: isize,
            scale_log2: f32,
        ) {
            let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
            let mask = Mask { seqlen_q, seqlen_k, causal: causal != 0, offset: causal_offset };
            unsafe {
                flash_forward_mma::<
                    gpu::$format,
                    $block_m,
                    $block_n,
                    $head_dim,
                    $stages,
                    { $block_m / 64 },
                    { $head_dim / 16 },
                    { $block_n / 8 },
                    { $head_dim / 8 },
                >(q, k, v, o, lse, shape, mask, scale_log2)
            }
        }
        }
    };
}

// The compiled forward tiles, `(block_m, block_n, head_dim, stages)`, each in `f16` and `bf16`.
// Tiles that ptxas cannot fit in 255 registers without spilling are left out, fast or not:
// (128, 128) at head_dim 64 and (128, 64) at 128 measured 2–5 % faster than the tiles below but
// spill 72–152 bytes (`PERFORMANCE.md`).
for_each_half_format!(
    flash_forward_mma_instance,
    [
        (64, 32, 64, 2),
        (64, 64, 64, 2),
        (64, 64, 64, 3),
        (128, 64, 64, 2),
        (64, 32, 128, 2),
        (64, 32, 128, 3),
        (64, 64, 128, 2),
        (128, 32, 128, 2),
    ]
);

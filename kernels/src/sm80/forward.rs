//! Level 5: FlashAttention-2 forward on tensor cores (Dao 2023, Algorithm 1), `f16` and `bf16`.
//!
//! The algorithm of [`crate::simt::forward`], with the two matrix products on the tensor cores
//! (`mma.sync.aligned.m16n8k16`, `f32` accumulation; see the fragment table in [`crate::hw::mma`] and the map in [`crate::attention::fragment`])
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
//! to interleave: FlashAttention-2's layout (PERFORMANCE.md has what it gained). Within a warp, lane `l` holds rows `g = l / 4` and `g + 8`
//! of each m-tile (see [`crate::attention::fragment`]), so a row's max and sum are reduced over the
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
//! K/V tiles go round a ring of `STAGES` slots ([`crate::sm80::pipeline::KvRing`], shared with the
//! level-6 dQ kernel): the copies fetch up to `STAGES − 1` tiles ahead while the warps compute,
//! with one barrier per tile.

use crate::attention::epilogue::{store_fragment_lse, store_warp_rows};
use crate::attention::fragment::{FragmentLane, mask_fragments, pack_a, scale_rows};
use crate::attention::mask::Mask;
use crate::attention::schedule::QueryBlock;
use crate::attention::score::ScoreArgs;
use crate::attention::softmax::{RowSoftmax, positive_factor, q_sign_mask};
use crate::hw::{self, FragA, HalfFloat, SharedMemory};
use crate::layout::{
    AttentionShape, MMA_FORWARD_WARPS, MMA_SMEM_PAD, MMA_WARP_ROWS, mma_forward_threads, q_in_registers, q_shares_ring,
    row_length,
};
use crate::sm80::pipeline::KvRing;

/// The kernel body shared by every instance. `WARP_TILES`, `D_STEPS`, `N_TILES` and `D_TILES`
/// size the register arrays (`BLOCK_M / 64`, `HEAD_DIM / 16`, `BLOCK_N / 8`, `HEAD_DIM / 8`; see
/// the module docs); the instance macro derives them, because array lengths must be plain const
/// parameters. `TABLE` is true in the `_table` twin (`attention_kernel!`), whose `mask` may hold
/// a band table; in the plain entry it holds none.
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
    const PADDED: bool,
    const WARP_TILES: usize,
    const D_STEPS: usize,
    const N_TILES: usize,
    const D_TILES: usize,
    const TABLE: bool,
>(
    q: *const u16,
    k: *const u16,
    v: *const u16,
    o: *mut u16,
    lse: *mut f32,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
) {
    // Copies of the body: modified scores (and anything else); sinks or a band table without
    // modified scores; and, in the entry without a table, one that runs exactly the code of the
    // plain path, with none of them (`attention::score` says why).
    macro_rules! body {
        ($mods:literal, $extras:literal) => {
            forward_body::<
                T,
                BLOCK_M,
                BLOCK_N,
                HEAD_DIM,
                STAGES,
                PADDED,
                WARP_TILES,
                D_STEPS,
                N_TILES,
                D_TILES,
                $mods,
                $extras,
            >(q, k, v, o, lse, shape, mask, score, scale_log2)
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match (score.is_active(), TABLE || score.has_sinks()) {
            (true, _) => body!(true, true),
            (false, true) => body!(false, true),
            (false, false) => body!(false, false),
        }
    }
}

/// [`flash_forward_mma`]'s body, with (`MODS`) or without a score modification, with
/// (`EXTRAS`: this copy tests for each at run time) or without attention sinks and a band table.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn forward_body<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const PADDED: bool,
    const WARP_TILES: usize,
    const D_STEPS: usize,
    const N_TILES: usize,
    const D_TILES: usize,
    const MODS: bool,
    const EXTRAS: bool,
>(
    q: *const u16,
    k: *const u16,
    v: *const u16,
    o: *mut u16,
    lse: *mut f32,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
) {
    const {
        assert!(BLOCK_M == MMA_FORWARD_WARPS * MMA_WARP_ROWS * WARP_TILES && BLOCK_N.is_multiple_of(16));
        assert!(D_STEPS * 16 == HEAD_DIM && N_TILES * 8 == BLOCK_N && D_TILES * 8 == HEAD_DIM);
        assert!(STAGES >= 2);
    };
    let threads = mma_forward_threads(BLOCK_M);
    let d = row_length::<HEAD_DIM, PADDED>(&shape);
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let mask = mask.for_batch(block.batch);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    // SAFETY: the host sized the grid, so these heads exist (offsets are in elements).
    let (q_head, k_head, v_head, o_head, lse_head) = unsafe {
        let (q_offset, kv_offset) = (block.q_offset, block.kv_offset);
        (q.add(q_offset), k.add(kv_offset), v.add(kv_offset), o.add(q_offset), lse.add(q_offset / d))
    };
    let lane = FragmentLane::current();
    // The warp's first row in the tile; its m-tile `r` is rows `warp_row + 16r ..`.
    let warp_row = hw::warp_id() * MMA_WARP_ROWS * WARP_TILES;
    // Q's fragments stay in registers for the whole pass where they fit, else Q is re-read from
    // shared memory at every use (see `layout::q_in_registers`).
    let q_in_registers = q_in_registers(BLOCK_M, HEAD_DIM);

    let stride = HEAD_DIM + MMA_SMEM_PAD;
    let mut smem = SharedMemory::new();
    // The K/V ring's rows ([`KvRing`]).
    let kv_ring = smem.tile16(2 * STAGES * BLOCK_N, stride);
    // When Q is read once, into registers, before the loop, it can borrow the ring's last slot:
    // that slot is first filled in the loop's first iteration, after a barrier that every warp
    // reaches only once it has its Q fragments (see `layout::q_shares_ring`). Less shared memory
    // per block, more blocks per SM.
    let q_tile = if q_shares_ring(BLOCK_M, BLOCK_N, HEAD_DIM) {
        kv_ring.rows_from(2 * (STAGES - 1) * BLOCK_N)
    } else {
        smem.tile16(BLOCK_M, stride)
    };
    // Keys before the first tile of `keys.begin` or past `keys.end` are hidden from every row
    // (never loaded).
    let keys = mask.keys_for(q_start, q_rows);
    let kv_tiles = keys.tiles(BLOCK_N);
    let kv = ((k_head, v_head), (shape.seqlen_k, d), (keys.first_tile(BLOCK_N), kv_tiles));
    let ring = KvRing::<BLOCK_N, HEAD_DIM, STAGES>::new(kv_ring, kv.0, kv.1, kv.2, threads);

    // Prologue: Q travels in the first group, with K/V tile 0; tiles 1 .. STAGES − 1 follow.
    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe { q_tile.copy_rows_async(q_head.add(q_start * d), BLOCK_M, HEAD_DIM, d, q_rows, threads) };
    ring.prime();
    hw::cp_async_wait(STAGES - 2);
    hw::sync_threads();
    // A negative scale is −Q with |c|, a zero scale the smallest normal float (`positive_factor`).
    let (sign, c) = (q_sign_mask(scale_log2), positive_factor(scale_log2));
    // The factor the softmax applies: c for raw products, 1 for modified scores.
    let factor = if MODS { 1.0 } else { c };
    let q_fragment = |r: usize, ks: usize| q_tile.fragment_a(warp_row + 16 * r, 16 * ks).map(|x| x ^ sign);
    let mut q_frag = [[[0u32; 4]; D_STEPS]; WARP_TILES];
    if q_in_registers {
        q_frag = core::array::from_fn(|r| core::array::from_fn(|ks| q_fragment(r, ks)));
    }

    let mut softmax: [RowSoftmax; WARP_TILES] = core::array::from_fn(|_| RowSoftmax::new());
    let mut acc = [[[0.0f32; 4]; D_TILES]; WARP_TILES];
    for tile in 0..kv_tiles {
        let (k_tile, v_tile) = ring.advance(tile);
        let kv_start = keys.tile_start(tile, BLOCK_N);

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
        // Softcap, ALiBi or a bias, if the problem has one: the scores become base-2 logits.
        // (Unrolled by hand: LLVM keeps a loop this long rolled, and S, indexed by its counter,
        // would live in local memory.)
        if MODS {
            let head_score = score.for_head(block.head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            hw::unroll::<WARP_TILES>(|r| {
                head_score.apply_fragments::<N_TILES, false>(
                    &mut s[r],
                    lane,
                    (q_start + warp_row + 16 * r, kv_start),
                    c,
                )
            });
            if score.has_bias() {
                // (Read here, where they are added. Read before the products, the values
                // held registers across them that the kernel, at its limit of 255, spilled,
                // and the forward ran slower: PERFORMANCE.md, "a bias read without branches".)
                let bias = score.bias_plane(block.batch, block.head, shape.seqlen_q, shape.seqlen_k);
                hw::unroll::<WARP_TILES>(|r| {
                    // SAFETY: the host checked the bias's shape.
                    unsafe {
                        bias.add_to_fragments::<N_TILES, false>(
                            &mut s[r],
                            lane,
                            (q_start + warp_row + 16 * r, kv_start),
                        )
                    }
                });
            }
        }
        // Only tiles that cross some row's key limit or start (the causal diagonal, a window's
        // edges, the ragged end of the keys) pay for the per-element mask.
        if keys.needs_mask(kv_start, BLOCK_N) {
            for r in 0..WARP_TILES {
                let first = (q_start + warp_row + 16 * r, kv_start);
                mask_fragments::<N_TILES, false>(&mut s[r], lane, f32::NEG_INFINITY, first, &mask);
            }
        }
        let alpha: [[f32; 2]; WARP_TILES] = core::array::from_fn(|r| softmax[r].update(&mut s[r], factor));
        // Once the running maxima settle, most tiles leave them unchanged (alpha = 1 exactly):
        // the warp then skips rescaling its O accumulator, HEAD_DIM / 2 multiplications per lane
        // and m-tile per tile. The vote makes the branch uniform across the warp.
        if hw::warp_any(alpha.iter().any(|a| a[0] != 1.0 || a[1] != 1.0)) {
            for r in 0..WARP_TILES {
                scale_rows(&mut acc[r], alpha[r]);
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
    // SAFETY: the host checked the sinks' length (`ScoreArgs::sink`).
    let sink = if EXTRAS && score.has_sinks() { unsafe { score.sink(block.head) } } else { f32::NEG_INFINITY };
    let finished: [([f32; 2], [f32; 2]); WARP_TILES] = core::array::from_fn(|r| softmax[r].finish(sink));
    hw::sync_threads();
    let inv_sum: [[f32; 2]; WARP_TILES] = core::array::from_fn(|r| finished[r].0);
    // SAFETY: rows q_start .. q_start + q_rows of O exist.
    unsafe {
        store_warp_rows::<T, D_TILES, WARP_TILES>(
            &acc,
            inv_sum,
            q_tile,
            (warp_row, 0),
            o_head,
            (q_start, d),
            (q_rows, d),
            lane,
        )
    };
    // SAFETY: rows q_start .. q_start + q_rows of LSE exist.
    unsafe { store_fragment_lse(&finished, lse_head, q_start, warp_row, q_rows, lane) };
}

/// One entry per tile and format, named `flash_fwd_{f16,bf16}_m{block_m}_n{block_n}_d{head_dim}_s{stages}`
/// (an exact instance), with `_padded` after it for the padded instance of the same tile
/// (`layout::row_length`), and of each a `_table` twin for problems with a band table
/// (`attention_kernel!`); `sm80_forward_tiles!` and `sm80_padded_forward_tiles!` (in
/// [`crate::configs`]) list the tiles.
macro_rules! flash_forward_mma_instance {
    ($dtype:ident, $format:ident, $block_m:literal, $block_n:literal, $head_dim:literal, $stages:literal) => {
        pastey::paste! {
            flash_forward_mma_instance!(@entry $format, $block_m, $block_n, $head_dim, $stages, false,
                [<flash_fwd_ $dtype _m $block_m _n $block_n _d $head_dim _s $stages>]);
        }
    };
    ($dtype:ident, $format:ident, $block_m:literal, $block_n:literal, $head_dim:literal, $stages:literal, padded) => {
        pastey::paste! {
            flash_forward_mma_instance!(@entry $format, $block_m, $block_n, $head_dim, $stages, true,
                [<flash_fwd_ $dtype _m $block_m _n $block_n _d $head_dim _s $stages _padded>]);
        }
    };
    (@entry $format:ident, $block_m:literal, $block_n:literal, $head_dim:literal, $stages:literal, $padded:literal, $name:ident) => {
        attention_kernel! {
        /// FlashAttention-2 forward on tensor cores; see the module docs and `flash_forward_mma`.
        ///
        /// # Safety
        /// As `flash_forward_mma`.
        fn $name(
            q: *const u16,
            k: *const u16,
            v: *const u16,
            o: *mut u16,
            lse: *mut f32,
        ) table twin |shape, mask, score, scale_log2, TABLE| {
            unsafe {
                flash_forward_mma::<
                    hw::$format,
                    $block_m,
                    $block_n,
                    $head_dim,
                    $stages,
                    $padded,
                    { $block_m / 64 },
                    { $head_dim / 16 },
                    { $block_n / 8 },
                    { $head_dim / 8 },
                    TABLE,
                >(q, k, v, o, lse, shape, mask, score, scale_log2)
            }
        }
        }
    };
}

sm80_forward_tiles!(flash_forward_mma_instance);
sm80_padded_forward_tiles!(flash_forward_mma_instance);

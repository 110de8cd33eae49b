//! What the device code and the host must agree on: kernel-argument structs, block sizes and
//! shared-memory layouts.
//!
//! This file has no dependencies and no `unsafe`: the host crate uses this module as
//! `attn_host::layout` (the device crate is its dependency), so an argument layout, a block size
//! or a tile layout is written down exactly once.

/// The shape of one attention problem. Kernels receive it as six integer arguments, in field
/// order, and rebuild the struct on the device (rustc warns that structs passed by value to
/// `extern "gpu-kernel"` functions may not match what the driver passes).
///
/// Q and O are `[batch, num_heads_q, seqlen_q, head_dim]`, K and V are
/// `[batch, num_heads_kv, seqlen_k, head_dim]`, all row-major `f32`. Query head `h` reads
/// key/value head `h / (num_heads_q / num_heads_kv)` (grouped-query attention; equal counts give
/// ordinary multi-head attention). The host checks that every field is at least 1 and that
/// `num_heads_kv` divides `num_heads_q` before any launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct AttentionShape {
    /// Independent sequences.
    pub batch: usize,
    /// Query heads (and output heads).
    pub num_heads_q: usize,
    /// Key/value heads; divides `num_heads_q`.
    pub num_heads_kv: usize,
    /// Query rows per head.
    pub seqlen_q: usize,
    /// Key/value rows per head.
    pub seqlen_k: usize,
    /// Features per head (the length of each q, k, v row).
    pub head_dim: usize,
}

impl AttentionShape {
    /// Derives and validates the problem shape from the shapes of Q `[batch, num_heads_q,
    /// seqlen_q, head_dim]`, K and V (both `[batch, num_heads_kv, seqlen_k, head_dim]`).
    ///
    /// # Errors
    /// A [`ShapeError`] when a tensor is not 4-dimensional, a dimension is 0, K and V differ, the
    /// batch or head_dim of Q and K differ, or `num_heads_kv` does not divide `num_heads_q` (the
    /// host turns it into its `Error::Shape`, whose message says which).
    pub fn from_qkv(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self, ShapeError> {
        Self::parse(q, k, v, false)
    }

    /// [`AttentionShape::from_qkv`] that also takes empty problems: batch, num_heads_q, seqlen_q
    /// and seqlen_k may be 0 (a sequence of length 0, as a batch of variable lengths can hold);
    /// num_heads_kv and head_dim must still be at least 1. What the library's attention entry
    /// points accept; an empty problem's outputs follow the empty-row convention ([`Self::is_empty`]).
    ///
    /// # Errors
    /// As [`AttentionShape::from_qkv`], with [`ShapeError::NoHeadsOrWidth`] for the two sizes
    /// that must not be 0.
    pub fn from_qkv_allowing_empty(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self, ShapeError> {
        Self::parse(q, k, v, true)
    }

    /// Whether no query sees a key: batch, num_heads_q, seqlen_q or seqlen_k is 0. Then O is 0
    /// and the LSE −∞ for every query row there is (none, unless only seqlen_k is 0), dQ, dK and
    /// dV are 0, and no kernel runs.
    pub const fn is_empty(&self) -> bool {
        self.batch == 0 || self.num_heads_q == 0 || self.seqlen_q == 0 || self.seqlen_k == 0
    }

    fn parse(q: &[usize], k: &[usize], v: &[usize], allow_empty: bool) -> Result<Self, ShapeError> {
        let four = |tensor: Tensor, shape: &[usize]| -> Result<[usize; 4], ShapeError> {
            let shape: [usize; 4] = shape.try_into().map_err(|_| ShapeError::Rank { tensor, rank: shape.len() })?;
            if allow_empty {
                // K's heads (which Q's must be a multiple of) and every row's width.
                let heads = if tensor == Tensor::Q { 1 } else { shape[1] };
                if heads == 0 || shape[3] == 0 {
                    return Err(ShapeError::NoHeadsOrWidth { tensor, shape });
                }
            } else if shape.contains(&0) {
                return Err(ShapeError::EmptyDimension { tensor, shape });
            }
            Ok(shape)
        };
        let (q, k, v) = (four(Tensor::Q, q)?, four(Tensor::K, k)?, four(Tensor::V, v)?);
        if k != v {
            return Err(ShapeError::KvDiffer { k, v });
        }
        if q[0] != k[0] || q[3] != k[3] {
            return Err(ShapeError::QkDisagree { q, k });
        }
        if !q[1].is_multiple_of(k[1]) {
            return Err(ShapeError::Grouping { num_heads_q: q[1], num_heads_kv: k[1] });
        }
        Ok(Self { batch: q[0], num_heads_q: q[1], num_heads_kv: k[1], seqlen_q: q[2], seqlen_k: k[2], head_dim: q[3] })
    }

    /// Shape of Q and O.
    pub const fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.num_heads_q, self.seqlen_q, self.head_dim]
    }

    /// Shape of K and V.
    pub const fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.num_heads_kv, self.seqlen_k, self.head_dim]
    }

    /// Shape of the logsumexp: one `f32` per query row, `[batch, num_heads_q, seqlen_q]`.
    pub const fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.num_heads_q, self.seqlen_q]
    }

    /// Floating-point operations of one forward pass, in the field's convention:
    /// 4 · batch · heads · seqlen_q · seqlen_k · head_dim (two matrix products, 2 flops per
    /// multiply-add; the softmax is not counted).
    pub fn forward_flops(&self) -> f64 {
        4.0 * (self.batch * self.num_heads_q) as f64
            * self.seqlen_q as f64
            * self.seqlen_k as f64
            * self.head_dim as f64
    }

    /// Bytes of device memory the naive kernels need beyond inputs, O and LSE: the
    /// `[batch, num_heads_q, seqlen_q, seqlen_k]` score/probability matrix.
    pub const fn naive_workspace_bytes(&self) -> usize {
        self.query_rows() * self.seqlen_k * core::mem::size_of::<f32>()
    }

    /// Bytes of the logsumexp output, the only thing FlashAttention keeps besides O.
    pub const fn lse_bytes(&self) -> usize {
        self.query_rows() * core::mem::size_of::<f32>()
    }

    /// Query rows over all batches and heads: `batch · num_heads_q · seqlen_q`.
    pub const fn query_rows(&self) -> usize {
        self.batch * self.num_heads_q * self.seqlen_q
    }

    /// Query heads that share one key/value head (1 for multi-head attention).
    pub const fn group_size(&self) -> usize {
        div_rem(self.num_heads_q, self.num_heads_kv).0
    }

    /// The key/value head (within its batch) that query head `h` reads.
    pub const fn kv_head(&self, h: usize) -> usize {
        div_rem(h, self.group_size()).0
    }

    /// Offset (in floats) of the first row of query head `h` of batch `b` in Q and O.
    pub const fn q_head_offset(&self, b: usize, h: usize) -> usize {
        (b * self.num_heads_q + h) * self.seqlen_q * self.head_dim
    }

    /// Offset (in floats) in K and V of the first row of the key/value head that query head `h`
    /// of batch `b` reads.
    pub const fn kv_head_offset(&self, b: usize, h: usize) -> usize {
        (b * self.num_heads_kv + self.kv_head(h)) * self.seqlen_k * self.head_dim
    }
}

/// `(a / b, a % b)` in 32-bit arithmetic: every index and count of a grid (heads, blocks, work
/// units) fits in 32 bits, and 64-bit division is a long subroutine on the GPU (with more
/// registers than a producer warpgroup has to spare).
#[inline(always)]
pub const fn div_rem(a: usize, b: usize) -> (usize, usize) {
    let (a, b) = (a as u32, b as u32);
    ((a / b) as usize, (a % b) as usize)
}

/// One of the three input tensors, as [`ShapeError`] names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tensor {
    Q,
    K,
    V,
}

impl core::fmt::Display for Tensor {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::Q => "q",
            Self::K => "k",
            Self::V => "v",
        })
    }
}

/// Why the shapes of Q, K and V are not one attention problem ([`AttentionShape::from_qkv`]).
/// Its `Display` is the message the host's `Error::Shape` carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// The tensor has `rank` dimensions, not 4.
    Rank { tensor: Tensor, rank: usize },
    /// A dimension of the tensor is 0.
    EmptyDimension { tensor: Tensor, shape: [usize; 4] },
    /// K or V has no heads, or a tensor's rows are 0 wide (where the other sizes may be 0).
    NoHeadsOrWidth { tensor: Tensor, shape: [usize; 4] },
    /// K and V have different shapes.
    KvDiffer { k: [usize; 4], v: [usize; 4] },
    /// Q and K disagree on batch (dim 0) or head_dim (dim 3).
    QkDisagree { q: [usize; 4], k: [usize; 4] },
    /// `num_heads_kv` does not divide `num_heads_q`.
    Grouping { num_heads_q: usize, num_heads_kv: usize },
}

impl core::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Self::Rank { tensor, rank } => {
                write!(
                    f,
                    "`{tensor}` has {rank} dimensions; expected 4 dimensions [batch, num_heads, seqlen, head_dim]"
                )
            }
            Self::EmptyDimension { tensor, shape } => {
                write!(f, "`{tensor}` has shape {shape:?}; every dimension must be at least 1")
            }
            Self::NoHeadsOrWidth { tensor, shape } => write!(
                f,
                "`{tensor}` has shape {shape:?}; num_heads_kv and head_dim must be at least 1 (batch, num_heads_q \
                 and the sequence lengths may be 0)"
            ),
            Self::KvDiffer { k, v } => write!(f, "`k` {k:?} and `v` {v:?} must have the same shape"),
            Self::QkDisagree { q, k } => {
                write!(f, "`q` {q:?} and `k` {k:?} must agree on batch (dim 0) and head_dim (dim 3)")
            }
            Self::Grouping { num_heads_q, num_heads_kv } => write!(
                f,
                "num_heads_q = {num_heads_q} is not a multiple of num_heads_kv = {num_heads_kv} (grouped-query \
                 attention needs every key/value head to serve the same number of query heads)"
            ),
        }
    }
}

/// Threads per block of the element-wise kernels (vector add, naive attention).
pub const ELEMENTWISE_THREADS: usize = 256;

/// Rows of the naive softmax handled per block: one warp per row.
pub const SOFTMAX_ROWS_PER_BLOCK: usize = 4;

/// Threads per block of the naive softmax: one warp for each of its rows.
pub const SOFTMAX_THREADS: usize = SOFTMAX_ROWS_PER_BLOCK * 32;

/// FlashAttention forward: the 128 threads of a block form a grid of
/// `FLASH_THREAD_ROWS × FLASH_THREAD_COLS` = 16 × 8. A *row group* is the 8 consecutive threads
/// (lanes) that share query rows; each thread of it owns `block_m / 16` query rows and, of those
/// rows, every 8th score column and every 8th group of 4 output columns.
pub const FLASH_THREAD_ROWS: usize = 16;
/// Threads per row group; see [`FLASH_THREAD_ROWS`].
pub const FLASH_THREAD_COLS: usize = 8;
/// Threads per FlashAttention forward block.
pub const FLASH_THREADS: usize = FLASH_THREAD_ROWS * FLASH_THREAD_COLS;

/// Floats of padding after each shared-memory row that threads read column-wise. It moves row
/// `r + 1` four banks further than row `r`, so the 8 lanes of a row group, reading 16 bytes each
/// from 8 different rows, hit all 32 banks once instead of one bank eight times.
pub const SMEM_PAD: usize = 4;

/// Row strides (in floats) of the four shared-memory tiles of a FlashAttention forward block:
/// Q (`block_m × head_dim`), K (`block_n × head_dim`), V (`block_n × head_dim`) and
/// P (`block_m × block_n`), in that order in memory.
pub const fn flash_forward_strides(block_n: usize, head_dim: usize) -> [usize; 4] {
    [head_dim + SMEM_PAD, head_dim + SMEM_PAD, head_dim, block_n + SMEM_PAD]
}

/// Bytes of dynamic shared memory a FlashAttention forward block needs.
pub const fn flash_forward_smem_bytes(block_m: usize, block_n: usize, head_dim: usize) -> usize {
    let [q, k, v, p] = flash_forward_strides(block_n, head_dim);
    (block_m * q + block_n * k + block_n * v + block_m * p) * core::mem::size_of::<f32>()
}

/// Row strides (in floats) of the FlashAttention backward K/V-outer kernel's tiles: K and V
/// (`block_n × head_dim`), Q and dO (`block_m × head_dim`), Pᵀ/dSᵀ (`block_n × block_m`) and dS
/// (`block_m × block_n`); a `2 × block_m` tile of per-query statistics follows them.
pub const fn flash_backward_kv_strides(block_m: usize, block_n: usize, head_dim: usize) -> [usize; 4] {
    [head_dim + SMEM_PAD, head_dim + SMEM_PAD, block_m + SMEM_PAD, block_n + SMEM_PAD]
}

/// Bytes of dynamic shared memory a block of the backward K/V-outer kernel needs.
pub const fn flash_backward_kv_smem_bytes(block_m: usize, block_n: usize, head_dim: usize) -> usize {
    let [kv, q, pt, ds] = flash_backward_kv_strides(block_m, block_n, head_dim);
    (2 * block_n * kv + 2 * block_m * q + block_n * pt + block_m * ds + 2 * block_m) * core::mem::size_of::<f32>()
}

/// Row strides (in floats) of the deterministic dQ kernel's tiles: Q, dO, K, V (all
/// `… × head_dim`), then dS (`block_m × block_n`).
pub const fn flash_backward_q_strides(block_n: usize, head_dim: usize) -> [usize; 2] {
    [head_dim + SMEM_PAD, block_n + SMEM_PAD]
}

/// Bytes of dynamic shared memory a block of the deterministic dQ kernel needs.
pub const fn flash_backward_q_smem_bytes(block_m: usize, block_n: usize, head_dim: usize) -> usize {
    let [qkv, ds] = flash_backward_q_strides(block_n, head_dim);
    (2 * (block_m + block_n) * qkv + block_m * ds) * core::mem::size_of::<f32>()
}

/// Tensor-core kernels: the rows of one m-tile, the M of one `mma.m16n8k16`. A backward block of
/// `block_n` keys (or a dQ block of `block_m` queries) has one warp per m-tile; a forward warp
/// owns one or two m-tiles (see [`MMA_FORWARD_WARPS`]).
pub const MMA_WARP_ROWS: usize = 16;

/// Padding, in 16-bit elements, after each row of a tensor-core kernel's shared-memory tiles:
/// 16 bytes, so that the 8 rows one `ldmatrix` matrix reads fall on different banks.
pub const MMA_SMEM_PAD: usize = 8;

/// Threads per block of a tensor-core backward kernel whose warps own `rows` rows in all, one
/// m-tile each.
pub const fn mma_threads(rows: usize) -> usize {
    rows / MMA_WARP_ROWS * 32
}

/// Warps that share the columns of one m-tile of the tensor-core backward's accumulators (dK and
/// dV in the K/V-outer kernels, dQ in the dQ kernel): 1 up to head_dim 128, 2 above. Each warp
/// then accumulates `head_dim / 2` columns, which keeps dK and dV at 128 registers a thread at
/// head_dim 256 (as at 128 unsplit); the products over head_dim (Sᵀ and dPᵀ, or S and dP) are
/// computed by both warps of a pair, which costs half as many products again at the split head
/// dims (`kernels/src/sm80/backward.rs`, "Wide heads").
pub const fn mma_backward_column_warps(head_dim: usize) -> usize {
    if head_dim > 128 { 2 } else { 1 }
}

/// The columns of the tensor-core backward's accumulators that one warp owns at `head_dim`:
/// all of them, or a half above 128 ([`mma_backward_column_warps`]).
pub const fn mma_backward_warp_columns(head_dim: usize) -> usize {
    head_dim / mma_backward_column_warps(head_dim)
}

/// Threads per block of a tensor-core backward kernel whose warps own `rows` rows (keys for the
/// K/V-outer kernels, queries for the dQ kernel) at `head_dim`: one warp per m-tile, times
/// [`mma_backward_column_warps`].
pub const fn mma_backward_threads(rows: usize, head_dim: usize) -> usize {
    mma_threads(rows) * mma_backward_column_warps(head_dim)
}

/// Warps of a tensor-core forward block: always 4. A block of `block_m` query rows gives each
/// warp `block_m / 64` m-tiles of 16 rows (1 for `block_m` = 64, 2 for 128).
pub const MMA_FORWARD_WARPS: usize = 4;

/// Threads per block of the tensor-core forward kernel (`block_m` only sets the rows per warp).
pub const fn mma_forward_threads(_block_m: usize) -> usize {
    MMA_FORWARD_WARPS * 32
}

/// The length of a row of Q, K, V, O and the gradients in device memory for a kernel compiled for
/// `HEAD_DIM`: the constant itself in an *exact* instance (`PADDED = false`, run only when the
/// problem's head_dim is `HEAD_DIM`), which the compiler folds into every address and bound, and
/// the problem's head_dim (at most `HEAD_DIM`) in a *padded* one, whose tiles keep the columns
/// past it at zero. The tensor-core kernels come in both kinds because the run-time row length
/// costs them registers they do not have (PERFORMANCE.md, issue 21); the `f32` kernels are all
/// padded.
#[inline(always)]
pub const fn row_length<const HEAD_DIM: usize, const PADDED: bool>(shape: &AttentionShape) -> usize {
    if PADDED { shape.head_dim } else { HEAD_DIM }
}

/// Whether the tensor-core forward kernel keeps its Q fragments in registers for the whole pass
/// (read from shared memory once, before the key loop): when each warp has one m-tile
/// (`block_m` = 64) and head_dim is at most 192. With two m-tiles the registers go to the second
/// m-tile's scores and accumulator; at head_dim 256 the O accumulator alone takes 128 registers
/// a thread and Q's 64 more would spill. Q is then re-read from shared memory at every use.
pub const fn q_in_registers(block_m: usize, head_dim: usize) -> bool {
    block_m == MMA_FORWARD_WARPS * MMA_WARP_ROWS && head_dim <= 192
}

/// Whether the tensor-core forward kernel's Q tile borrows the last slot of its K/V ring instead
/// of a region of its own: when Q is only read before that slot is first filled (its fragments
/// stay in registers, [`q_in_registers`]), and Q (`block_m` rows) fits in the slot (a K and a V
/// tile, `2 · block_n` rows).
pub const fn q_shares_ring(block_m: usize, block_n: usize, head_dim: usize) -> bool {
    q_in_registers(block_m, head_dim) && block_m <= 2 * block_n
}

/// Bytes of dynamic shared memory of the tensor-core forward kernel: `stages` slots of a K and a
/// V tile (`block_n × head_dim` each), and the Q tile (`block_m × head_dim`) unless it fits in a
/// slot ([`q_shares_ring`]); all 16-bit with padded rows.
pub const fn mma_forward_smem_bytes(block_m: usize, block_n: usize, head_dim: usize, stages: usize) -> usize {
    let q_rows = if q_shares_ring(block_m, block_n, head_dim) { 0 } else { block_m };
    (q_rows + 2 * stages * block_n) * (head_dim + MMA_SMEM_PAD) * 2
}

/// Bytes of dynamic shared memory of the tensor-core K/V-outer backward kernels (a block of
/// `block_n` keys, query tiles of `block_m`): K and V (`block_n × head_dim`), `stages` slots of a
/// Q and a dO tile (`block_m × head_dim`), the dSᵀ tile (`block_n × block_m`), all 16-bit with
/// padded rows, then `stages` slots of LSE and D (`2 × block_m` `f32`).
pub const fn mma_backward_kv_smem_bytes(block_m: usize, block_n: usize, head_dim: usize, stages: usize) -> usize {
    (2 * block_n + 2 * stages * block_m) * (head_dim + MMA_SMEM_PAD) * 2
        + block_n * (block_m + MMA_SMEM_PAD) * 2
        + stages * 2 * block_m * 4
}

/// Bytes of dynamic shared memory of the tensor-core dQ kernel (a block of `block_m` queries,
/// key tiles of `block_n`): Q and dO (`block_m × head_dim`), then `stages` slots of a K and a V
/// tile (`block_n × head_dim`), 16-bit with padded rows.
pub const fn mma_backward_dq_smem_bytes(block_m: usize, block_n: usize, head_dim: usize, stages: usize) -> usize {
    (2 * block_m + 2 * stages * block_n) * (head_dim + MMA_SMEM_PAD) * 2
}

/// Query rows per consumer warpgroup of the Hopper forward kernel: one `wgmma` tile (m64).
pub const HOPPER_WARPGROUP_ROWS: usize = 64;

/// Threads per block of the Hopper forward kernel with `block_m` query rows: one producer
/// warpgroup and one consumer warpgroup per 64 rows.
pub const fn hopper_forward_threads(block_m: usize) -> usize {
    (1 + block_m / HOPPER_WARPGROUP_ROWS) * 128
}

/// Alignment of the Hopper kernels' shared-memory tiles: one 128-byte swizzle atom (8 rows of
/// 128 bytes), which TMA and `wgmma` address from a 1024-byte boundary.
pub const HOPPER_SMEM_ALIGN: usize = 1024;

/// Columns of a Hopper kernel's shared-memory tile of `head_dim`: whole 128-byte swizzled
/// column blocks of 64 16-bit values, so `head_dim` rounded up to 64. The `wgmma`s read only the
/// first `head_dim` columns (a multiple of 16), except the wide backward's dQ at 160, which
/// multiplies its third block whole; TMA fills the padding with zeros past the tensor's last
/// column. (A 64- or
/// 32-byte swizzle would fit 96 columns exactly, at the cost of a second tile layout in every
/// Hopper kernel; shared memory has room for the padding at these head dims.)
pub const fn hopper_tile_columns(head_dim: usize) -> usize {
    head_dim.div_ceil(64) * 64
}

/// Bytes after the Hopper forward's barriers for the unit its producer hands to its consumers
/// (the work unit that goes with the Q tile: `kernels/src/sm90/forward.rs`, `Unit`).
pub const HOPPER_FORWARD_UNIT_BYTES: usize = 32;

/// Dynamic shared memory one Hopper block may have on compute capability 9.0 (227 KiB).
pub const HOPPER_SMEM_PER_BLOCK: usize = 227 * 1024;

/// [`hopper_forward_smem_bytes`] with `q_slots` Q slots, in the order the kernel lays them out
/// (the alignment slack first: the dynamic shared memory's own alignment is smaller).
const fn hopper_forward_bytes(block_m: usize, block_n: usize, head_dim: usize, stages: usize, q_slots: usize) -> usize {
    HOPPER_SMEM_ALIGN
        + (q_slots * block_m + 2 * stages * block_n) * hopper_tile_columns(head_dim) * 2
        + 8 * (2 * q_slots + 4 * stages)
        + q_slots * HOPPER_FORWARD_UNIT_BYTES
}

/// Whether a second Q slot pays at a Hopper forward tile of `block_m` rows and `head_dim`
/// columns: where ptxas assembles the consumers with it without more spills — block_m 64 (one
/// consumer, fewer spills with it) and head_dim 80 and 96 (the same spills) — and not where its
/// per-unit state adds spills to consumers whose registers are already full: block_m 192, the
/// 128-row ping-pong at head_dim 64, head_dim 128. PERFORMANCE.md (2026-12-07) has the
/// measurements behind the rule: a small gain where it adds no spills, a loss where it does.
const fn second_q_slot_pays(block_m: usize, head_dim: usize) -> bool {
    block_m == 64 || (block_m == 128 && head_dim > 64 && head_dim <= 96)
}

/// Q slots of the Hopper forward. With two, the producer of a persistent block loads its next
/// unit's Q tile, and then that unit's first K/V tiles, while the consumers still compute the
/// current unit; with one, the next Q tile (and so the next unit's K/V tiles, which the
/// producer issues after it) waits until the current unit's last scores are done. Two where
/// they pay ([`second_q_slot_pays`]) and fit in [`HOPPER_SMEM_PER_BLOCK`] (not at head_dim
/// 160–256, where a second Q tile does not fit beside two K/V stages).
pub const fn hopper_forward_q_slots(block_m: usize, block_n: usize, head_dim: usize, stages: usize) -> usize {
    let fits = hopper_forward_bytes(block_m, block_n, head_dim, stages, 2) <= HOPPER_SMEM_PER_BLOCK;
    if second_q_slot_pays(block_m, head_dim) && fits { 2 } else { 1 }
}

/// Bytes of dynamic shared memory of the Hopper forward kernel: [`hopper_forward_q_slots`] Q
/// tiles (`block_m × head_dim`), `stages` slots of a K and a V tile (`block_n × head_dim`), all
/// 16-bit and [`hopper_tile_columns`] wide, the `mbarrier`s (8 bytes each: Q full and Q empty
/// per Q slot; K full, V full, K empty and V empty per stage), a [`HOPPER_FORWARD_UNIT_BYTES`]
/// unit per Q slot, plus the slack to align the tiles to [`HOPPER_SMEM_ALIGN`].
pub const fn hopper_forward_smem_bytes(block_m: usize, block_n: usize, head_dim: usize, stages: usize) -> usize {
    hopper_forward_bytes(block_m, block_n, head_dim, stages, hopper_forward_q_slots(block_m, block_n, head_dim, stages))
}

/// Keys per block of the Hopper backward at the compiled `head_dim`: 128 up to head_dim 128,
/// where each of the two consumer warpgroups owns 64 keys and keeps their dK and dV in
/// registers; above, 64 keys that both consumers share (one accumulates dV, the other dK: 64
/// keys' dK and dV together would take `head_dim` registers a thread, 256 at 256).
/// `kernels/src/sm90/backward.rs`, "Wide heads", has the rest.
pub const fn hopper_backward_block_n(head_dim: usize) -> usize {
    if head_dim <= 128 { 128 } else { 64 }
}

/// Whether the Hopper backward's two consumers take turns at the query tiles' dQ, one tile each,
/// the one whose turn it is adding all 128 keys' part to all `head_dim` columns, rather than
/// share every tile by 64-column blocks, each adding all 128 keys' part to its own block: up to
/// head_dim 96, where a second column block would be padding or mostly padding. Either way
/// every element of dQ receives one addition per key block and tile, and a consumer reads the
/// other's dSᵀ rows after a barrier of both. (Sharing by keys, each consumer adding its own 64
/// keys' part to all columns, doubled the additions: PERFORMANCE.md.)
pub const fn hopper_backward_dq_in_turns(head_dim: usize) -> bool {
    head_dim <= 96
}

/// Columns of a query tile's dQ that one Hopper backward consumer computes per step (up to head_dim
/// 128): all of them when the consumers take turns ([`hopper_backward_dq_in_turns`]), else one
/// block of 64.
pub const fn hopper_backward_dq_columns(head_dim: usize) -> usize {
    if hopper_backward_dq_in_turns(head_dim) { head_dim } else { 64 }
}

/// Columns of a Hopper backward consumer's dQ staging tile (`f32`, 64 rows), whole TMA boxes of
/// 32: [`hopper_backward_dq_columns`] rounded up to a box (64 at 64, 96 at 80 and 96), 64 at 128,
/// 160 and 192, 32 (one box) at 256, where shared memory holds no more (the kernel takes 226 of the
/// H200's 227 KiB).
pub const fn hopper_backward_dq_staging_columns(head_dim: usize) -> usize {
    if head_dim <= 192 { hopper_backward_dq_columns(head_dim).div_ceil(32) * 32 } else { 32 }
}

/// Bytes of dynamic shared memory of the Hopper backward kernel at the compiled `head_dim`
/// (block_n = [`hopper_backward_block_n`] keys per block, query tiles of 64): K and V
/// (`block_n × head_dim`), `stages` slots of a Q and a dO tile (`64 × head_dim`), two key-row
/// buffers (`block_n × 64`: dSᵀ of two tiles, or Pᵀ and dSᵀ of one), all 16-bit (the tiles
/// [`hopper_tile_columns`] wide), two dQ
/// staging tiles (`64 ×` [`hopper_backward_dq_staging_columns`] `f32`), `stages` slots of the
/// query tile's LSE and D (`2 × 64` `f32`), then the `mbarrier`s (K/V full; Q full, dO full and
/// Q/dO empty per stage; dQ staged and staging free per consumer), plus the alignment slack of
/// [`hopper_forward_smem_bytes`].
pub const fn hopper_backward_smem_bytes(head_dim: usize, stages: usize) -> usize {
    let block_n = hopper_backward_block_n(head_dim);
    HOPPER_SMEM_ALIGN
        + (2 * block_n + 2 * stages * 64) * hopper_tile_columns(head_dim) * 2
        + 2 * block_n * 64 * 2
        + 2 * 64 * hopper_backward_dq_staging_columns(head_dim) * 4
        + stages * 2 * 64 * 4
        + 8 * (1 + 3 * stages + 2 * 2)
}

/// A decoding problem (level 10, `sm80::decode`) as the decoder kernels receive it: its fields as
/// integer arguments, in field order ([`DecodeShape::args`]), rebuilt on the device.
///
/// Q is `[batch, seqlen_q, num_heads_q, head_dim]` or `[batch, num_heads_q, seqlen_q, head_dim]`
/// — any layout whose rows are found by the strides `q_batch`, `q_token`, `q_head` (elements);
/// O likewise by its own strides. The cache holds up to `capacity` keys per sequence: contiguous
/// (`page_size` = 0; K row of token `t`, head `h`, sequence `b` at `b·k_batch + t·k_token +
/// h·k_head`) or paged (`page_size` > 0, a multiple of 16; `k_batch` is then the stride between
/// pages, and token `t` of sequence `b` is row `t % page_size` of page `block_table[b ·
/// pages_per_seq + t / page_size]`, of `num_pages`). Sequence `b` has `seqlens_k[b] + new_keys`
/// keys when `has_seqlens` is 1 (clamped to `capacity`), `capacity` otherwise. The causal mask
/// (`causal` 1) is aligned to each sequence's own length when `bottom_right` is 1. A sliding
/// window sees the keys `i + d − window_left ..= i + d + window_right` of query `i`, its diagonal
/// `d` aligned to each sequence's end (decoding's alignment); an edge of
/// `attention::mask::Mask::OPEN` (`usize::MAX`, the default) is not limited.
/// `num_splits` blocks share each sequence's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    pub num_heads_q: usize,
    pub num_heads_kv: usize,
    pub seqlen_q: usize,
    pub head_dim: usize,
    pub capacity: usize,
    pub has_seqlens: usize,
    pub new_keys: usize,
    pub causal: usize,
    pub bottom_right: usize,
    pub num_splits: usize,
    pub q_batch: usize,
    pub q_token: usize,
    pub q_head: usize,
    pub o_batch: usize,
    pub o_token: usize,
    pub o_head: usize,
    pub k_batch: usize,
    pub k_token: usize,
    pub k_head: usize,
    pub v_batch: usize,
    pub v_token: usize,
    pub v_head: usize,
    pub page_size: usize,
    pub pages_per_seq: usize,
    pub num_pages: usize,
    pub window_left: usize,
    pub window_right: usize,
}

impl Default for DecodeShape {
    /// Every size 0, no window.
    fn default() -> Self {
        Self {
            batch: 0,
            num_heads_q: 0,
            num_heads_kv: 0,
            seqlen_q: 0,
            head_dim: 0,
            capacity: 0,
            has_seqlens: 0,
            new_keys: 0,
            causal: 0,
            bottom_right: 0,
            num_splits: 0,
            q_batch: 0,
            q_token: 0,
            q_head: 0,
            o_batch: 0,
            o_token: 0,
            o_head: 0,
            k_batch: 0,
            k_token: 0,
            k_head: 0,
            v_batch: 0,
            v_token: 0,
            v_head: 0,
            page_size: 0,
            pages_per_seq: 0,
            num_pages: 0,
            window_left: usize::MAX,
            window_right: usize::MAX,
        }
    }
}

impl DecodeShape {
    /// The fields in declaration order: the decoder kernels' shape arguments.
    pub const fn args(&self) -> [usize; 28] {
        let s = self;
        [
            s.batch,
            s.num_heads_q,
            s.num_heads_kv,
            s.seqlen_q,
            s.head_dim,
            s.capacity,
            s.has_seqlens,
            s.new_keys,
            s.causal,
            s.bottom_right,
            s.num_splits,
            s.q_batch,
            s.q_token,
            s.q_head,
            s.o_batch,
            s.o_token,
            s.o_head,
            s.k_batch,
            s.k_token,
            s.k_head,
            s.v_batch,
            s.v_token,
            s.v_head,
            s.page_size,
            s.pages_per_seq,
            s.num_pages,
            s.window_left,
            s.window_right,
        ]
    }

    /// Packed query rows per K/V head: the group's query heads times seqlen_q.
    pub const fn packed_rows(&self) -> usize {
        self.num_heads_q / self.num_heads_kv * self.seqlen_q
    }

    /// Blocks of the decoder's grid: one per sequence, K/V head, block of 16 packed rows and
    /// split.
    pub const fn blocks(&self) -> usize {
        self.batch * self.num_heads_kv * self.packed_rows().div_ceil(DECODE_BLOCK_M) * self.num_splits
    }

    /// Query rows of the whole problem, `batch · num_heads_q · seqlen_q`: the rows of the
    /// partial results of each split (`[num_splits, query_rows, decode_partial_stride(head_dim)]`
    /// floats of O, `[num_splits, query_rows]` of LSE).
    pub const fn query_rows(&self) -> usize {
        self.batch * self.num_heads_q * self.seqlen_q
    }
}

/// Packed query rows of a decoder block: one `mma` m-tile.
pub const DECODE_BLOCK_M: usize = 16;

/// Keys of one warp's tile in the decoder.
pub const DECODE_BLOCK_N: usize = 16;

/// Warps of a decoder block; they share its rows and take turns over its key tiles.
pub const DECODE_WARPS: usize = 4;

/// Threads of a decoder block.
pub const DECODE_THREADS: usize = DECODE_WARPS * 32;

/// Rows (16-bit, `head_dim + 8` long) of one warp's K/V ring in the decoder: `stages` slots of a
/// K and a V tile.
pub const fn decode_ring_rows(stages: usize) -> usize {
    2 * stages * DECODE_BLOCK_N
}

/// Bytes of dynamic shared memory of the decoder: the Q tile (16 rows), the warps' LSE (`f32`,
/// 4 × 16), then the larger of the warps' rings and the merge tile that replaces them after the
/// key loop (`f32`, 4 × 16 rows of `head_dim + 4`).
pub const fn decode_smem_bytes(head_dim: usize, stages: usize) -> usize {
    let rings = DECODE_WARPS * decode_ring_rows(stages) * (head_dim + MMA_SMEM_PAD) * 2;
    let merge = DECODE_WARPS * DECODE_BLOCK_M * (head_dim + 4) * 4;
    let larger = if rings > merge { rings } else { merge };
    DECODE_BLOCK_M * (head_dim + MMA_SMEM_PAD) * 2 + DECODE_WARPS * DECODE_BLOCK_M * 4 + larger
}

/// Floats from one row of the decoder's partial O to the next: head_dim rounded up to a multiple
/// of 4, so that every row starts 16-byte aligned and the decoder and its merge move whole
/// `F32x4` (the columns past head_dim are never read).
pub const fn decode_partial_stride(head_dim: usize) -> usize {
    head_dim.next_multiple_of(4)
}

/// Columns of one row that one thread of `decode_merge_*` merges.
pub const DECODE_MERGE_COLUMNS: usize = 4;

/// Threads per block of `decode_merge_*`.
pub const DECODE_MERGE_THREADS: usize = 128;

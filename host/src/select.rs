//! **Registry layer.** The selection policy: which kernel, tile and dQ mode a problem gets on a
//! device. It reads the registry ([`crate::kernels`]) and plain facts (the [`KernelPath`], the
//! [`DeviceInfo`]), not a context, so that the runtime and the operations above it ask here
//! instead of deciding themselves:
//!
//! - the built-in tiles: [`TileConfig::default_for_dtype`], [`TileConfig::default_backward_for_dtype`];
//! - the faster dQ mode: [`DqAccumulation::fastest_for`], [`Target::dq_accumulation`];
//! - whether a Hopper kernel replaces the sm_80 one, and which: [`Target::hopper_forward`],
//!   [`Target::hopper_backward`] ([`HopperForward::for_problem`], [`HopperBackward::for_problem`]),
//!   and for a problem's options [`Target::hopper_backward_for`].

use attn_kernels::attention::schedule::BalancedRows;

use crate::device::DeviceInfo;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{self, FlashKernel, HopperInstance, HopperVariant};
use crate::layout::{self, DecodeShape};
use crate::problem::{AttentionOptions, AttentionShape, Causal, DqAccumulation, MaskTableKind, TileConfig};

/// Which kernels run a context's 16-bit FlashAttention passes with the built-in tiles.
///
/// A GPU context takes [`KernelPath::Sm90a`] on compute capability 9.0 and [`KernelPath::Sm80`]
/// elsewhere, unless the environment variable [`KernelPath::ENV`] names one (`sm80` or
/// `sm90a`), or [`Context::with_kernel_path`] chooses. The test suite runs once per path that
/// way. On the sm_90a path the 16-bit forward and backward passes with the built-in tiles (the
/// backward with atomic dQ) run the Hopper kernels; everything else (the `f32` kernels, the
/// naive kernels, explicit tiles, a deterministic dQ) runs the sm_80 kernels on both paths. The CPU emulator is
/// always on sm_80.
///
/// [`Context::with_kernel_path`]: crate::Context::with_kernel_path
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// The `mma.sync` kernels, compiled for sm_80: every supported GPU.
    Sm80,
    /// The Hopper kernels (`wgmma`, TMA, warp specialisation), compiled for sm_90a: compute
    /// capability 9.0 only.
    Sm90a,
}

impl KernelPath {
    /// The environment variable that sets every new GPU context's path: `sm80` or `sm90a`.
    pub const ENV: &'static str = "RUST_ATTENTION_KERNELS";

    /// The path's name, as the PTX target: `sm_80` or `sm_90a`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sm80 => "sm_80",
            Self::Sm90a => "sm_90a",
        }
    }

    /// The path [`KernelPath::ENV`] asks for, if set. Set but empty counts as unset (the
    /// default path), as a shell's `RUST_ATTENTION_KERNELS= cmd` means.
    ///
    /// # Errors
    /// [`Error::Argument`] for a value other than `sm80`/`sm_80`/`sm90a`/`sm_90a`.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(Self::ENV) {
            Ok(value) if value.is_empty() => Ok(None),
            Ok(value) => value.parse().map(Some).map_err(|e| Error::Argument(format!("{}: {e}", Self::ENV))),
            Err(_) => Ok(None),
        }
    }
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KernelPath {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sm80" | "sm_80" => Ok(Self::Sm80),
            "sm90a" | "sm_90a" => Ok(Self::Sm90a),
            _ => Err(Error::Argument(format!("unknown kernel path {s:?}; use sm80 or sm90a"))),
        }
    }
}

/// What the policy reads about a context ([`Context::target`](crate::Context::target)): its
/// kernel path and its device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Target<'a> {
    /// Which kernels run the 16-bit passes with the built-in tiles.
    pub(crate) path: KernelPath,
    /// The device's facts (SM count, shared memory).
    pub(crate) device: &'a DeviceInfo,
}

impl Target<'_> {
    /// The Hopper kernel that [`Context::flash_attention_forward`] runs in place of the sm_80
    /// `tile` for `shape` and mask `causal`: on the sm_90a path, for `f16`/`bf16` and head_dim 64
    /// or 128, when `tile` is the built-in default ([`TileConfig::default_for_dtype`]). Any other
    /// tile names the sm_80 kernel to run, so that tile sweeps measure what they ask for.
    ///
    /// [`Context::flash_attention_forward`]: crate::Context::flash_attention_forward
    pub(crate) fn hopper_forward(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        causal: Causal,
        tile: TileConfig,
    ) -> Option<&'static HopperInstance> {
        let wanted = self.path == KernelPath::Sm90a && tile == TileConfig::default_for_dtype(dtype, shape.head_dim);
        wanted.then(|| HopperForward::for_problem(dtype, shape, causal, self.device.sm_count).ok()).flatten()
    }

    /// [`Target::hopper_forward`] for a problem with `options`, what the selection policy runs:
    /// none where the options keep the Hopper kernels out ([`AttentionOptions::hopper_allowed`]:
    /// a bias, which only the sm_80 modules' kernels read). The dispatch, the kernel's label and
    /// its entry all ask this one function.
    pub(crate) fn hopper_forward_for(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        tile: TileConfig,
        options: &AttentionOptions,
    ) -> Option<&'static HopperInstance> {
        self.hopper_forward(dtype, shape, options.causal, tile).filter(|_| options.hopper_allowed())
    }

    /// The Hopper backward kernel that [`Context::flash_attention_backward`] runs in place of the
    /// sm_80 ones: on the sm_90a path, for `f16`/`bf16` and the head dimensions it has, when
    /// `tile` is the built-in default ([`TileConfig::default_backward_for_dtype`]), in either dQ
    /// mode; [`HopperBackward::DETERMINISTIC_ENV`] `0` sends [`DqAccumulation::Deterministic`]
    /// to the sm_80 deterministic kernels instead (PERFORMANCE.md, issue 23, compares them).
    ///
    /// [`Context::flash_attention_backward`]: crate::Context::flash_attention_backward
    pub(crate) fn hopper_backward(
        &self,
        dtype: DType,
        head_dim: usize,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Option<&'static HopperInstance> {
        let wanted = self.path == KernelPath::Sm90a
            && tile == TileConfig::default_backward_for_dtype(dtype, head_dim)
            && (dq == DqAccumulation::Atomic || !sm80_deterministic_override());
        wanted.then(|| HopperBackward::for_problem(dtype, head_dim, dq).ok()).flatten()
    }

    /// [`Target::hopper_backward`] for a problem with `options`, what the selection policy runs:
    /// none where the options keep the deterministic Hopper backward out. A varlen table's gaps
    /// leave its dQ turns without a taker ([`AttentionOptions::hopper_backward_allowed`], a
    /// matter of correctness), and on every varlen table ([`MaskTableKind::Varlen`]) its turns
    /// cost more than they do on one sequence: a sequence's key blocks take turns on each of its
    /// dQ tiles, and where a sequence has more key blocks than query tiles (keys cached before
    /// the new queries, cross-attention) they queue behind each other, so the sm_80
    /// deterministic kernels (no turns) measured faster on every such batch (PERFORMANCE.md,
    /// 2026-12-03, "deterministic varlen"). Document masks keep the Hopper kernel, which is
    /// faster there.
    pub(crate) fn hopper_backward_for(
        &self,
        dtype: DType,
        head_dim: usize,
        tile: TileConfig,
        dq: DqAccumulation,
        options: &AttentionOptions,
    ) -> Option<&'static HopperInstance> {
        let varlen = options.mask_table.is_some_and(|t| t.kind == MaskTableKind::Varlen);
        let turns_pay = dq == DqAccumulation::Atomic || !varlen;
        self.hopper_backward(dtype, head_dim, tile, dq).filter(|_| turns_pay && options.hopper_backward_allowed(dq))
    }

    /// [`Context::dq_accumulation_for`](crate::Context::dq_accumulation_for) on this target.
    /// Above head_dim 128 the 16-bit backward takes atomic dQ too: on the sm_90a path the Hopper
    /// backward has only that mode there, and on the `mma.sync` kernels the dQ kernel's second
    /// pass over S and dP, which both warps of a slice pair compute, costs more than the K/V-outer
    /// kernel's atomic adds (at [2, 16, 4096, 256] bf16 on an H200, 95.9 TFLOP/s atomic against
    /// 79.8 deterministic; level with it at 192: PERFORMANCE.md, issue 21).
    pub(crate) fn dq_accumulation(&self, dtype: DType, head_dim: usize) -> DqAccumulation {
        let padded = TileConfig::padded_head_dim(FlashKernel::Backward, dtype, head_dim).unwrap_or(head_dim);
        if dtype != DType::F32 && layout::mma_backward_column_warps(padded) > 1 {
            return DqAccumulation::Atomic;
        }
        let tile = TileConfig::default_backward_for_dtype(dtype, head_dim);
        match self.hopper_backward(dtype, head_dim, tile, DqAccumulation::Atomic) {
            Some(_) => DqAccumulation::Atomic,
            None => DqAccumulation::fastest_for(dtype),
        }
    }

    /// The forward tile this device runs by default for `dtype` and `head_dim`: the built-in one
    /// ([`TileConfig::default_for_dtype`], the H200's fastest) where the device's shared memory
    /// holds it, else the compiled tile that fits with the most work per block
    /// ([`Self::fitting`]). So that no default fails with `SharedMemory` on a smaller GPU (an
    /// RTX 4090's 99 KiB, an A100's 163 KiB).
    pub(crate) fn forward_tile(&self, dtype: DType, head_dim: usize) -> TileConfig {
        self.fitting(TileConfig::default_for_dtype(dtype, head_dim), &[FlashKernel::Forward], dtype, head_dim)
    }

    /// As [`Self::forward_tile`] for the backward pass in dQ mode `dq`: a tile whose every kernel
    /// of that mode fits ([`TileConfig::default_backward_for_dtype`] where it does).
    pub(crate) fn backward_tile(&self, dtype: DType, head_dim: usize, dq: DqAccumulation) -> TileConfig {
        let builtin = TileConfig::default_backward_for_dtype(dtype, head_dim);
        self.fitting(builtin, kernels::backward_kernels(dq), dtype, head_dim)
    }

    /// `builtin` if every one of `kernels` is compiled for it and fits this device, else the
    /// compiled tile that does with the largest block_m · block_n, then the most stages (more
    /// work per block, fewer blocks, deeper pipeline: what the H200's sweeps favour); `builtin`
    /// if none fits (its launch then says why).
    fn fitting(&self, builtin: TileConfig, kernels: &[FlashKernel], dtype: DType, head_dim: usize) -> TileConfig {
        let fits = |tile: &TileConfig| {
            kernels.iter().all(|&kernel| tile.validate_kernel(kernel, dtype, head_dim, self.device).is_ok())
        };
        if fits(&builtin) {
            return builtin;
        }
        TileConfig::compiled_for(kernels[0], dtype, head_dim)
            .into_iter()
            .filter(fits)
            .max_by_key(|tile| (tile.block_m * tile.block_n, tile.stages))
            .unwrap_or(builtin)
    }
}

/// The built-in tiles.
impl TileConfig {
    /// The `f32` forward tile used when none is given, measured fastest on an H200 for each
    /// head_dim (see `PERFORMANCE.md`).
    pub fn default_for(head_dim: usize) -> Self {
        Self::default_for_dtype(DType::F32, head_dim)
    }

    /// The `f32` backward tile used when none is given (see `PERFORMANCE.md`).
    pub fn default_backward_for(head_dim: usize) -> Self {
        Self::default_backward_for_dtype(DType::F32, head_dim)
    }

    /// The forward tile used when none is given, per element type and head_dim, measured fastest
    /// on an H200 (see `PERFORMANCE.md`).
    /// A head_dim between the compiled ones gets the tile of the compiled one that runs it
    /// ([`TileConfig::padded_head_dim`]).
    pub fn default_for_dtype(dtype: DType, head_dim: usize) -> Self {
        let padded = Self::padded_head_dim(FlashKernel::Forward, dtype, head_dim).unwrap_or(head_dim);
        match (dtype, padded) {
            (DType::F32, 64) => Self::new(64, 64),
            (DType::F32, 256) => Self::new(32, 32),
            (DType::F32, _) => Self::new(64, 32),
            (_, 32 | 64) => Self::new(128, 64).with_stages(2),
            (_, 96) => Self::new(64, 64).with_stages(2),
            (_, 128) => Self::new(128, 32).with_stages(2),
            (_, _) => Self::new(64, 32).with_stages(2),
        }
    }

    /// The backward tile used when none is given, per element type and head_dim, measured fastest
    /// on an H200 with the dQ mode of [`DqAccumulation::fastest_for`] (see `PERFORMANCE.md`).
    /// A head_dim between the compiled ones gets the tile of the compiled one that runs it.
    pub fn default_backward_for_dtype(dtype: DType, head_dim: usize) -> Self {
        let padded = Self::padded_head_dim(FlashKernel::Backward, dtype, head_dim).unwrap_or(head_dim);
        match (dtype, padded) {
            (DType::F32, 128) => Self::new(64, 64),
            (DType::F32, 256) => Self::new(16, 32),
            (DType::F32, _) => Self::new(32, 64),
            (_, 32 | 64) => Self::new(64, 128).with_stages(2),
            (_, 256) => Self::new(32, 64).with_stages(2),
            (_, _) => Self::new(64, 64).with_stages(2),
        }
    }
}

impl DqAccumulation {
    /// The faster mode on an H200 for `dtype` (see `PERFORMANCE.md`): [`DqAccumulation::Atomic`]
    /// for `f32`; [`DqAccumulation::Deterministic`] for `f16` and `bf16`, whose second kernel
    /// recomputes S and dP on the tensor cores more cheaply than the K/V-outer kernel can add a
    /// 16-bit problem's dQ with `f32` atomics (at 4×16×4096×64 on the H200's sm_80 path: 3.52 ms
    /// against 3.83 ms; at head_dim 128 by 1.4×; only at 197 tokens does the atomic mode win,
    /// by under 1 %: PERFORMANCE.md, 2026-12-04 (later)).
    pub fn fastest_for(dtype: DType) -> Self {
        match dtype {
            DType::F32 => Self::Atomic,
            DType::F16 | DType::Bf16 => Self::Deterministic,
        }
    }
}

/// Keys below which the decoder does not split a sequence further: a split's fixed costs (its
/// first tiles' latency, the warps' merge, the partial store) then outweigh the parallelism it
/// adds (PERFORMANCE.md, issue 22).
pub const DECODE_MIN_SPLIT_KEYS: usize = 2048;

/// The decoder's number of splits (split-KV, `kernels/src/sm80/decode.rs`): how many blocks
/// share each sequence's keys, when the caller does not say ([`crate::DecodeOptions`]).
///
/// Without splits the grid has one block per sequence, K/V head and 16 packed query rows. When
/// that already fills four fifths of the GPU's block slots (`sm_count · blocks_per_sm`), one
/// split it is: splitting only adds the merge. Otherwise the count is the smallest whose last
/// wave is at least 95 % as full as the best count's (the waves' *efficiency*, `waves /
/// ceil(waves)`; FlashAttention's `num_splits_heuristic` reasons the same way with 85 %, which
/// on the H200 left 5–7 % on the table: PERFORMANCE.md, issue 22), among the counts that leave
/// every split at least [`DECODE_MIN_SPLIT_KEYS`] of the keys a row reads at most (the cache's
/// capacity, the lengths themselves living on the device; with a sliding window, the window's).
pub fn decode_splits(shape: &DecodeShape, sm_count: usize, blocks_per_sm: usize) -> usize {
    let base = DecodeShape { num_splits: 1, ..*shape }.blocks().max(1);
    let slots = (sm_count * blocks_per_sm).max(1);
    if 5 * base >= 4 * slots {
        return 1;
    }
    // A window's left edge bounds the keys a block visits: those of its rows' windows.
    let keys = shape.capacity.min(shape.window_left.saturating_add(shape.seqlen_q));
    let max_splits = (keys / DECODE_MIN_SPLIT_KEYS).clamp(1, 256).min(slots);
    let efficiency = |splits: usize| {
        let waves = (base * splits) as f64 / slots as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).map(efficiency).fold(0.0, f64::max);
    (1..=max_splits).find(|&s| efficiency(s) >= 0.95 * best).unwrap_or(1)
}

/// The Hopper forward's configurations (compiled instances: [`kernels::HOPPER_INSTANCES`]):
/// 64 query rows per consumer warpgroup, 128 keys per K/V tile, a two-stage ring.
pub(crate) struct HopperForward;

impl HopperForward {
    /// Keys up to which the head_dim-64 forward without a mask runs one consumer warpgroup per
    /// block (block_m 64): at most two 128-key tiles per block, where a block's serial prologue
    /// and epilogue weigh most (PERFORMANCE.md, "groundwork for issue 20").
    pub(crate) const SHORT_KEYS: usize = 256;

    /// Keys up to which the head_dim-64 forward without a mask runs one consumer warpgroup over
    /// 64-key tiles ([`Self::SHORT_BLOCK_N`]) when the last 128-key tile would be partial: five
    /// 128-key tiles. On an H100 it ran 4 % faster than block_m 192 at 577 keys (ViT-L/14 at
    /// 336 px), 28 % at 320, 3 % slower at 1000 (PERFORMANCE.md, 2026-12-07 "late night").
    pub(crate) const SHORT_RAGGED_KEYS: usize = 640;

    /// Keys up to which the head_dim-64 forward under a causal mask runs one consumer warpgroup
    /// over 64-key tiles: its finer units and tiles waste less of the diagonal and balance
    /// better. On an H100, 6 % faster than block_m 64 with 128-key tiles on GPT-2's
    /// [16, 12, 1024, 64] and than block_m 192 on [8, 12, 2048, 64] (PERFORMANCE.md, 2026-12-07
    /// "late night").
    pub(crate) const SHORT_CAUSAL_KEYS: usize = 2048;

    /// Keys up to which the head_dim-64 forward under a causal mask runs one consumer warpgroup
    /// at all, over 128-key tiles above [`Self::SHORT_CAUSAL_KEYS`]: at 4096 keys it ran 9 %
    /// faster than block_m 192 on [1, 12, 4096, 64] and as fast on [4, 16, 4096, 64]; longer
    /// sequences were not measured and keep block_m 192.
    pub(crate) const CAUSAL_KEYS: usize = 4096;

    /// Keys per K/V tile of the head_dim-64 forward with one consumer warpgroup where
    /// [`Self::head_dim_64_tile`] says so: 64, so that S and P take half the registers of a
    /// 128-key tile and three blocks share an SM (`kernels/src/configs.rs`,
    /// `SM90_FORWARD_REGISTERS_M64_N64`), each scheduler then holding three consumer warps to
    /// hide the softmax's dependent chain. A partial last key tile is then one of four instead
    /// of one of two, and a causal diagonal wastes half as much. Where the keys fill whole
    /// 128-key tiles without a mask, the wider tile's fewer steps win (−5 % at 256 keys).
    pub(crate) const SHORT_BLOCK_N: usize = 64;

    /// The head_dim-64 forward's (block_m, block_n, variant) for `seqlen_k` keys under `causal`,
    /// where `deep` says whether the grid is deep enough for three consumers
    /// ([`Self::waves_for_192_rows`]):
    ///
    /// | mask | keys | block_m | block_n |
    /// |---|---|---|---|
    /// | none | ≤ 640, not a multiple of 128 | 64 | 64 |
    /// | none | ≤ 256, a multiple of 128 | 64 | 128 |
    /// | causal | ≤ 2048 | 64 | 64 |
    /// | causal | ≤ 4096 | 64 | 128 |
    /// | either | more | 192 if `deep`, else 128 with ping-pong turns | 128 |
    fn head_dim_64_tile(seqlen_k: usize, causal: bool, deep: bool) -> (usize, usize, HopperVariant) {
        let ragged = !seqlen_k.is_multiple_of(128);
        // The table's rows, in its order.
        match causal {
            false if ragged && seqlen_k <= Self::SHORT_RAGGED_KEYS => (64, Self::SHORT_BLOCK_N, HopperVariant::Plain),
            false if seqlen_k <= Self::SHORT_KEYS => (64, 128, HopperVariant::Plain),
            true if seqlen_k <= Self::SHORT_CAUSAL_KEYS => (64, Self::SHORT_BLOCK_N, HopperVariant::Plain),
            true if seqlen_k <= Self::CAUSAL_KEYS => (64, 128, HopperVariant::Plain),
            _ if deep => (192, 128, HopperVariant::Plain),
            _ => (128, 128, HopperVariant::PingPong),
        }
    }

    /// The environment variable that overrides the grid choice of [`Self::grid`]: `1` for a
    /// persistent grid wherever it would have more than one wave, `static` for the same with
    /// the static snake order under a causal mask too (no unit counter), `0` for one block per
    /// unit. For measurements side by side (`benches/peers/`); unset, the policy decides.
    pub const PERSISTENT_ENV: &'static str = "RUST_ATTENTION_PERSISTENT";

    /// The environment variable that overrides [`Self::for_problem`]'s block_m (64, 128 or 192)
    /// where a configuration of that block_m is compiled for the head_dim; for measurements.
    pub const BLOCK_M_ENV: &'static str = "RUST_ATTENTION_HOPPER_BLOCK_M";

    /// The environment variable that overrides [`Self::for_problem`]'s block_n (keys per K/V
    /// tile) where a configuration of the chosen block_m with that block_n is compiled for the
    /// head_dim; for measurements.
    pub const BLOCK_N_ENV: &'static str = "RUST_ATTENTION_HOPPER_BLOCK_N";

    /// Blocks per streaming multiprocessor from which the three-consumer forward (block_m 192)
    /// runs at head_dim 64, without a mask and under a causal one. Its blocks are fewer and
    /// longer than those of the two-consumer one (block_m 128, ping-pong turns). On the H200
    /// (`PERFORMANCE.md`, 2026-11-29 "late"), without a mask it was 1.5× as fast on a grid of
    /// one wave (1 × 12 × 2048) and 1.25× on two (1 × 12 × 4096); causal, 1.2× on two waves and
    /// 13 % slower on one, where causal blocks differ most in length and fewer blocks leave more
    /// SMs idle at the end.
    pub(crate) const fn waves_for_192_rows(causal: bool) -> usize {
        if causal { 2 } else { 1 }
    }

    /// The kernel for `dtype`, `shape` and mask `causal` on a GPU of `sm_count` SMs: the
    /// configuration measured fastest for the head dimension, and at head_dim 64 for the keys,
    /// the mask and the grid's depth ([`Self::head_dim_64_tile`]; three consumers need a grid
    /// of [`Self::waves_for_192_rows`] and a head with rows for at least one block of 192,
    /// [`BalancedRows`]: below that the third consumer would have no rows in any block).
    ///
    /// # Errors
    /// [`Error::Shape`] for `f32`, [`Error::HeadDimNotCompiled`] for other head dimensions.
    pub(crate) fn for_problem(
        dtype: DType,
        shape: &AttentionShape,
        causal: Causal,
        sm_count: usize,
    ) -> Result<&'static HopperInstance> {
        let head_dim = shape.head_dim;
        // The compiled head_dim that runs this one (0: none, which the lookup below reports).
        let padded = kernels::hopper_head_dim(FlashKernel::Forward, head_dim).unwrap_or(0);
        let rows = BalancedRows::<192>::new(shape.seqlen_q);
        let blocks_192 = rows.blocks * shape.num_heads_q * shape.batch;
        let waves = Self::waves_for_192_rows(causal != Causal::None);
        let rows_192 = padded == 64 && rows.full > 0 && blocks_192 >= waves * sm_count;
        if dtype == DType::F32 {
            return Err(Error::Shape("the Hopper forward takes f16 or bf16 tensors".into()));
        }
        // At head_dim 64 by keys, mask and grid depth ([`Self::head_dim_64_tile`]); two consumers
        // without turns over the widest key tile compiled at every other head_dim (128 up to
        // head_dim 128, fewer above: the configuration table's).
        let widest = kernels::hopper_forward_block_n(padded).unwrap_or(128);
        let (mut block_m, mut block_n, mut variant) = if padded == 64 {
            Self::head_dim_64_tile(shape.seqlen_k, causal != Causal::None, rows_192)
        } else {
            (128, widest, HopperVariant::Plain)
        };
        let instance =
            |tile, variant| kernels::hopper_instance(FlashKernel::Forward, dtype, tile, head_dim, 2, variant);
        let compiled = |tile, variant| instance(tile, variant).is_some();
        // A measurement may ask for another compiled block_m (the head_dim-64 block_m 128 is the
        // ping-pong one), keeping the block_n where that is compiled for it.
        if let Some(wanted) = block_m_override().filter(|&m| m != block_m) {
            let turns = if wanted == 128 && padded == 64 { HopperVariant::PingPong } else { HopperVariant::Plain };
            let n = if compiled((wanted, block_n), turns) { block_n } else { widest };
            if compiled((wanted, n), turns) {
                (block_m, block_n, variant) = (wanted, n, turns);
            }
        }
        if let Some(wanted) = block_n_override().filter(|&n| compiled((block_m, n), variant)) {
            block_n = wanted;
        }
        instance((block_m, block_n), variant).ok_or_else(|| Error::HeadDimNotCompiled {
            head_dim,
            allowed: format!(
                "multiples of 8 up to {} (the Hopper forward; the others run on the sm_80 kernels)",
                kernels::hopper_head_dims(FlashKernel::Forward).last().copied().unwrap_or(0)
            ),
        })
    }
}

/// The grid of a Hopper forward launch ([`HopperForward::grid`]): `blocks` blocks share out
/// `units` work units (query blocks of every head) as the kernel's `PersistentUnits` says,
/// drawing them from a counter (`dynamic`) or in the static snake order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ForwardGrid {
    pub(crate) units: usize,
    pub(crate) blocks: usize,
    pub(crate) dynamic: bool,
}

impl ForwardGrid {
    /// Whether a block takes more than one unit.
    pub(crate) fn persistent(&self) -> bool {
        self.blocks < self.units
    }
}

impl HopperForward {
    /// The grid for `kernel` on `shape` under `causal` on a GPU of `sm_count` SMs: persistent
    /// (as many blocks as are resident at once, `sm_count × kernel.blocks_per_sm`, each taking
    /// units in turn) when the units are more than that, else one block per unit;
    /// [`Self::PERSISTENT_ENV`] can override it. Persistent blocks overlap one unit's epilogue
    /// with the next one's loads. A persistent grid under a causal mask, whose units differ in
    /// length, draws them dynamically from a counter; without a mask the static snake order
    /// balances as well and needs no counter (PERFORMANCE.md, issue 20, has the measurements
    /// behind the choices).
    pub(crate) fn grid(
        kernel: &HopperInstance,
        shape: &AttentionShape,
        causal: Causal,
        sm_count: usize,
    ) -> ForwardGrid {
        let units = shape.seqlen_q.div_ceil(kernel.block_m) * shape.num_heads_q * shape.batch;
        let choice = persistent_override();
        let persistent = choice != Some(GridOverride::OneBlockPerUnit);
        let resident = (sm_count * kernel.blocks_per_sm).max(1);
        let blocks = if persistent { units.min(resident) } else { units };
        let dynamic = blocks < units && causal != Causal::None && choice != Some(GridOverride::StaticPersistent);
        ForwardGrid { units, blocks, dynamic }
    }
}

/// What [`HopperForward::PERSISTENT_ENV`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GridOverride {
    /// `1`: persistent, units drawn as the policy says.
    Persistent,
    /// `static`: persistent, units in the static snake order even under a causal mask.
    StaticPersistent,
    /// `0`: one block per unit.
    OneBlockPerUnit,
}

/// [`HopperForward::PERSISTENT_ENV`], read once; `None` when unset or anything else.
fn persistent_override() -> Option<GridOverride> {
    static OVERRIDE: std::sync::OnceLock<Option<GridOverride>> = std::sync::OnceLock::new();
    *OVERRIDE.get_or_init(|| match std::env::var(HopperForward::PERSISTENT_ENV).as_deref() {
        Ok("1") => Some(GridOverride::Persistent),
        Ok("static") => Some(GridOverride::StaticPersistent),
        Ok("0") => Some(GridOverride::OneBlockPerUnit),
        _ => None,
    })
}

/// Whether [`HopperBackward::DETERMINISTIC_ENV`] is `0`, read once.
fn sm80_deterministic_override() -> bool {
    static OVERRIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OVERRIDE.get_or_init(|| std::env::var(HopperBackward::DETERMINISTIC_ENV).as_deref() == Ok("0"))
}

/// [`HopperForward::BLOCK_M_ENV`], read once.
fn block_m_override() -> Option<usize> {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *OVERRIDE.get_or_init(|| std::env::var(HopperForward::BLOCK_M_ENV).ok()?.parse().ok())
}

/// [`HopperForward::BLOCK_N_ENV`], read once.
fn block_n_override() -> Option<usize> {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *OVERRIDE.get_or_init(|| std::env::var(HopperForward::BLOCK_N_ENV).ok()?.parse().ok())
}

/// The Hopper backward's configurations: 128 keys per block (64 above head_dim 128, the
/// instance's `block_n`), query tiles of 64, 384 threads.
pub(crate) struct HopperBackward;

impl HopperBackward {
    /// Query rows per tile of the inner loop. (Keys per block: the instance's `block_n`, 128 up
    /// to head_dim 128 and 64 above, `layout::hopper_backward_block_n`.)
    pub(crate) const BLOCK_M: usize = 64;
    /// Threads per block: a producer and two consumer warpgroups.
    pub(crate) const THREADS: usize = 384;

    /// The environment variable that makes [`Context::flash_attention_backward`] run
    /// [`DqAccumulation::Deterministic`] on the sm_80 deterministic kernels on the sm_90a path
    /// too: `0` (a fallback and a point of comparison). Otherwise that mode runs the deterministic
    /// Hopper kernel, [`Context::flash_attention_backward_hopper`]'s with a deterministic `dq`.
    ///
    /// [`Context::flash_attention_backward`]: crate::Context::flash_attention_backward
    /// [`Context::flash_attention_backward_hopper`]: crate::Context::flash_attention_backward_hopper
    pub const DETERMINISTIC_ENV: &'static str = "RUST_ATTENTION_HOPPER_DETERMINISTIC";

    /// The kernel for `dtype`, `head_dim` and the dQ mode: dQ tiles added as they come
    /// ([`DqAccumulation::Atomic`]) or in turns ([`DqAccumulation::Deterministic`], up to head_dim
    /// 128; above, the wide-head kernel has only the first).
    ///
    /// # Errors
    /// As [`HopperForward::for_problem`].
    pub(crate) fn for_problem(dtype: DType, head_dim: usize, dq: DqAccumulation) -> Result<&'static HopperInstance> {
        if dtype == DType::F32 {
            return Err(Error::Shape("the Hopper backward takes f16 or bf16 tensors".into()));
        }
        let padded = kernels::hopper_head_dim(FlashKernel::Backward, head_dim).unwrap_or(head_dim);
        let tile = (Self::BLOCK_M, layout::hopper_backward_block_n(padded));
        let variant = match dq {
            DqAccumulation::Atomic => HopperVariant::Plain,
            DqAccumulation::Deterministic => HopperVariant::Deterministic,
        };
        kernels::hopper_instance(FlashKernel::Backward, dtype, tile, head_dim, 2, variant).ok_or_else(|| {
            // The largest head_dim compiled in this dQ mode.
            let largest = kernels::HOPPER_INSTANCES
                .iter()
                .filter(|i| i.kernel == FlashKernel::Backward && i.variant == variant)
                .map(|i| i.head_dim)
                .max()
                .unwrap_or(0);
            Error::HeadDimNotCompiled {
                head_dim,
                allowed: format!(
                    "multiples of 8 up to {largest} (the Hopper backward with {dq:?} dQ; the others run on the sm_80 \
                     kernels)"
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{MODULE_ARCHS, PTX, module_of};
    use crate::layout::{
        hopper_backward_smem_bytes, hopper_forward_q_slots, hopper_forward_smem_bytes, hopper_forward_threads,
    };
    use attn_kernels::attention::schedule::by_sections;

    /// The rows of every block of a head, in block order, for `BLOCK_M`.
    fn balanced_blocks<const BLOCK_M: usize>(seqlen_q: usize) -> Vec<(usize, usize)> {
        let rows = BalancedRows::<BLOCK_M>::new(seqlen_q);
        (0..rows.blocks).map(|b| rows.block(b)).collect()
    }

    #[test]
    fn balanced_blocks_cover_each_row_once_and_differ_by_at_most_a_warpgroup() {
        for seqlen_q in (1..=1000).chain([4096, 8192, 8193]) {
            for (block_m, blocks) in [(128, balanced_blocks::<128>(seqlen_q)), (192, balanced_blocks::<192>(seqlen_q))]
            {
                assert_eq!(blocks.len(), seqlen_q.div_ceil(block_m), "{seqlen_q} rows, block_m {block_m}");
                let mut next = 0;
                for (i, &(start, rows)) in blocks.iter().enumerate() {
                    assert_eq!(start, next, "{seqlen_q} rows, block_m {block_m}: block {i} starts at {start}");
                    assert!((1..=block_m).contains(&rows), "{seqlen_q} rows, block_m {block_m}: {rows}");
                    // Only the last block may be shorter than block_m − 64 (the rows run out).
                    assert!(rows + 64 >= block_m || i + 1 == blocks.len(), "{seqlen_q} rows: block {i}: {rows}");
                    next += rows;
                }
                assert_eq!(next, seqlen_q);
            }
        }
        // The case the balance is for: 4096 rows in 20 blocks of 192 and 2 of 128, not 21 and 64.
        let blocks = balanced_blocks::<192>(4096);
        assert!(blocks[..20].iter().all(|b| b.1 == 192) && blocks[20..].iter().all(|b| b.1 == 128));
    }

    #[test]
    fn the_longest_first_order_runs_every_block_once() {
        for (seqlen_q, heads) in [(4096, 64), (200, 3), (1, 5), (1000, 7), (8192, 32)] {
            let rows = BalancedRows::<192>::new(seqlen_q);
            for section in [None, Some(1), Some(4), Some(16), Some(1000)] {
                let mut seen = vec![false; rows.blocks * heads];
                let order: Vec<_> = (0..rows.blocks * heads).map(|l| rows.longest_first(l, heads, section)).collect();
                for &(q_block, head) in &order {
                    assert!(q_block < rows.blocks && head < heads, "{seqlen_q} × {heads}, {section:?}");
                    assert!(!std::mem::replace(&mut seen[head * rows.blocks + q_block], true));
                }
                // Longest first within a section: causal, the later query block (it sees more
                // keys); otherwise the full blocks before the short ones.
                let length = |&(q_block, _): &(usize, usize)| match section {
                    Some(_) => q_block,
                    None => usize::from(q_block < rows.full),
                };
                let section_of = |&(_, head): &(usize, usize)| section.map_or(0, |s| head / s.clamp(1, heads));
                for pair in order.windows(2) {
                    if section_of(&pair[0]) == section_of(&pair[1]) {
                        assert!(length(&pair[0]) >= length(&pair[1]), "{seqlen_q} × {heads}, {section:?}: {pair:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn persistent_blocks_take_every_unit_once_and_the_grid_agrees_with_the_kernel() {
        use attn_kernels::attention::schedule::{ForwardOrder, PersistentUnits};
        for units in [1, 2, 5, 131, 132, 133, 264, 1000, 6144] {
            for blocks in [1, 2, 7, 132, 264] {
                let blocks = blocks.min(units);
                let mut seen = vec![0; units];
                for block in 0..blocks {
                    for unit in PersistentUnits::of_block(block, blocks, units, std::ptr::null_mut()) {
                        seen[unit] += 1;
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{units} units, {blocks} blocks");
                // Dynamic: the blocks draw tickets in an order of their own (here the block
                // after the one that drew last, skipping the ones that are done).
                let mut counter = 0u32;
                let counter: *mut u32 = &mut counter;
                let mut grid: Vec<_> =
                    (0..blocks).map(|b| PersistentUnits::of_block(b, blocks, units, counter)).collect();
                let mut seen = vec![0; units];
                let mut running: Vec<usize> = (0..blocks).collect();
                let mut turn = 0;
                while !running.is_empty() {
                    let at = (turn * 7) % running.len();
                    match grid[running[at]].next() {
                        Some(unit) => seen[unit] += 1,
                        None => {
                            running.remove(at);
                        }
                    }
                    turn += 1;
                }
                assert!(seen.iter().all(|&n| n == 1), "dynamic: {units} units, {blocks} blocks");
            }
        }
        // The host's unit count is the kernel's, for every block_m it launches.
        for (seqlen_q, heads) in [(1, 1), (17, 3), (197, 12), (577, 16), (1023, 2), (4096, 16)] {
            let shape =
                AttentionShape { batch: 2, num_heads_q: heads, num_heads_kv: 1, seqlen_q, seqlen_k: 100, head_dim: 64 };
            for kernel in kernels::HOPPER_INSTANCES.iter().filter(|i| i.kernel == FlashKernel::Forward) {
                let device = match kernel.block_m {
                    64 => ForwardOrder::<64>::new(&shape, false).units(),
                    128 => ForwardOrder::<128>::new(&shape, false).units(),
                    192 => ForwardOrder::<192>::new(&shape, false).units(),
                    other => panic!("block_m {other} missing from this test"),
                };
                let grid = HopperForward::grid(kernel, &shape, Causal::None, H200_SMS);
                assert_eq!(grid.units, device, "{}", kernel.entry);
                assert!(grid.blocks >= 1 && grid.blocks <= grid.units, "{}", kernel.entry);
            }
        }
    }

    #[test]
    fn sections_of_heads_cover_the_grid_once_longest_first() {
        for (blocks, heads) in [(32, 64), (1, 1), (7, 5), (64, 12)] {
            for section in [0, 1, 3, 8, 64, 1000] {
                let order: Vec<_> = (0..blocks * heads).map(|l| by_sections(l, blocks, heads, section)).collect();
                let mut seen = vec![false; blocks * heads];
                for &(rank, head) in &order {
                    assert!(rank < blocks && head < heads);
                    assert!(!std::mem::replace(&mut seen[head * blocks + rank], true), "{blocks} × {heads}, {section}");
                }
                // Within a section the ranks never go back (rank 0, the longest, first).
                let section_of = |head: usize| head / section.clamp(1, heads);
                for pair in order.windows(2) {
                    if section_of(pair[0].1) == section_of(pair[1].1) {
                        assert!(pair[0].0 <= pair[1].0, "{blocks} × {heads}, {section}: {pair:?}");
                    }
                }
            }
        }
    }

    /// The `.maxntid` x value the build script wrote after `entry`'s parameter list, if any.
    fn max_threads(entry: &str) -> Option<usize> {
        let ptx = PTX[module_of(entry)];
        let start = ptx.find(&format!(".entry {entry}("))?;
        let body = &ptx[start..];
        let header = &body[..body.find('{')?];
        let line = header.lines().find_map(|l| l.trim().strip_prefix(".maxntid "))?;
        line.split(',').next()?.trim().parse().ok()
    }

    /// A Hopper's shared memory per block (227 KiB).
    const HOPPER_SHARED_MEMORY: usize = crate::layout::HOPPER_SMEM_PER_BLOCK;

    /// A problem of `head_dim` whose grid is `blocks` blocks of 192 query rows deep, with more
    /// keys than [`HopperForward::CAUSAL_KEYS`].
    fn shape_of(head_dim: usize, blocks: usize) -> AttentionShape {
        let seqlen_k = HopperForward::CAUSAL_KEYS + 1;
        AttentionShape { batch: blocks, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 192, seqlen_k, head_dim }
    }

    /// The H200's streaming multiprocessors.
    const H200_SMS: usize = 132;

    #[test]
    fn every_hopper_configuration_is_compiled_with_its_launch_bounds_and_fits() {
        let waves = |w: usize| w * H200_SMS;
        for dtype in [DType::F16, DType::Bf16] {
            // Both head_dim-64 forwards: grids just short of and at the depth for three consumers,
            // with and without a mask.
            let grids = [
                (64, waves(1) - 1, false),
                (64, waves(1), false),
                (64, waves(2) - 1, true),
                (64, waves(2), true),
                (80, waves(1), false),
                (96, waves(2), true),
                (128, waves(1), false),
                (160, waves(2), false),
                (192, waves(2), false),
                (256, waves(2), true),
            ];
            for (head_dim, blocks, causal) in grids {
                let shape = shape_of(head_dim, blocks);
                let mask = if causal { Causal::TopLeft } else { Causal::None };
                let forward = HopperForward::for_problem(dtype, &shape, mask, H200_SMS).unwrap();
                assert_eq!(MODULE_ARCHS[module_of(forward.entry)], "sm_90a", "{}", forward.entry);
                // setmaxnreg needs the block size ptxas budgets registers for.
                assert_eq!(
                    max_threads(forward.entry),
                    Some(hopper_forward_threads(forward.block_m)),
                    "{}",
                    forward.entry
                );
                let smem = hopper_forward_smem_bytes(forward.block_m, forward.block_n, head_dim, forward.stages);
                assert!(smem <= HOPPER_SHARED_MEMORY, "{}: {smem} bytes", forward.entry);
                // Two Q slots, so that a persistent block loads its next unit early, where they
                // add no spills: at head_dim 80 and 96 here (block_m 64 below).
                let q_slots = hopper_forward_q_slots(forward.block_m, forward.block_n, head_dim, forward.stages);
                let two = matches!(head_dim, 80 | 96);
                assert_eq!(q_slots, if two { 2 } else { 1 }, "{}", forward.entry);
                // The entry names the configuration the host launches it with.
                let (m, n, stages) = (forward.block_m, forward.block_n, forward.stages);
                assert!(forward.entry.contains(&format!("_m{m}_n{n}_d{head_dim}_s{stages}")), "{}", forward.entry);
                let pingpong = forward.variant == HopperVariant::PingPong;
                assert_eq!(forward.entry.ends_with("_pingpong"), pingpong, "{}", forward.entry);
                let deep = head_dim == 64 && blocks >= waves(HopperForward::waves_for_192_rows(causal));
                assert_eq!(forward.block_m, if deep { 192 } else { 128 }, "{}", forward.entry);
                // Under a causal mask one consumer, over 64-key tiles up to 2048 keys and 128-key
                // ones up to 4096.
                for (seqlen_k, block_n) in [(HopperForward::SHORT_CAUSAL_KEYS, 64), (HopperForward::CAUSAL_KEYS, 128)] {
                    let causal_short = AttentionShape { seqlen_k, ..shape };
                    let causal_forward = HopperForward::for_problem(dtype, &causal_short, mask, H200_SMS).unwrap();
                    if head_dim == 64 && causal {
                        let tile = (causal_forward.block_m, causal_forward.block_n);
                        assert_eq!(tile, (64, block_n), "{}", causal_forward.entry);
                    }
                }
                // Short keys at head_dim 64 (ViT-B's 197, a partial last tile): one consumer and
                // 64-key tiles, sized for three blocks per SM.
                let short = AttentionShape { seqlen_k: 197, ..shape };
                let short_forward = HopperForward::for_problem(dtype, &short, mask, H200_SMS).unwrap();
                if head_dim == 64 {
                    assert_eq!(short_forward.block_m, 64, "{}", short_forward.entry);
                    assert_eq!(max_threads(short_forward.entry), Some(hopper_forward_threads(64)));
                    let smem = hopper_forward_smem_bytes(64, short_forward.block_n, head_dim, short_forward.stages);
                    assert_eq!(short_forward.block_n, HopperForward::SHORT_BLOCK_N, "{}", short_forward.entry);
                    assert_eq!(short_forward.blocks_per_sm, 3, "{}", short_forward.entry);
                    assert!(3 * smem <= HOPPER_SHARED_MEMORY, "{}: three blocks of {smem} bytes", short_forward.entry);
                    let q_slots = hopper_forward_q_slots(64, short_forward.block_n, head_dim, short_forward.stages);
                    assert_eq!(q_slots, 2, "{}", short_forward.entry);
                    // Whole 128-key tiles without a mask keep them; a causal mask does not. Up to
                    // five partial ones the 64-key tiles run too.
                    let ragged = AttentionShape { seqlen_k: HopperForward::SHORT_RAGGED_KEYS - 63, ..shape };
                    let ragged_forward = HopperForward::for_problem(dtype, &ragged, mask, H200_SMS).unwrap();
                    assert_eq!((ragged_forward.block_m, ragged_forward.block_n), (64, 64), "{}", ragged_forward.entry);
                    let whole = AttentionShape { seqlen_k: HopperForward::SHORT_KEYS, ..shape };
                    let whole_forward = HopperForward::for_problem(dtype, &whole, mask, H200_SMS).unwrap();
                    let block_n = if causal { HopperForward::SHORT_BLOCK_N } else { 128 };
                    assert_eq!(
                        (whole_forward.block_m, whole_forward.block_n),
                        (64, block_n),
                        "{}",
                        whole_forward.entry
                    );
                }

                // (The Hopper backward's deterministic mode stops at head_dim 128.)
                for dq in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                    let Ok(backward) = HopperBackward::for_problem(dtype, head_dim, dq) else {
                        assert!(
                            head_dim > 128 && dq == DqAccumulation::Deterministic,
                            "no Hopper backward at head_dim {head_dim}, {dq:?}"
                        );
                        continue;
                    };
                    assert_eq!(backward.block_n, layout::hopper_backward_block_n(head_dim), "{}", backward.entry);
                    assert_eq!(MODULE_ARCHS[module_of(backward.entry)], "sm_90a", "{}", backward.entry);
                    assert_eq!(max_threads(backward.entry), Some(HopperBackward::THREADS), "{}", backward.entry);
                    let smem = hopper_backward_smem_bytes(head_dim, backward.stages);
                    assert!(smem <= HOPPER_SHARED_MEMORY, "{}: {smem} bytes", backward.entry);
                    let deterministic = dq == DqAccumulation::Deterministic;
                    assert_eq!(backward.entry.ends_with("_deterministic"), deterministic, "{}", backward.entry);
                }
            }
        }
    }

    #[test]
    fn hopper_configurations_refuse_f32_and_other_head_dims() {
        assert!(matches!(
            HopperForward::for_problem(DType::F32, &shape_of(64, 1), Causal::None, H200_SMS),
            Err(Error::Shape(_))
        ));
        assert!(matches!(HopperBackward::for_problem(DType::F32, 128, DqAccumulation::Atomic), Err(Error::Shape(_))));
        assert!(matches!(
            HopperForward::for_problem(DType::F16, &shape_of(100, 1), Causal::None, H200_SMS),
            Err(Error::HeadDimNotCompiled { head_dim: 100, .. })
        ));
        assert!(matches!(
            HopperForward::for_problem(DType::F16, &shape_of(264, 1), Causal::None, H200_SMS),
            Err(Error::HeadDimNotCompiled { head_dim: 264, .. })
        ));
        assert!(matches!(
            HopperBackward::for_problem(DType::Bf16, 256, DqAccumulation::Deterministic),
            Err(Error::HeadDimNotCompiled { head_dim: 256, .. })
        ));
    }
}

#[cfg(test)]
mod profile_tests {
    use super::*;
    use crate::device::GpuProfile;

    /// The device the profiles are applied to.
    fn h200() -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            max_shared_memory_per_block: crate::layout::HOPPER_SMEM_PER_BLOCK,
            total_memory: 141 << 30,
        }
    }

    /// Under every GPU profile, the default tile of every pass fits: for each element type the
    /// profile's GPU supports (no `bf16` on the T4), a spread of head dims (compiled ones, padded
    /// ones between them, the extremes) and both dQ modes (the small backward tiles of
    /// `sm80_padded_backward_tiles!` are what make the 16-bit ones fit 99 and 64 KiB). The T4's
    /// 64 KiB hold no tile above head_dim 192 in `f16` (the forward's smallest, (64, 16) with two
    /// stages, needs 66 KiB at 256) nor above 128 in the `f32` backward: there the defaults are
    /// checked to be refused ([`t4_limit`]). On the H200 itself the defaults are the built-in
    /// tiles.
    #[test]
    fn default_tiles_fit_every_profile() {
        let h200 = h200();
        let head_dims = [1, 8, 17, 32, 40, 64, 72, 80, 96, 100, 120, 128, 136, 160, 192, 200, 248, 256];
        let mut failures = Vec::new();
        for profile in GpuProfile::ALL {
            let device = profile.apply(&h200);
            let target = Target { path: KernelPath::Sm80, device: &device };
            for dtype in DType::ALL.into_iter().filter(|&dtype| device.supports(dtype)) {
                for head_dim in head_dims {
                    let limit = |backward| if profile.name == "t4" { t4_limit(dtype, backward) } else { 256 };
                    let forward = target.forward_tile(dtype, head_dim);
                    let fits = forward.validate_kernel(FlashKernel::Forward, dtype, head_dim, &device).is_ok();
                    if fits != (head_dim <= limit(false)) {
                        failures.push(format!("{}: {dtype} forward d{head_dim} {forward}", profile.name));
                    }
                    for dq in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                        let tile = target.backward_tile(dtype, head_dim, dq);
                        let fits = kernels::backward_kernels(dq)
                            .iter()
                            .all(|&kernel| tile.validate_kernel(kernel, dtype, head_dim, &device).is_ok());
                        if fits != (head_dim <= limit(true)) {
                            failures.push(format!("{}: {dtype} {dq:?} d{head_dim} {tile} does not fit", profile.name));
                        }
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{} defaults do not fit:\n{}", failures.len(), failures.join("\n"));
        let target = Target { path: KernelPath::Sm90a, device: &h200 };
        for dtype in DType::ALL {
            for head_dim in head_dims {
                assert_eq!(target.forward_tile(dtype, head_dim), TileConfig::default_for_dtype(dtype, head_dim));
                let dq = DqAccumulation::fastest_for(dtype);
                assert_eq!(
                    target.backward_tile(dtype, head_dim, dq),
                    TileConfig::default_backward_for_dtype(dtype, head_dim)
                );
            }
        }
    }

    /// The largest head_dim whose pass has a compiled tile within a T4's 64 KiB a block.
    fn t4_limit(dtype: DType, backward: bool) -> usize {
        match (dtype, backward) {
            (DType::F32, true) => 128,
            (DType::F32, false) => 256,
            _ => 192,
        }
    }

    #[test]
    fn profiles_cap_shared_memory_and_name_themselves() {
        let device = h200();
        let a100: GpuProfile = "a100".parse().unwrap();
        let limited = a100.apply(&device);
        assert_eq!((limited.max_shared_memory_per_block, limited.compute_capability), (163 * 1024, (8, 0)));
        assert_eq!(limited.name, "NVIDIA H200 as A100");
        assert_eq!(limited.sm_count, 132);
        assert!("h100".parse::<GpuProfile>().unwrap_err().contains("rtx3090"));
    }
}

#[cfg(test)]
mod decode_split_tests {
    use super::*;

    fn shape(batch: usize, heads: (usize, usize), capacity: usize) -> DecodeShape {
        DecodeShape {
            batch,
            num_heads_q: heads.0,
            num_heads_kv: heads.1,
            seqlen_q: 1,
            head_dim: 128,
            capacity,
            num_splits: 1,
            ..DecodeShape::default()
        }
    }

    /// The counts the H200 measurements chose (PERFORMANCE.md, issue 22): 132 SMs, 2 blocks each.
    #[test]
    fn splits_fill_the_slots_but_keep_splits_long() {
        assert_eq!(decode_splits(&shape(8, (32, 8), 8192), 132, 2), 4);
        assert_eq!(decode_splits(&shape(1, (32, 32), 32768), 132, 2), 8);
        assert_eq!(decode_splits(&shape(1, (64, 8), 131072), 132, 2), 32);
        assert_eq!(decode_splits(&shape(64, (32, 8), 1024), 132, 2), 1);
        // Short sequences are not split below DECODE_MIN_SPLIT_KEYS.
        assert_eq!(decode_splits(&shape(32, (32, 8), 2048), 132, 3), 1);
        assert_eq!(decode_splits(&shape(1, (8, 8), 1000), 132, 2), 1);
        // Never more splits than slots, at most 256.
        assert!(decode_splits(&shape(1, (1, 1), 1 << 24), 132, 2) <= 256);
    }
}

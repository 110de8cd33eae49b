//! **Base layer.** The problem (shapes, scale, mask, dQ mode) and tile (block sizes)
//! descriptions, validated on the host. Which tiles are compiled and fit a device is the
//! registry's ([`crate::kernels`]), which tile and kernel a problem gets the selection policy's
//! ([`crate::select`]); both add their methods to [`TileConfig`] there.

use crate::error::{Error, Result};
pub use crate::layout::AttentionShape;

/// CUDA's limit on the y and z dimensions of a grid; the flash kernel puts heads on y and the
/// batch on z.
const MAX_GRID_YZ: usize = 65_535;

/// Causal masking: which keys a query may attend to.
///
/// With `seqlen_q == seqlen_k` both causal variants are the usual "query i sees keys 0..=i".
/// They differ when the lengths differ:
///
/// * [`Causal::TopLeft`]: query i sees keys `j ≤ i`, the mask's diagonal starting at the top-left
///   corner of the `seqlen_q × seqlen_k` score matrix (PyTorch's `is_causal=True`). With
///   `seqlen_q > seqlen_k` the last queries see every key; with `seqlen_q < seqlen_k` the last keys
///   are seen by nobody.
/// * [`Causal::BottomRight`]: query i sees keys `j ≤ i + seqlen_k − seqlen_q`, the diagonal ending
///   at the bottom-right corner (FlashAttention ≥ 2.1; decoding with a KV cache: the last query
///   sees every key). With `seqlen_q > seqlen_k` the first `seqlen_q − seqlen_k` queries see no key.
///
/// A query that sees no key gets O = 0 and LSE = −∞, and contributes nothing to the gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Causal {
    /// Every query sees every key.
    #[default]
    None,
    /// Query i sees keys j ≤ i.
    TopLeft,
    /// Query i sees keys j ≤ i + seqlen_k − seqlen_q.
    BottomRight,
}

impl Causal {
    /// The kernels' two mask arguments: whether to mask (0 or 1) and the diagonal's offset, so
    /// that key j is visible to query i iff `j ≤ i + offset`.
    pub(crate) fn kernel_args(self, shape: &AttentionShape) -> (usize, isize) {
        match self {
            Self::None => (0, 0),
            Self::TopLeft => (1, 0),
            Self::BottomRight => (1, shape.seqlen_k as isize - shape.seqlen_q as isize),
        }
    }

    /// Whether key `key` is visible to query `query` (the definition above).
    pub fn visible(self, query: usize, key: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        match self {
            Self::None => true,
            Self::TopLeft => key <= query,
            Self::BottomRight => key as isize <= query as isize + seqlen_k as isize - seqlen_q as isize,
        }
    }
}

/// Options shared by every attention entry point.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies Q Kᵀ before the softmax; `None` means 1/√head_dim.
    pub scale: Option<f32>,
    /// Causal mask; see [`Causal`].
    pub causal: Causal,
    /// Whether [`Context::attention_backward`](crate::Context::attention_backward) sums dQ in a
    /// fixed order ([`DqAccumulation::Deterministic`]: bit-identical on every run) rather than
    /// in the faster mode. The forward passes are deterministic either way; the calls with an
    /// explicit dQ mode ([`Context::flash_attention_backward`](crate::Context::flash_attention_backward))
    /// take theirs instead.
    pub deterministic: bool,
}

impl AttentionOptions {
    /// These options with a deterministic backward pass ([`AttentionOptions::deterministic`]).
    pub fn deterministic(self) -> Self {
        Self { deterministic: true, ..self }
    }

    /// Options with an explicit softmax scale.
    pub fn with_scale(scale: f32) -> Self {
        Self { scale: Some(scale), ..Self::default() }
    }

    /// Options with a causal mask.
    pub fn causal(causal: Causal) -> Self {
        Self { causal, ..Self::default() }
    }

    /// The scale to use for `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// [`AttentionOptions::scale_for`], checked: every entry point calls this before a launch.
    ///
    /// # Errors
    /// [`Error::InvalidScale`] for a NaN or infinite scale (every kernel would return garbage,
    /// each a different garbage).
    pub fn checked_scale(&self, head_dim: usize) -> Result<f32> {
        let scale = self.scale_for(head_dim);
        if scale.is_finite() { Ok(scale) } else { Err(Error::InvalidScale { scale }) }
    }

    /// Floating-point operations of one forward pass in the field's convention: 4 · batch ·
    /// heads · seqlen_q · seqlen_k · head_dim, halved for a causal mask. The backward pass counts
    /// 2.5 times this.
    pub fn forward_flops(&self, shape: &AttentionShape) -> f64 {
        let full = shape.forward_flops();
        if self.causal == Causal::None { full } else { full / 2.0 }
    }
}

/// How the FlashAttention backward pass accumulates dQ. Which is faster depends on the kernels:
/// [`DqAccumulation::fastest_for`] gives the measured choice per element type, and
/// [`Context::dq_accumulation_for`](crate::Context::dq_accumulation_for) the one for a device
/// (`select.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DqAccumulation {
    /// The K/V-outer kernel adds each key tile's share of dQ to device memory with atomic adds
    /// (for `f16`/`bf16` into an `f32` copy of dQ, rounded by a last small kernel): no second
    /// pass over the tiles, the faster mode for `f32`, but the additions land in a different
    /// order on every run, so the last bits of dQ can differ between runs (dK and dV never do).
    #[default]
    Atomic,
    /// dQ summed in a fixed order: bit-identical results on every run. The sm_80 kernels run a
    /// second kernel, outer loop over query tiles, that recomputes P and dS; the Hopper kernel
    /// adds each dQ tile in turns, key block after key block (FlashAttention-3's way).
    Deterministic,
}

impl DqAccumulation {
    /// The mode's name on the command line and in tables: `atomic`, `deterministic`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Atomic => "atomic",
            Self::Deterministic => "deterministic",
        }
    }
}

impl std::str::FromStr for DqAccumulation {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Self::Atomic, Self::Deterministic]
            .into_iter()
            .find(|mode| mode.name() == s)
            .ok_or_else(|| format!("`{s}` is not one of atomic, deterministic"))
    }
}

/// Tile sizes of the FlashAttention kernels: `block_m` query rows per block (the paper's Br),
/// `block_n` key/value rows per shared-memory tile (Bc) and, for the tensor-core kernels
/// (`f16`, `bf16`), `stages`: the slots of the `cp.async` ring that streams tiles in while earlier
/// ones are used. The number of warps follows from the tile: 4 for the `f32` kernels and the
/// tensor-core forward (whose warps each own `block_m / 64` m-tiles of 16 query rows); for the
/// other tensor-core kernels one per 16 rows of the dimension a block owns (`block_m / 16` in the
/// dQ kernel, `block_n / 16` in the K/V-outer backward kernels; see [`TileConfig::warps`]).
///
/// Each compiled (kernel, dtype, block_m, block_n, head_dim, stages) is a separate kernel;
/// [`TileConfig::validate_kernel`] says which exist and fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TileConfig {
    /// Query rows per query tile (Br); a multiple of 16.
    pub block_m: usize,
    /// Key/value rows per key tile (Bc); a multiple of 16 in the compiled set.
    pub block_n: usize,
    /// Pipeline stages of the tensor-core kernels (2 or 3); 1 for the `f32` kernels, which load
    /// tiles synchronously.
    pub stages: usize,
}

impl std::fmt::Display for TileConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "m{}_n{}", self.block_m, self.block_n)?;
        if self.stages > 1 { write!(f, "_s{}", self.stages) } else { Ok(()) }
    }
}

impl TileConfig {
    /// A tile of `block_m` query rows and `block_n` key/value rows, one stage (the `f32`
    /// kernels); not validated until used.
    pub const fn new(block_m: usize, block_n: usize) -> Self {
        Self { block_m, block_n, stages: 1 }
    }

    /// The same tile with `stages` pipeline stages (the tensor-core kernels).
    pub const fn with_stages(self, stages: usize) -> Self {
        Self { stages, ..self }
    }

    /// `(block_m, block_n)`, or `(block_m, block_n, stages)` for a pipelined tile.
    pub(crate) fn describe(&self) -> String {
        if self.stages > 1 {
            format!("({}, {}, {})", self.block_m, self.block_n, self.stages)
        } else {
            format!("({}, {})", self.block_m, self.block_n)
        }
    }
}

/// Checks the grid limits of the flash kernel (heads on grid y, batch on grid z).
pub(crate) fn check_flash_grid(shape: &AttentionShape) -> Result<()> {
    if shape.num_heads_q > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(Error::Shape(format!(
            "batch = {} and num_heads_q = {} must each be at most {MAX_GRID_YZ} (CUDA grid limit)",
            shape.batch, shape.num_heads_q
        )));
    }
    Ok(())
}

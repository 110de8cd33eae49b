//! The problem (shapes, scale) and tile (block sizes) descriptions, validated on the host.

use crate::context::DeviceInfo;
use crate::error::{Error, Result};
use crate::kernels::{self, FLASH_INSTANCES, FlashKernel};
pub use crate::layout::AttentionShape;

/// CUDA's limit on the y and z dimensions of a grid; the flash kernel puts heads on y and the
/// batch on z.
const MAX_GRID_YZ: usize = 65_535;

impl AttentionShape {
    /// Derives and validates the problem shape from the shapes of Q `[batch, num_heads_q,
    /// seqlen_q, head_dim]`, K and V (both `[batch, num_heads_kv, seqlen_k, head_dim]`).
    ///
    /// # Errors
    /// [`Error::Shape`] when a tensor is not 4-dimensional, a dimension is 0, K and V differ, the
    /// batch or head_dim of Q and K differ, or `num_heads_kv` does not divide `num_heads_q`.
    pub fn from_qkv(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self> {
        for (name, shape) in [("q", q), ("k", k), ("v", v)] {
            if shape.len() != 4 {
                return Err(Error::Shape(format!(
                    "`{name}` has shape {shape:?}; expected 4 dimensions [batch, num_heads, seqlen, head_dim]"
                )));
            }
            if shape.contains(&0) {
                return Err(Error::Shape(format!("`{name}` has shape {shape:?}; every dimension must be at least 1")));
            }
        }
        if k != v {
            return Err(Error::Shape(format!("`k` {k:?} and `v` {v:?} must have the same shape")));
        }
        if q[0] != k[0] || q[3] != k[3] {
            return Err(Error::Shape(format!(
                "`q` {q:?} and `k` {k:?} must agree on batch (dim 0) and head_dim (dim 3)"
            )));
        }
        if !q[1].is_multiple_of(k[1]) {
            return Err(Error::Shape(format!(
                "num_heads_q = {} is not a multiple of num_heads_kv = {} (grouped-query attention \
                 needs every key/value head to serve the same number of query heads)",
                q[1], k[1]
            )));
        }
        Ok(Self { batch: q[0], num_heads_q: q[1], num_heads_kv: k[1], seqlen_q: q[2], seqlen_k: k[2], head_dim: q[3] })
    }

    /// Shape of Q and O.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.num_heads_q, self.seqlen_q, self.head_dim]
    }

    /// Shape of K and V.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.num_heads_kv, self.seqlen_k, self.head_dim]
    }

    /// Shape of the logsumexp: one `f32` per query row, `[batch, num_heads_q, seqlen_q]`.
    pub fn lse_shape(&self) -> [usize; 3] {
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
    pub fn naive_workspace_bytes(&self) -> usize {
        self.query_rows() * self.seqlen_k * size_of::<f32>()
    }

    /// Bytes of the logsumexp output, the only thing FlashAttention keeps besides O.
    pub fn lse_bytes(&self) -> usize {
        self.query_rows() * size_of::<f32>()
    }
}

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
}

impl AttentionOptions {
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

    /// Floating-point operations of one forward pass in the field's convention: 4 · batch ·
    /// heads · seqlen_q · seqlen_k · head_dim, halved for a causal mask. The backward pass counts
    /// 2.5 times this.
    pub fn forward_flops(&self, shape: &AttentionShape) -> f64 {
        let full = shape.forward_flops();
        if self.causal == Causal::None { full } else { full / 2.0 }
    }
}

/// Tile sizes of the FlashAttention kernels: `block_m` query rows per block (the paper's Br) and
/// `block_n` key/value rows per shared-memory tile (Bc). Each compiled (block_m, block_n,
/// head_dim) is a separate kernel; [`TileConfig::validate`] says which exist and fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    /// Query rows per block (Br); a multiple of 16 in the compiled set.
    pub block_m: usize,
    /// Key/value rows per shared-memory tile (Bc); a multiple of 8 in the compiled set.
    pub block_n: usize,
}

impl TileConfig {
    /// A tile of `block_m` query rows and `block_n` key/value rows; not validated until used.
    pub const fn new(block_m: usize, block_n: usize) -> Self {
        Self { block_m, block_n }
    }

    /// The forward tile used when none is given, measured fastest on an H200 for each head_dim
    /// (see `PERFORMANCE.md`).
    pub fn default_for(head_dim: usize) -> Self {
        match head_dim {
            64 => Self::new(64, 64),
            _ => Self::new(64, 32),
        }
    }

    /// The backward tile used when none is given, measured fastest on an H200 for each head_dim
    /// (see `PERFORMANCE.md`).
    pub fn default_backward_for(head_dim: usize) -> Self {
        match head_dim {
            128 => Self::new(64, 64),
            _ => Self::new(32, 64),
        }
    }

    /// Dynamic shared memory per block of the forward kernel, in bytes, at this head_dim.
    pub fn shared_memory_bytes(&self, head_dim: usize) -> usize {
        FlashKernel::Forward.shared_memory_bytes(self.block_m, self.block_n, head_dim)
    }

    /// Every compiled tile for `head_dim`, in (block_m, block_n) order. Every kernel family is
    /// compiled for the same tiles.
    pub fn compiled(head_dim: usize) -> Vec<Self> {
        FLASH_INSTANCES
            .iter()
            .filter(|i| i.kernel == FlashKernel::Forward && i.head_dim == head_dim)
            .map(|i| Self::new(i.block_m, i.block_n))
            .collect()
    }

    /// The head dimensions that have compiled kernels.
    pub fn compiled_head_dims() -> Vec<usize> {
        let mut dims: Vec<usize> = FLASH_INSTANCES.iter().map(|i| i.head_dim).collect();
        dims.sort_unstable();
        dims.dedup();
        dims
    }

    /// Checks that a forward kernel exists for this tile at `head_dim` and that its shared
    /// memory fits on `device`; returns the kernel's entry name.
    ///
    /// # Errors
    /// [`Error::HeadDimNotCompiled`], [`Error::TileNotCompiled`] (listing the compiled values) or
    /// [`Error::SharedMemory`] (listing the tiles that fit).
    pub fn validate(&self, head_dim: usize, device: &DeviceInfo) -> Result<&'static str> {
        self.validate_for(FlashKernel::Forward, head_dim, device)
    }

    /// [`TileConfig::validate`] for any kernel family (the backward kernels need more shared
    /// memory than the forward one at the same tile).
    pub fn validate_for(&self, kernel: FlashKernel, head_dim: usize, device: &DeviceInfo) -> Result<&'static str> {
        let entry = self.compiled_entry(kernel, head_dim)?;
        let needed = kernel.shared_memory_bytes(self.block_m, self.block_n, head_dim);
        if needed > device.max_shared_memory_per_block {
            let fitting: Vec<String> = Self::compiled(head_dim)
                .into_iter()
                .filter(|t| {
                    kernel.shared_memory_bytes(t.block_m, t.block_n, head_dim) <= device.max_shared_memory_per_block
                })
                .map(|t| format!("({}, {})", t.block_m, t.block_n))
                .collect();
            return Err(Error::SharedMemory {
                kernel: kernel.to_string(),
                block_m: self.block_m,
                block_n: self.block_n,
                head_dim,
                needed,
                available: device.max_shared_memory_per_block,
                device: device.name.clone(),
                fitting: fitting.join(", "),
            });
        }
        Ok(entry)
    }

    /// The entry name of `kernel` compiled for this tile at `head_dim`, without looking at a
    /// device (so it can be checked before one is opened).
    ///
    /// # Errors
    /// [`Error::HeadDimNotCompiled`], or [`Error::TileNotCompiled`] listing the compiled values.
    pub fn compiled_entry(&self, kernel: FlashKernel, head_dim: usize) -> Result<&'static str> {
        let head_dims = Self::compiled_head_dims();
        if !head_dims.contains(&head_dim) {
            let allowed = head_dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            return Err(Error::HeadDimNotCompiled { head_dim, allowed });
        }
        kernels::flash_instance(kernel, self.block_m, self.block_n, head_dim).map(|i| i.entry).ok_or_else(|| {
            Error::TileNotCompiled {
                kernel: kernel.to_string(),
                block_m: self.block_m,
                block_n: self.block_n,
                head_dim,
                allowed: compiled_summary(),
            }
        })
    }
}

/// "block_m ∈ {…}, block_n ∈ {…}, head_dim ∈ {…}" for the compiled instances.
fn compiled_summary() -> String {
    let values = |f: fn(&kernels::FlashInstance) -> usize| {
        let mut v: Vec<usize> = FLASH_INSTANCES.iter().map(f).collect();
        v.sort_unstable();
        v.dedup();
        v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    };
    format!(
        "block_m ∈ {{{}}}, block_n ∈ {{{}}}, head_dim ∈ {{{}}}",
        values(|i| i.block_m),
        values(|i| i.block_n),
        values(|i| i.head_dim)
    )
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

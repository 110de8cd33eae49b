//! The problem (shapes, scale) and tile (block sizes) descriptions, validated on the host.

use crate::context::DeviceInfo;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{self, FLASH_INSTANCES, FlashKernel};
pub use crate::layout::AttentionShape;
#[allow(unused_imports)] // for docs
use crate::ops::DqAccumulation;

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
    pub fn default_for_dtype(dtype: DType, head_dim: usize) -> Self {
        match (dtype, head_dim) {
            (DType::F32, 64) => Self::new(64, 64),
            (DType::F32, _) => Self::new(64, 32),
            (_, 64) => Self::new(128, 64).with_stages(2),
            (_, _) => Self::new(128, 32).with_stages(2),
        }
    }

    /// The backward tile used when none is given, per element type and head_dim, measured fastest
    /// on an H200 with the dQ mode of [`DqAccumulation::fastest_for`] (see `PERFORMANCE.md`).
    pub fn default_backward_for_dtype(dtype: DType, head_dim: usize) -> Self {
        match (dtype, head_dim) {
            (DType::F32, 128) => Self::new(64, 64),
            (DType::F32, _) => Self::new(32, 64),
            (_, 64) => Self::new(64, 128).with_stages(2),
            (_, _) => Self::new(64, 64).with_stages(2),
        }
    }

    /// Warps per block of `kernel` with this tile at `dtype`.
    pub fn warps(&self, kernel: FlashKernel, dtype: DType) -> usize {
        kernel.threads(dtype, self.block_m, self.block_n) / 32
    }

    /// Dynamic shared memory per block of the `f32` forward kernel, in bytes, at this head_dim.
    pub fn shared_memory_bytes(&self, head_dim: usize) -> usize {
        self.shared_memory_bytes_for(FlashKernel::Forward, DType::F32, head_dim)
    }

    /// Dynamic shared memory per block of `kernel` at `dtype` and `head_dim`, in bytes.
    pub fn shared_memory_bytes_for(&self, kernel: FlashKernel, dtype: DType, head_dim: usize) -> usize {
        kernel.shared_memory_bytes(dtype, self.block_m, self.block_n, head_dim, self.stages)
    }

    /// Every compiled `f32` tile for `head_dim`, in (block_m, block_n) order. Every `f32` kernel
    /// family is compiled for the same tiles.
    pub fn compiled(head_dim: usize) -> Vec<Self> {
        Self::compiled_for(FlashKernel::Forward, DType::F32, head_dim)
    }

    /// Every compiled tile of `kernel` at `dtype` and `head_dim`, in (block_m, block_n, stages)
    /// order. The three backward families share their tiles.
    pub fn compiled_for(kernel: FlashKernel, dtype: DType, head_dim: usize) -> Vec<Self> {
        let mut tiles: Vec<Self> = FLASH_INSTANCES
            .iter()
            .filter(|i| i.kernel == kernel && i.dtype == dtype && i.head_dim == head_dim)
            .map(|i| Self::new(i.block_m, i.block_n).with_stages(i.stages))
            .collect();
        tiles.sort_by_key(|t| (t.block_m, t.block_n, t.stages));
        tiles
    }

    /// The head dimensions that have compiled kernels (of any element type).
    pub fn compiled_head_dims() -> Vec<usize> {
        compiled_values(|_| true, |i| i.head_dim)
    }

    /// The head dimensions that have compiled kernels for `dtype`.
    pub fn compiled_head_dims_for(dtype: DType) -> Vec<usize> {
        compiled_values(|i| i.dtype == dtype, |i| i.head_dim)
    }

    /// Checks that an `f32` forward kernel exists for this tile at `head_dim` and that its shared
    /// memory fits on `device`; returns the kernel's entry name.
    ///
    /// # Errors
    /// As [`TileConfig::validate_kernel`].
    pub fn validate(&self, head_dim: usize, device: &DeviceInfo) -> Result<&'static str> {
        self.validate_kernel(FlashKernel::Forward, DType::F32, head_dim, device)
    }

    /// [`TileConfig::validate`] for any `f32` kernel family (the backward kernels need more
    /// shared memory than the forward one at the same tile).
    pub fn validate_for(&self, kernel: FlashKernel, head_dim: usize, device: &DeviceInfo) -> Result<&'static str> {
        self.validate_kernel(kernel, DType::F32, head_dim, device)
    }

    /// Checks that `kernel` is compiled for `dtype`, this tile and `head_dim`, and that its shared
    /// memory fits on `device`; returns the kernel's entry name.
    ///
    /// # Errors
    /// [`Error::HeadDimNotCompiled`], [`Error::TileNotCompiled`] (listing the compiled tiles) or
    /// [`Error::SharedMemory`] (listing the tiles that fit).
    pub fn validate_kernel(
        &self,
        kernel: FlashKernel,
        dtype: DType,
        head_dim: usize,
        device: &DeviceInfo,
    ) -> Result<&'static str> {
        let entry = self.compiled_entry_for(kernel, dtype, head_dim)?;
        let needed = self.shared_memory_bytes_for(kernel, dtype, head_dim);
        if needed > device.max_shared_memory_per_block {
            let fitting: Vec<String> = Self::compiled_for(kernel, dtype, head_dim)
                .into_iter()
                .filter(|t| t.shared_memory_bytes_for(kernel, dtype, head_dim) <= device.max_shared_memory_per_block)
                .map(|t| t.describe())
                .collect();
            return Err(Error::SharedMemory {
                kernel: kernel_name(kernel, dtype),
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

    /// The entry name of the `f32` `kernel` compiled for this tile at `head_dim`, without
    /// looking at a device (so it can be checked before one is opened).
    ///
    /// # Errors
    /// As [`TileConfig::compiled_entry_for`].
    pub fn compiled_entry(&self, kernel: FlashKernel, head_dim: usize) -> Result<&'static str> {
        self.compiled_entry_for(kernel, DType::F32, head_dim)
    }

    /// The entry name of `kernel` compiled for `dtype`, this tile and `head_dim`.
    ///
    /// # Errors
    /// [`Error::HeadDimNotCompiled`], or [`Error::TileNotCompiled`] listing the compiled values.
    pub fn compiled_entry_for(&self, kernel: FlashKernel, dtype: DType, head_dim: usize) -> Result<&'static str> {
        let head_dims = Self::compiled_head_dims_for(dtype);
        if !head_dims.contains(&head_dim) {
            let allowed = head_dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            return Err(Error::HeadDimNotCompiled { head_dim, allowed: format!("{allowed} (for {dtype})") });
        }
        kernels::flash_instance(kernel, dtype, self.block_m, self.block_n, head_dim, self.stages)
            .map(|i| i.entry)
            .ok_or_else(|| Error::TileNotCompiled {
                kernel: kernel_name(kernel, dtype),
                block_m: self.block_m,
                block_n: self.block_n,
                stages: self.stages,
                head_dim,
                allowed: if dtype == DType::F32 {
                    format!("{} (stages 1)", compiled_summary())
                } else {
                    let tiles = Self::compiled_for(kernel, dtype, head_dim);
                    let tiles: Vec<String> = tiles.iter().map(Self::describe).collect();
                    let hint = if self.stages < 2 {
                        "; tensor-core tiles have 2 or more stages: TileConfig::with_stages"
                    } else {
                        ""
                    };
                    format!("{} (block_m, block_n, stages){hint}", tiles.join(", "))
                },
            })
    }

    /// `(block_m, block_n)`, or `(block_m, block_n, stages)` for a pipelined tile.
    fn describe(&self) -> String {
        if self.stages > 1 {
            format!("({}, {}, {})", self.block_m, self.block_n, self.stages)
        } else {
            format!("({}, {})", self.block_m, self.block_n)
        }
    }
}

/// "forward" for `f32` (as before the tensor-core kernels), "f16 forward" otherwise.
fn kernel_name(kernel: FlashKernel, dtype: DType) -> String {
    if dtype == DType::F32 { kernel.to_string() } else { format!("{dtype} {kernel}") }
}

/// The distinct values of `value` over the compiled instances that pass `keep`, ascending.
fn compiled_values(
    keep: impl Fn(&kernels::FlashInstance) -> bool,
    value: impl Fn(&kernels::FlashInstance) -> usize,
) -> Vec<usize> {
    let mut values: Vec<usize> = FLASH_INSTANCES.iter().filter(|i| keep(i)).map(value).collect();
    values.sort_unstable();
    values.dedup();
    values
}

/// "block_m ∈ {…}, block_n ∈ {…}, head_dim ∈ {…}" for the compiled `f32` instances.
fn compiled_summary() -> String {
    let values = |f: fn(&kernels::FlashInstance) -> usize| {
        let v = compiled_values(|i| i.dtype == DType::F32, f);
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

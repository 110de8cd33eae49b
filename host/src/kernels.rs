//! **Registry layer.** The registry of kernels in the embedded PTX, and what it says about tiles:
//! which [`TileConfig`]s are compiled for a kernel, their threads and shared memory, and whether
//! they fit a device ([`TileConfig::validate_kernel`]).
//!
//! `build.rs` compiles `kernels/` and generates, from the `.entry` names it finds in the PTX, one
//! constant per kernel (in [`entry`]) and the tables of FlashAttention instances
//! ([`FLASH_INSTANCES`]; the Hopper ones: [`HOPPER_INSTANCES`]). Host code names kernels only
//! through these, so a kernel that is renamed or removed on the device side breaks the host
//! build, not a launch at run time.

use crate::device::DeviceInfo;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout;
use crate::problem::{DqAccumulation, TileConfig};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The FlashAttention kernel families; each is compiled once per element type, tile shape and
/// head_dim. `f32` instances run on the CUDA cores (`flash_*_f32_*`, 128 threads); `f16` and
/// `bf16` instances on the tensor cores (`flash_*_{f16,bf16}_*_s{stages}`, a warp per 16 rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashKernel {
    /// `flash_fwd_*`: the forward pass (O and LSE).
    Forward,
    /// `flash_bwd_*`: dK and dV, and dQ by atomic adds.
    Backward,
    /// `flash_bwd_dkdv_*`: dK and dV only (the deterministic backward's first kernel).
    BackwardDkDv,
    /// `flash_bwd_dq_*`: dQ without atomics (the deterministic backward's second kernel).
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
    /// Dynamic shared memory per block, in bytes, for this tile (`stages` counts only for the
    /// tensor-core kernels).
    pub fn shared_memory_bytes(
        self,
        dtype: DType,
        block_m: usize,
        block_n: usize,
        head_dim: usize,
        stages: usize,
    ) -> usize {
        match (dtype, self) {
            (DType::F32, Self::Forward) => layout::flash_forward_smem_bytes(block_m, block_n, head_dim),
            (DType::F32, Self::Backward | Self::BackwardDkDv) => {
                layout::flash_backward_kv_smem_bytes(block_m, block_n, head_dim)
            }
            (DType::F32, Self::BackwardDq) => layout::flash_backward_q_smem_bytes(block_m, block_n, head_dim),
            (_, Self::Forward) => layout::mma_forward_smem_bytes(block_m, block_n, head_dim, stages),
            (_, Self::Backward | Self::BackwardDkDv) => {
                layout::mma_backward_kv_smem_bytes(block_m, block_n, head_dim, stages)
            }
            (_, Self::BackwardDq) => layout::mma_backward_dq_smem_bytes(block_m, block_n, head_dim, stages),
        }
    }

    /// Threads per block at the compiled `head_dim`: 128 for the `f32` kernels and the
    /// tensor-core forward (4 warps, each with `block_m / 64` m-tiles of 16 rows); for the other
    /// tensor-core kernels a warp per 16 rows of the tile dimension the block owns (queries for
    /// the dQ kernel, keys for the K/V-outer ones), two above head_dim 128
    /// (`layout::mma_backward_column_warps`).
    pub fn threads(self, dtype: DType, block_m: usize, block_n: usize, head_dim: usize) -> usize {
        match (dtype, self) {
            (DType::F32, _) => layout::FLASH_THREADS,
            (_, Self::Forward) => layout::mma_forward_threads(block_m),
            (_, Self::BackwardDq) => layout::mma_backward_threads(block_m, head_dim),
            (_, Self::Backward | Self::BackwardDkDv) => layout::mma_backward_threads(block_n, head_dim),
        }
    }
}

/// One compiled instance of a FlashAttention kernel: its family, element type, tile shape and
/// entry name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashInstance {
    /// Which kernel.
    pub kernel: FlashKernel,
    /// Element type of Q, K, V, O and the gradients.
    pub dtype: DType,
    /// Query rows per query tile (the paper's Br).
    pub block_m: usize,
    /// Key/value rows per key tile (the paper's Bc).
    pub block_n: usize,
    /// Head dimension the instance is specialised for.
    pub head_dim: usize,
    /// Slots of the `cp.async` ring (tensor-core kernels); 1 for the `f32` kernels.
    pub stages: usize,
    /// Whether the instance also runs head dims below `head_dim`, on zero padding columns (every
    /// `f32` instance; the tensor-core ones named `…_padded`). The others are *exact*: they run
    /// only problems of their own head_dim, with the row length a compile-time constant.
    pub padded: bool,
    /// `.entry` name in the PTX, e.g. `flash_fwd_f16_m128_n64_d64_s2`.
    pub entry: &'static str,
}

/// The compiled instance of `kernel` for this element type and tile that runs a problem of
/// `head_dim`, if any: on the smallest compiled head_dim at least as large
/// ([`TileConfig::padded_head_dim`]), the exact instance when the problem has that head_dim, else
/// a padded one ([`FlashInstance::padded`]).
pub fn flash_instance(
    kernel: FlashKernel,
    dtype: DType,
    block_m: usize,
    block_n: usize,
    head_dim: usize,
    stages: usize,
) -> Option<&'static FlashInstance> {
    let compiled = TileConfig::padded_head_dim(kernel, dtype, head_dim).ok()?;
    let candidates = || {
        FLASH_INSTANCES.iter().filter(move |i| {
            i.kernel == kernel
                && i.dtype == dtype
                && i.block_m == block_m
                && i.block_n == block_n
                && i.head_dim == compiled
                && i.stages == stages
        })
    };
    if head_dim == compiled {
        candidates().find(|i| !i.padded).or_else(|| candidates().next())
    } else {
        candidates().find(|i| i.padded)
    }
}

/// One compiled Hopper (`sm_90a`) FlashAttention kernel, parsed from its name
/// (`hopper_flash_fwd_f16_m192_n128_d64_s2`, `hopper_flash_fwd_f16_m128_n128_d64_s2_pingpong`,
/// `hopper_flash_bwd_bf16_m64_n128_d128_s2`, `hopper_flash_bwd_bf16_m64_n128_d128_s2_deterministic`):
/// producer and consumer warpgroups, tiles loaded by TMA into a ring of `stages` slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperInstance {
    /// Which kernel: [`FlashKernel::Forward`] or [`FlashKernel::Backward`] (dK, dV and dQ).
    pub kernel: FlashKernel,
    /// Element type of Q, K, V, O and the gradients (`f16` or `bf16`).
    pub dtype: DType,
    /// Query rows per block (forward: 64 per consumer warpgroup) or per query tile (backward).
    pub block_m: usize,
    /// Keys per K/V tile (forward) or per block (backward).
    pub block_n: usize,
    /// Head dimension the instance is specialised for.
    pub head_dim: usize,
    /// Slots of the TMA ring.
    pub stages: usize,
    /// What sets it apart beyond its tile: the forward's ping-pong turns, the backward's
    /// deterministic dQ.
    pub variant: HopperVariant,
    /// Blocks per SM that its launch bounds (`kernels/src/configs.rs`, `launch_bounds`) keep
    /// room for: the resident blocks a persistent grid plans with.
    pub blocks_per_sm: usize,
    /// `.entry` name in the PTX.
    pub entry: &'static str,
}

impl HopperInstance {
    /// The configuration as the entry names it: `m128_n128_s2`, with the variant's suffix
    /// (`_pingpong`, `_deterministic`) when it has one.
    pub fn config_name(&self) -> String {
        format!("m{}_n{}_s{}{}", self.block_m, self.block_n, self.stages, self.variant.suffix())
    }
}

/// The variants of a Hopper kernel of one tile, named by a suffix of the entry name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HopperVariant {
    /// No suffix.
    Plain,
    /// `_pingpong` (forward): the consumer warpgroups take turns to issue their products
    /// (FlashAttention-3's ping-pong scheduling).
    PingPong,
    /// `_deterministic` (backward): dQ tiles are added in a fixed order (key blocks take turns at
    /// a counter per tile), so that dQ is bit-identical from run to run
    /// ([`crate::DqAccumulation::Deterministic`]).
    Deterministic,
}

impl HopperVariant {
    /// The entry-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Plain => "",
            Self::PingPong => "_pingpong",
            Self::Deterministic => "_deterministic",
        }
    }
}

/// One compiled KV-cache decoder (level 10, `kernels/src/sm80/decode.rs`; entry names
/// `decode_fwd_{f16,bf16}_d{head_dim}_s{stages}`): split-KV over a (paged) cache, four warps
/// taking turns over 16-key tiles, each with a `stages`-slot `cp.async` ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeInstance {
    /// Element type of Q, the cache and O (`f16` or `bf16`).
    pub dtype: DType,
    /// Head dimension the instance is specialised for (it also runs the smaller ones down to the
    /// previous compiled one, with zero columns that never touch device memory).
    pub head_dim: usize,
    /// Slots of each warp's K/V ring.
    pub stages: usize,
    /// `.entry` name in the PTX.
    pub entry: &'static str,
}

impl DecodeInstance {
    /// Its dynamic shared memory per block, in bytes ([`crate::layout::decode_smem_bytes`]): the
    /// one figure that decides whether it fits a device.
    pub fn shared_memory_bytes(&self) -> usize {
        crate::layout::decode_smem_bytes(self.head_dim, self.stages)
    }
}

/// The compiled Hopper instance of `kernel` for this element type, tile, head dimension and
/// variant, if any.
pub fn hopper_instance(
    kernel: FlashKernel,
    dtype: DType,
    (block_m, block_n): (usize, usize),
    head_dim: usize,
    stages: usize,
    variant: HopperVariant,
) -> Option<&'static HopperInstance> {
    let padded = hopper_head_dim(kernel, head_dim)?;
    HOPPER_INSTANCES.iter().find(|i| {
        i.kernel == kernel
            && i.dtype == dtype
            && i.block_m == block_m
            && i.block_n == block_n
            && i.head_dim == padded
            && i.stages == stages
            && i.variant == variant
    })
}

/// The compiled Hopper head dimension that runs `kernel` for a problem of `head_dim`: the
/// smallest compiled one at least as large (its padding columns are zeros that the TMA boxes
/// read past the tensor's last column and the stores skip). `None` above the largest, and for a
/// head_dim that is not a multiple of 8: a tensor map's row stride must be a multiple of 16 bytes.
pub fn hopper_head_dim(kernel: FlashKernel, head_dim: usize) -> Option<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(8) {
        return None;
    }
    HOPPER_INSTANCES.iter().filter(|i| i.kernel == kernel && i.head_dim >= head_dim).map(|i| i.head_dim).min()
}

/// The key tile (`block_n`) of the compiled Hopper forward instances at the compiled
/// `head_dim`: the largest compiled, 128 up to head_dim 128 (above, the O accumulator and the
/// K/V ring take registers and shared memory from it: `kernels/src/configs.rs`).
pub fn hopper_forward_block_n(head_dim: usize) -> Option<usize> {
    HOPPER_INSTANCES
        .iter()
        .filter(|i| i.kernel == FlashKernel::Forward && i.head_dim == head_dim)
        .map(|i| i.block_n)
        .max()
}

/// The head dimensions that have a compiled Hopper `kernel` (of any element type), ascending.
pub fn hopper_head_dims(kernel: FlashKernel) -> Vec<usize> {
    let mut dims: Vec<usize> = HOPPER_INSTANCES.iter().filter(|i| i.kernel == kernel).map(|i| i.head_dim).collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// The tile methods that read the registry.
impl TileConfig {
    /// Threads per block of `kernel` with this tile at `dtype` and `head_dim` (on the compiled
    /// head_dim that runs it).
    pub fn threads_for(&self, kernel: FlashKernel, dtype: DType, head_dim: usize) -> usize {
        let padded = Self::padded_head_dim(kernel, dtype, head_dim).unwrap_or(head_dim);
        kernel.threads(dtype, self.block_m, self.block_n, padded)
    }

    /// Warps per block of `kernel` with this tile at `dtype` and `head_dim`.
    pub fn warps(&self, kernel: FlashKernel, dtype: DType, head_dim: usize) -> usize {
        self.threads_for(kernel, dtype, head_dim) / 32
    }

    /// Dynamic shared memory per block of the `f32` forward kernel, in bytes, at this head_dim.
    pub fn shared_memory_bytes(&self, head_dim: usize) -> usize {
        self.shared_memory_bytes_for(FlashKernel::Forward, DType::F32, head_dim)
    }

    /// Dynamic shared memory per block of `kernel` at `dtype` and `head_dim`, in bytes.
    pub fn shared_memory_bytes_for(&self, kernel: FlashKernel, dtype: DType, head_dim: usize) -> usize {
        let padded = Self::padded_head_dim(kernel, dtype, head_dim).unwrap_or(head_dim);
        kernel.shared_memory_bytes(dtype, self.block_m, self.block_n, padded, self.stages)
    }

    /// Every compiled `f32` tile for `head_dim`, in (block_m, block_n) order. Every `f32` kernel
    /// family is compiled for the same tiles.
    pub fn compiled(head_dim: usize) -> Vec<Self> {
        Self::compiled_for(FlashKernel::Forward, DType::F32, head_dim)
    }

    /// Every compiled tile of `kernel` at `dtype` that runs `head_dim` (on the compiled head_dim
    /// of [`Self::padded_head_dim`]), in (block_m, block_n, stages) order. The three backward
    /// families share their tiles.
    pub fn compiled_for(kernel: FlashKernel, dtype: DType, head_dim: usize) -> Vec<Self> {
        let Ok(padded) = Self::padded_head_dim(kernel, dtype, head_dim) else { return Vec::new() };
        let mut tiles: Vec<Self> = FLASH_INSTANCES
            .iter()
            .filter(|i| i.kernel == kernel && i.dtype == dtype && i.head_dim == padded)
            .filter(|i| i.padded || head_dim == padded)
            .map(|i| Self::new(i.block_m, i.block_n).with_stages(i.stages))
            .collect();
        tiles.sort_by_key(|t| (t.block_m, t.block_n, t.stages));
        tiles.dedup();
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

    /// The head dimensions compiled for `kernel` at `dtype`, ascending.
    pub fn compiled_head_dims_of(kernel: FlashKernel, dtype: DType) -> Vec<usize> {
        compiled_values(|i| i.kernel == kernel && i.dtype == dtype, |i| i.head_dim)
    }

    /// The largest head_dim that `kernel` takes at `dtype`: its largest compiled one (256 for
    /// every pass and type today).
    pub fn max_head_dim(kernel: FlashKernel, dtype: DType) -> usize {
        Self::compiled_head_dims_of(kernel, dtype).last().copied().unwrap_or(0)
    }

    /// The compiled head_dim whose instances of `kernel` run a problem of `head_dim` at `dtype`:
    /// the smallest compiled one at least as large. The kernels read and write only the problem's
    /// `head_dim` columns of every row; the compiled one's extra columns are zeros in shared
    /// memory (FlashAttention-2 runs the head dims between its compiled ones the same way).
    ///
    /// # Errors
    /// [`Error::HeadDimNotCompiled`] for head_dim 0 or above the largest compiled one, naming
    /// the range that runs.
    pub fn padded_head_dim(kernel: FlashKernel, dtype: DType, head_dim: usize) -> Result<usize> {
        // One scan of the registry, no allocation: this runs on every launch's lookups.
        let padded = FLASH_INSTANCES
            .iter()
            .filter(|i| i.kernel == kernel && i.dtype == dtype && i.head_dim >= head_dim)
            .map(|i| i.head_dim)
            .min();
        padded.filter(|_| head_dim > 0).ok_or_else(|| {
            let dims = Self::compiled_head_dims_of(kernel, dtype);
            let compiled = dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            let largest = dims.last().copied().unwrap_or(0);
            let allowed = format!(
                "1 to {largest} for the {} (compiled {compiled}; the others run on the next compiled one)",
                kernel_name(kernel, dtype)
            );
            Error::HeadDimNotCompiled { head_dim, allowed }
        })
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
        Self::padded_head_dim(kernel, dtype, head_dim)?;
        flash_instance(kernel, dtype, self.block_m, self.block_n, head_dim, self.stages).map(|i| i.entry).ok_or_else(
            || Error::TileNotCompiled {
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
            },
        )
    }
}

/// "forward" for `f32` (as before the tensor-core kernels), "f16 forward" otherwise.
fn kernel_name(kernel: FlashKernel, dtype: DType) -> String {
    if dtype == DType::F32 { kernel.to_string() } else { format!("{dtype} {kernel}") }
}

/// The distinct values of `value` over the compiled instances that pass `keep`, ascending.
fn compiled_values(keep: impl Fn(&FlashInstance) -> bool, value: impl Fn(&FlashInstance) -> usize) -> Vec<usize> {
    let mut values: Vec<usize> = FLASH_INSTANCES.iter().filter(|i| keep(i)).map(value).collect();
    values.sort_unstable();
    values.dedup();
    values
}

/// "block_m ∈ {…}, block_n ∈ {…}, head_dim ∈ {…}" for the compiled `f32` instances.
fn compiled_summary() -> String {
    let values = |f: fn(&FlashInstance) -> usize| {
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

/// The kernels a backward pass launches, in order.
pub(crate) fn backward_kernels(dq: DqAccumulation) -> &'static [FlashKernel] {
    match dq {
        DqAccumulation::Atomic => &[FlashKernel::Backward],
        DqAccumulation::Deterministic => &[FlashKernel::BackwardDkDv, FlashKernel::BackwardDq],
    }
}

/// The band-table twin of the sm_80-path flash kernel `entry`: the kernel that runs in its place
/// when the problem has a mask table ([`crate::MaskTable`]). Every instance of
/// [`FLASH_INSTANCES`] has one, named `entry` +
/// [`TABLE_TWIN_SUFFIX`](attn_kernels::configs::TABLE_TWIN_SUFFIX); the plain kernel never reads
/// the table, which keeps its registers what they were before tables existed (`attention_kernel!`
/// in `kernels/src/lib.rs`).
pub fn table_twin(entry: &str) -> String {
    format!("{entry}{}", attn_kernels::configs::TABLE_TWIN_SUFFIX)
}

/// The entry that runs for the sm_80-path flash kernel `entry` in a problem that has (`table`)
/// or has not a band table: its [`table_twin`], or `entry` itself.
pub(crate) fn entry_for_table(entry: &'static str, table: bool) -> std::borrow::Cow<'static, str> {
    match table {
        true => std::borrow::Cow::Owned(table_twin(entry)),
        false => std::borrow::Cow::Borrowed(entry),
    }
}

/// The PTX of kernel `entry` alone, as a module of its own: module `module_of(entry)`'s text with
/// every other entry left out (its header, the declarations before the first entry and the
/// functions after the last are shared by all of them). `None` if the module has no such entry.
/// (Turing's copy: [`module_entry_ptx`] with [`turing_module_of`].)
///
/// Why: the driver compiles a whole module when it is loaded, and the larger modules hold
/// hundreds of kernels (the tensor-core one, 40 MB of PTX, took minutes on an H200 that had no
/// cached copy, PERFORMANCE.md, "modules load on first use"); one kernel's module takes a
/// fraction of a second, and a program compiles only the kernels it runs. The driver's cache
/// (`~/.nv/ComputeCache`) keeps each kernel's compiled code across runs.
pub fn entry_ptx(entry: &str) -> Option<String> {
    module_entry_ptx(module_of(entry), entry)
}

/// [`entry_ptx`] from module `module` (an index into [`PTX`]); `None` if it has no such entry.
pub fn module_entry_ptx(module: usize, entry: &str) -> Option<String> {
    let ptx = PTX[module];
    let head = format!(".visible .entry {entry}(");
    let start = ptx.find(&head)?;
    // The entry's text ends with the brace that closes its body: count braces from its first
    // (inline `asm!` blocks have braces of their own, balanced, some at the start of a line),
    // skipping comments.
    let mut depth = 0usize;
    let mut end = None;
    let mut offset = start;
    for line in ptx[start..].split_inclusive('\n') {
        let code = line.split("//").next().unwrap_or_default();
        for c in code.chars() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        end = Some(offset + line.len());
                    }
                }
                _ => {}
            }
        }
        offset += line.len();
        if end.is_some() {
            break;
        }
    }
    let end = end?;
    // Everything before the first entry (header, function declarations, the dynamic shared
    // memory's declaration), and the function definitions after the last one.
    let first_entry = ptx.find(".visible .entry ")?;
    let last_entry = ptx.rfind(".visible .entry ")?;
    let tail = ptx[last_entry..].find("\n.func ").map_or(ptx.len(), |at| last_entry + at + 1);
    let mut module = String::with_capacity(first_entry + (end - start) + (ptx.len() - tail) + 1);
    module.push_str(&ptx[..first_entry]);
    module.push_str(&ptx[start..end]);
    module.push('\n');
    module.push_str(&ptx[tail..]);
    Some(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_in_the_ptx() {
        let flash = FLASH_INSTANCES.iter().map(|i| i.entry).chain(HOPPER_INSTANCES.iter().map(|i| i.entry));
        for name in entry::ALL.iter().copied().chain(flash) {
            let module = PTX[module_of(name)];
            assert!(module.contains(&format!(".entry {name}(")), "{name} missing from its PTX module");
        }
        // Every sm_80 flash instance has its band-table twin, in a module of twins.
        for instance in FLASH_INSTANCES {
            let twin = table_twin(instance.entry);
            let module = module_of(&twin);
            assert!(MODULES[module].ends_with("_tables"), "{twin} is not in a module of twins");
            assert!(PTX[module].contains(&format!(".entry {twin}(")), "{twin} missing from its PTX module");
        }
    }

    /// Every kernel's own module holds exactly that entry, whole, and what it calls.
    #[test]
    fn every_entry_splits_into_a_module_of_its_own() {
        for (index, ptx) in PTX.iter().enumerate() {
            let names: Vec<&str> = ptx
                .lines()
                .filter_map(|line| line.strip_prefix(".visible .entry "))
                .map(|rest| rest.split('(').next().unwrap())
                .collect();
            assert!(!names.is_empty());
            for name in names {
                let module = module_entry_ptx(index, name).unwrap_or_else(|| panic!("{name}: no module"));
                assert_eq!(module.matches(".visible .entry ").count(), 1, "{name}");
                assert!(module.contains(&format!(".visible .entry {name}(")), "{name}");
                assert!(module.starts_with(&ptx[..ptx.find(".visible .entry ").unwrap()]), "{name}: header");
                let code: String = module.lines().map(|l| l.split("//").next().unwrap()).collect();
                assert_eq!(code.matches('{').count(), code.matches('}').count(), "{name}: braces");
                // Every function it calls is defined in it.
                for callee in module.lines().filter_map(|l| l.trim().strip_prefix("call.uni ")) {
                    let callee = callee.trim_start_matches('(').split([',', ' ', ';', '(']).next().unwrap();
                    assert!(module.contains(&format!(".func {callee}(")), "{name} calls {callee}, not in its module");
                }
            }
        }
        assert_eq!(entry_ptx("no_such_kernel"), None);
    }

    /// Turing's modules hold every kernel of the sm_80 modules but the `bf16` ones, under the
    /// same names, written for sm_75; the Hopper and `bf16` kernels have no Turing copy.
    #[test]
    fn turing_modules_copy_the_sm_80_ones_without_bf16() {
        let flash = FLASH_INSTANCES.iter().map(|i| i.entry);
        for name in entry::ALL.iter().copied().chain(flash) {
            let twin = table_twin(name);
            for name in [name, twin.as_str()] {
                if !PTX[module_of(name)].contains(&format!(".entry {name}(")) {
                    continue; // a plain kernel has no twin
                }
                match turing_module_of(name) {
                    Some(module) => {
                        assert!(!name.contains("_bf16"), "{name} has a Turing copy");
                        assert_eq!(MODULE_ARCHS[module], "sm_75", "{name}");
                        assert_eq!(MODULES[module], MODULES[module_of(name)], "{name}");
                        assert!(module_entry_ptx(module, name).is_some(), "{name} missing from its sm_75 module");
                    }
                    None => assert!(name.contains("_bf16"), "{name} has no Turing copy"),
                }
            }
        }
        for i in HOPPER_INSTANCES {
            assert_eq!(turing_module_of(i.entry), None, "{}", i.entry);
        }
    }

    #[test]
    fn hopper_kernels_are_in_the_sm_90a_module_only() {
        for name in [entry::HOPPER_PROBE_WGMMA, entry::HOPPER_PROBE_WGMMA_REGISTER_A, entry::HOPPER_PROBE_TMA] {
            let module = module_of(name);
            assert_eq!(MODULE_ARCHS[module], "sm_90a", "{name}");
            assert!(PTX[module].contains(&format!(".entry {name}(")), "{name} missing from the sm_90a module");
            assert!(!entry::ALL.contains(&name), "{name} is not launched by every-kernel (Hopper only)");
        }
        for i in HOPPER_INSTANCES {
            assert_eq!(MODULE_ARCHS[module_of(i.entry)], "sm_90a", "{}", i.entry);
            assert!(PTX[module_of(i.entry)].contains(&format!(".entry {}(", i.entry)), "{}", i.entry);
            assert!(matches!(i.kernel, FlashKernel::Forward | FlashKernel::Backward), "{}", i.entry);
        }
        for (ptx, arch) in PTX.iter().zip(MODULE_ARCHS) {
            assert!(ptx.contains(&format!(".target {arch}")), "a module's PTX targets {arch}");
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
                        let instance = flash_instance(kernel, DType::F32, block_m, block_n, head_dim, 1)
                            .expect("instance compiled");
                        assert_eq!(instance.entry, format!("{prefix}_m{block_m}_n{block_n}_d{head_dim}"));
                    }
                }
            }
        }
        for (block_m, block_n) in [(16, 16), (16, 32), (32, 16), (32, 32)] {
            assert!(flash_instance(FlashKernel::Forward, DType::F32, block_m, block_n, 256, 1).is_some());
        }
        let f32_count = FLASH_INSTANCES.iter().filter(|i| i.dtype == DType::F32).count();
        assert_eq!(f32_count, 4 * (27 + 4));
    }

    #[test]
    fn tensor_core_instances_come_in_both_formats_and_all_families() {
        for i in FLASH_INSTANCES.iter().filter(|i| i.dtype == DType::F16) {
            assert!(i.stages >= 2, "{}", i.entry);
            assert!(flash_instance(i.kernel, DType::Bf16, i.block_m, i.block_n, i.head_dim, i.stages).is_some());
            if i.kernel == FlashKernel::Backward {
                for kernel in [FlashKernel::BackwardDkDv, FlashKernel::BackwardDq] {
                    assert!(flash_instance(kernel, DType::F16, i.block_m, i.block_n, i.head_dim, i.stages).is_some());
                }
            }
        }
        assert!(FLASH_INSTANCES.iter().any(|i| i.dtype == DType::F16 && i.kernel == FlashKernel::Forward));
    }

    /// The bias reads of one flash entry's PTX (a 32-bit global load whose value is then
    /// multiplied by log₂e, [`attn_kernels::attention::score::BiasPlane::add_to_fragments`]),
    /// and how many of them open a block of their own behind a conditional branch.
    fn bias_reads(entry: &[&str]) -> (usize, usize) {
        let (mut reads, mut behind) = (0, 0);
        for (i, line) in entry.iter().enumerate() {
            let Some(register) = line.trim().strip_prefix("ld.global.b32").map(|r| r.trim().split(',').next().unwrap())
            else {
                continue;
            };
            let scaled = format!(", {register}, 0f3FB8AA3B;");
            if !entry[i + 1..(i + 4).min(entry.len())].iter().any(|l| l.contains("mul.rn.f32") && l.contains(&scaled)) {
                continue;
            }
            reads += 1;
            // Back over the address arithmetic to the start of the read's block.
            let start = (i.saturating_sub(5)..i).rev().find(|&j| {
                let l = entry[j].trim_start();
                l.starts_with("$L") || l.starts_with("// %bb") || l.contains("bra")
            });
            if let Some(j) = start
                && j > 0
                && entry[j].starts_with("// %bb")
                && entry[j - 1].trim_start().starts_with("@%p")
                && entry[j - 1].contains("bra")
            {
                behind += 1;
            }
        }
        (reads, behind)
    }

    /// An additive bias is read without a branch per entry (clamped reads, then a select:
    /// `BiasPlane::add_to_fragments`); behind a branch each, every read waits for the one before
    /// it, and the bias kernels ran 1.7× slower (PERFORMANCE.md, "a bias read without branches",
    /// and its sequel of 2026-12-06). LLVM makes such branches again from innocent-looking source
    /// (a short-circuit `&&`), so this reads the PTX: in every tensor-core flash entry at most
    /// one read in four (the first read of a tile sits behind the "is there a bias" test).
    #[test]
    fn bias_reads_are_not_behind_a_branch_each() {
        let flash: Vec<String> = FLASH_INSTANCES
            .iter()
            .filter(|i| i.dtype != DType::F32)
            .flat_map(|i| [i.entry.to_string(), table_twin(i.entry)])
            .collect();
        let mut checked = 0;
        for name in &flash {
            // The sm_80 module that holds the entry and Turing's copy, if any; of each, the
            // entry's own module (`module_entry_ptx`): only this entry and what it calls.
            for index in [Some(module_of(name)), turing_module_of(name)].into_iter().flatten() {
                let Some(module) = module_entry_ptx(index, name) else { continue };
                let lines: Vec<&str> = module.lines().collect();
                let (reads, behind) = bias_reads(&lines);
                assert!(
                    reads >= 8,
                    "{name} ({}, {}): {reads} bias reads found; has the read's PTX changed form?",
                    MODULES[index],
                    MODULE_ARCHS[index]
                );
                assert!(
                    4 * behind <= reads,
                    "{name} ({}, {}): {behind} of its {reads} bias reads are each behind a branch",
                    MODULES[index],
                    MODULE_ARCHS[index]
                );
                checked += 1;
            }
        }
        assert!(checked > 100, "only {checked} entries checked");
    }
}

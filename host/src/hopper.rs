//! The Hopper path (compute capability 9.0, PTX for `sm_90a`): which kernels a context runs
//! ([`KernelPath`]), the Hopper FlashAttention forward and backward passes
//! (`kernels/src/flash_{forward,backward}_wgmma.rs`), the tensor maps from which TMA loads
//! their tiles, and the probes that check the device crate's Hopper building blocks (`wgmma` from
//! shared-memory descriptors, TMA loads completing on an `mbarrier`; `kernels/src/hopper.rs`).
//!
//! The `sm_90a` module is loaded only on compute capability 9.0 ([`Context::has_hopper_kernels`]);
//! elsewhere these calls return [`Error::Unsupported`]. The CPU emulator does not run them either.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use cudarc::driver::{CudaSlice, CudaStream};

use attn_kernels::emu::Arg;
use attn_kernels::tiles::BalancedRows;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::context::{Backend, KernelArg};
use crate::dtype::{DType, Element};
use crate::error::{During, Error, Result};
use crate::kernels::{self, FlashKernel, HopperInstance, entry};
use crate::layout::{hopper_backward_smem_bytes, hopper_forward_smem_bytes, hopper_forward_threads};
use crate::ops::{AttentionOutput, DqAccumulation, Gradients, ProblemArgs, flash_config};
use crate::problem::check_flash_grid;
use crate::{AttentionOptions, AttentionShape, Causal, TileConfig};
use crate::{Context, DeviceTensor};

/// Threads of the probe kernels: one warpgroup.
const WARPGROUP_THREADS: u32 = 128;

/// Rows of a `wgmma` tile (m64) and columns of the probe's B (n64).
const PROBE_ROWS: usize = 64;

/// Bytes of one row of a 128-byte swizzled box: the inner box dimension of the Hopper kernels'
/// tensor maps.
const SWIZZLE_ROW_BYTES: usize = 128;

/// Which kernels run a context's 16-bit FlashAttention passes with the built-in tiles.
///
/// A GPU context takes [`KernelPath::Sm90a`] on compute capability 9.0 and [`KernelPath::Sm80`]
/// elsewhere, unless the environment variable [`KernelPath::ENV`] names one (`sm80` or
/// `sm90a`), or [`Context::with_kernel_path`] chooses. The test suite runs once per path that
/// way. On the sm_90a path the 16-bit forward and backward passes with the built-in tiles (the
/// backward with atomic dQ) run the Hopper kernels; everything else (the `f32` kernels, the
/// naive kernels, explicit tiles, a deterministic dQ) runs the sm_80 kernels on both paths. The CPU emulator is
/// always on sm_80.
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

    /// The path [`KernelPath::ENV`] asks for, if set.
    ///
    /// # Errors
    /// [`Error::Argument`] for a value other than `sm80`/`sm_80`/`sm90a`/`sm_90a`.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(Self::ENV) {
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

/// A compiled Hopper forward kernel: its entry and configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HopperForward {
    pub(crate) entry: &'static str,
    /// Query rows per block: 64 per consumer warpgroup.
    pub(crate) block_m: usize,
    /// Keys per K/V tile.
    pub(crate) block_n: usize,
    /// Slots of the K/V ring.
    pub(crate) stages: usize,
    /// Whether the consumer warpgroups take turns to issue their products (FA3's ping-pong).
    pub(crate) pingpong: bool,
}

impl HopperForward {
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
    /// configuration measured fastest on an H200 for the head dimension, and at head_dim 64 for
    /// the grid's depth ([`Self::waves_for_192_rows`]) where a head has rows for at least one
    /// block of 192 ([`BalancedRows`]; below that the third consumer would have no rows in any
    /// block).
    ///
    /// # Errors
    /// [`Error::Shape`] for `f32`, [`Error::HeadDimNotCompiled`] for other head dimensions.
    pub(crate) fn for_problem(dtype: DType, shape: &AttentionShape, causal: Causal, sm_count: usize) -> Result<Self> {
        let head_dim = shape.head_dim;
        let rows = BalancedRows::<192>::new(shape.seqlen_q);
        let blocks_192 = rows.blocks * shape.num_heads_q * shape.batch;
        let waves = Self::waves_for_192_rows(causal != Causal::None);
        let rows_192 = head_dim == 64 && rows.full > 0 && blocks_192 >= waves * sm_count;
        if dtype == DType::F32 {
            return Err(Error::Shape("the Hopper forward takes f16 or bf16 tensors".into()));
        }
        // Three consumer warpgroups at head_dim 64 on deep enough grids, else two taking turns;
        // two without turns at every other head_dim.
        let (block_m, pingpong) = match (head_dim, rows_192) {
            (64, true) => (192, false),
            (64, false) => (128, true),
            _ => (128, false),
        };
        let instance = kernels::hopper_instance(FlashKernel::Forward, dtype, (block_m, 128), head_dim, 2, pingpong)
            .ok_or_else(|| Error::HeadDimNotCompiled {
                head_dim,
                allowed: format!("{:?} (the Hopper forward)", kernels::hopper_head_dims(FlashKernel::Forward)),
            })?;
        let HopperInstance { entry, block_m, block_n, stages, pingpong, .. } = *instance;
        Ok(Self { entry, block_m, block_n, stages, pingpong })
    }

    /// The configuration as the entry names it: `m128_n128_s2`, with `_pingpong` when it applies.
    pub(crate) fn config_name(&self) -> String {
        let turns = if self.pingpong { "_pingpong" } else { "" };
        format!("m{}_n{}_s{}{turns}", self.block_m, self.block_n, self.stages)
    }
}

/// A compiled Hopper backward kernel: its entry and ring depth (128 keys per block, query
/// tiles of 64, 384 threads).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HopperBackward {
    pub(crate) entry: &'static str,
    pub(crate) stages: usize,
}

impl HopperBackward {
    /// Query rows per tile of the inner loop.
    pub(crate) const BLOCK_M: usize = 64;
    /// Keys per block.
    pub(crate) const BLOCK_N: usize = 128;
    /// Threads per block: a producer and two consumer warpgroups.
    pub(crate) const THREADS: usize = 384;

    /// The kernel for `dtype` and `head_dim`.
    ///
    /// # Errors
    /// As [`HopperForward::for_problem`].
    pub(crate) fn for_problem(dtype: DType, head_dim: usize) -> Result<Self> {
        if dtype == DType::F32 {
            return Err(Error::Shape("the Hopper backward takes f16 or bf16 tensors".into()));
        }
        let tile = (Self::BLOCK_M, Self::BLOCK_N);
        let instance = kernels::hopper_instance(FlashKernel::Backward, dtype, tile, head_dim, 2, false).ok_or_else(
            || Error::HeadDimNotCompiled {
                head_dim,
                allowed: format!("{:?} (the Hopper backward)", kernels::hopper_head_dims(FlashKernel::Backward)),
            },
        )?;
        Ok(Self { entry: instance.entry, stages: instance.stages })
    }
}

/// The tensor maps of one Hopper kernel launch, in device memory (the kernel's first argument).
struct TensorMaps {
    maps: Arc<CudaSlice<u64>>,
}

/// The tensor maps a context has copied to device memory, by content: a launch whose maps are
/// those of an earlier launch (same tensors, same boxes: every training step, every benchmark
/// repeat) reuses that launch's device copy instead of queueing a host-to-device copy before the
/// kernel, which kept the GPU idle for microseconds per call. A map's content is a function of
/// the tensor's address, shape and box only, and a device copy is never written again, so a hit is
/// always the right map, even for a new tensor at a freed one's address. Holds the last
/// [`TensorMapCache::CAPACITY`] sets.
#[derive(Default)]
pub(crate) struct TensorMapCache {
    entries: Mutex<VecDeque<CachedMaps>>,
}

/// One cached set: the maps' words on the host, and their device copy.
type CachedMaps = (Vec<u64>, Arc<CudaSlice<u64>>);

impl TensorMapCache {
    /// Sets of maps kept (a forward and a backward of a few problems).
    const CAPACITY: usize = 16;

    /// The device copy of `words` (tensor maps back to back), from the cache or copied now on
    /// `stream`. A set that leaves the cache is freed in stream order, after the launches that
    /// read it.
    fn get(&self, stream: &Arc<CudaStream>, words: &[u64]) -> Result<Arc<CudaSlice<u64>>> {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, maps)) = entries.iter().find(|(cached, _)| cached == words) {
            return Ok(Arc::clone(maps));
        }
        let maps = Arc::new(stream.clone_htod(words).during("copying tensor maps to the device")?);
        if entries.len() == Self::CAPACITY {
            entries.pop_front();
        }
        entries.push_back((words.to_vec(), Arc::clone(&maps)));
        Ok(maps)
    }
}

impl KernelArg for TensorMaps {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&*self.maps);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Err(Error::NotOnEmulator("tensor maps (TMA)"))
    }
}

/// Bytes of one core matrix, the unit `wgmma` reads from shared memory (8 rows of 16 bytes).
const CORE_MATRIX_BYTES: usize = 128;

/// A tensor map (`CUtensorMap`, 128 bytes) in device memory, where TMA reads it: the
/// shape, strides and box of a tensor for `cp.async.bulk.tensor`. Kernels take it by pointer
/// (a by-value kernel parameter aligned to 64 bytes would need `__grid_constant__`, which rustc's
/// nvptx backend cannot express).
pub struct TensorMap {
    map: CudaSlice<u64>,
    /// `[box_rows, box_cols]`.
    box_shape: [usize; 2],
}

impl TensorMap {
    /// The box TMA moves per load, `[rows, cols]`.
    pub fn box_shape(&self) -> [usize; 2] {
        self.box_shape
    }
}

impl KernelArg for TensorMap {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&self.map);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Err(Error::NotOnEmulator("tensor maps (TMA)"))
    }
}

/// Which offsets a probe's `wgmma` descriptors carry, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DescriptorOffsets {
    /// Between core matrices adjacent along K (the *leading dimension byte offset*).
    pub leading: usize,
    /// Between core matrices adjacent along M or N (the *stride dimension byte offset*).
    pub stride: usize,
}

impl DescriptorOffsets {
    /// The offsets of the probe's shared-memory layout for depth `k`, as the PTX ISA defines the
    /// two fields: core matrices are stored K-block by K-block within each 8-row block, so
    /// neighbours along K are one core matrix (128 bytes) apart and neighbours along rows
    /// `k / 8` core matrices apart.
    pub fn for_depth(k: usize) -> Self {
        Self { leading: CORE_MATRIX_BYTES, stride: k / 8 * CORE_MATRIX_BYTES }
    }

    /// The offsets of an *MN-major* operand of N = 64 stored as the register-A probe stores B:
    /// core matrices of 8 K-rows × 8 N-values, N-block by N-block within each K-block, so
    /// neighbours along N are 128 bytes apart and neighbours along K 8 · 128. Without swizzling
    /// the fields keep their K-major meaning: the *leading* offset steps along K, the *stride*
    /// offset along N (the other assignment reads outside the tile: measured on an H200).
    pub fn mn_major_n64() -> Self {
        Self { leading: 8 * CORE_MATRIX_BYTES, stride: CORE_MATRIX_BYTES }
    }
}

impl Context {
    /// Whether this context loaded the `sm_90a` kernels: a GPU of compute capability 9.0.
    pub fn has_hopper_kernels(&self) -> bool {
        match &self.backend {
            Backend::Cuda { modules, .. } => modules.iter().all(Option::is_some),
            Backend::Emulated => false,
        }
    }

    /// `Ok` if this context loaded the sm_90a kernels.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the device otherwise.
    fn require_hopper_kernels(&self) -> Result<()> {
        if self.has_hopper_kernels() {
            Ok(())
        } else {
            Err(Error::Unsupported { what: "the sm_90a kernels (wgmma, TMA)", device: self.device().name.clone() })
        }
    }

    /// The kernel path of this context (see [`KernelPath`]).
    pub fn kernel_path(&self) -> KernelPath {
        self.kernel_path
    }

    /// This context on kernel path `path`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for [`KernelPath::Sm90a`] on a context without the sm_90a kernels
    /// (another GPU, or the CPU emulator).
    pub fn with_kernel_path(mut self, path: KernelPath) -> Result<Self> {
        if path == KernelPath::Sm90a {
            self.require_hopper_kernels()?;
        }
        self.kernel_path = path;
        Ok(self)
    }

    /// The Hopper kernel that [`Context::flash_attention_forward`] runs in place of the sm_80
    /// `tile` for `shape` and mask `causal`: on the sm_90a path, for `f16`/`bf16` and head_dim 64
    /// or 128, when `tile` is the built-in default ([`TileConfig::default_for_dtype`]). Any other
    /// tile names the sm_80 kernel to run, so that tile sweeps measure what they ask for.
    pub(crate) fn hopper_forward_for(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        causal: Causal,
        tile: TileConfig,
    ) -> Option<HopperForward> {
        let wanted =
            self.kernel_path == KernelPath::Sm90a && tile == TileConfig::default_for_dtype(dtype, shape.head_dim);
        wanted.then(|| HopperForward::for_problem(dtype, shape, causal, self.device().sm_count).ok()).flatten()
    }

    /// A short name of the kernel [`Context::flash_attention_forward`] runs for `dtype`, `shape`,
    /// mask `causal` and `tile` on this context, for tables: the path and the configuration, e.g.
    /// `sm_90a m192_n128_s2` or `sm_80 m64_n64_s2`.
    pub fn forward_kernel_label(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        causal: Causal,
        tile: TileConfig,
    ) -> String {
        match self.hopper_forward_for(dtype, shape, causal, tile) {
            Some(kernel) => format!("{} {}", KernelPath::Sm90a, kernel.config_name()),
            None => format!("{} {tile}", KernelPath::Sm80),
        }
    }

    /// The kernel entry [`Context::flash_attention_forward`] launches for element type `dtype`,
    /// `shape`, mask `causal` and `tile` on this context: a Hopper kernel
    /// (`hopper_flash_fwd_…`) or the sm_80 kernel of the tile.
    ///
    /// # Errors
    /// As [`TileConfig::validate_kernel`].
    pub fn forward_kernel_entry(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        causal: Causal,
        tile: TileConfig,
    ) -> Result<&'static str> {
        match self.hopper_forward_for(dtype, shape, causal, tile) {
            Some(kernel) => Ok(kernel.entry),
            None => tile.validate_kernel(crate::kernels::FlashKernel::Forward, dtype, shape.head_dim, self.device()),
        }
    }

    /// A tensor map of `tensor`, a row-major `[rows, cols]` matrix of 16-bit floats, for loading
    /// boxes of `[box_rows, box_cols]` (no swizzle; elements outside the matrix read as zero).
    ///
    /// # Errors
    /// [`Error::Shape`] unless the tensor is two-dimensional and 16-bit, its rows a multiple of 16
    /// bytes, and the box within TMA's limits (1–256 per dimension, rows of the box a
    /// multiple of 16 bytes); [`Error::NotOnEmulator`]; [`Error::Driver`] if the driver refuses
    /// the map.
    pub fn tensor_map_2d<T: Element>(
        &self,
        tensor: &DeviceTensor<T>,
        box_rows: usize,
        box_cols: usize,
    ) -> Result<TensorMap> {
        let Backend::Cuda { stream, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("tensor maps (TMA)"));
        };
        self.check_owner("tensor", tensor)?;
        let &[rows, cols] = tensor.shape() else {
            return Err(Error::Shape(format!("a tensor map needs a 2-D tensor; got shape {:?}", tensor.shape())));
        };
        let row_bytes = cols * 2;
        if !row_bytes.is_multiple_of(16)
            || !(box_cols * 2).is_multiple_of(16)
            || !(1..=256).contains(&box_rows)
            || !(1..=256).contains(&box_cols)
        {
            return Err(Error::Shape(format!(
                "tensor map of [{rows}, {cols}] with box [{box_rows}, {box_cols}]: rows and box rows must be \
                 multiples of 16 bytes and the box 1–256 elements per dimension"
            )));
        }
        // Innermost dimension first, as the driver takes them.
        let map = self.encode_tensor_map(
            tensor,
            &[cols as u64, rows as u64],
            &[row_bytes as u64],
            &[box_cols as u32, box_rows as u32],
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )?;
        let map = stream.clone_htod(&map.opaque).during("copying a tensor map to the device")?;
        Ok(TensorMap { map, box_shape: [box_rows, box_cols] })
    }

    /// Probe of `wgmma`: C (64 × 64, `f32`) = A · Bᵀ for A and B of shape `[64, k]` (16-bit, k a
    /// multiple of 16 from 16 to 128), computed by one warpgroup from shared-memory descriptors
    /// carrying `offsets` ([`DescriptorOffsets::for_depth`] is the layout's). Output poisoned
    /// with NaN first.
    ///
    /// # Errors
    /// [`Error::Shape`] for other shapes; [`Error::Unsupported`] off Hopper; [`Error::Driver`].
    pub fn hopper_probe_wgmma<T: Element>(
        &self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
        offsets: DescriptorOffsets,
    ) -> Result<DeviceTensor<f32>> {
        let k = a.shape().get(1).copied().unwrap_or(0);
        let expected = [PROBE_ROWS, k];
        if T::DTYPE == DType::F32
            || a.shape() != expected
            || b.shape() != expected
            || !k.is_multiple_of(16)
            || !(16..=128).contains(&k)
        {
            return Err(Error::Shape(format!(
                "the wgmma probe takes 16-bit A and B of shape [64, k], k a multiple of 16 in 16..=128; got {:?} and {:?}",
                a.shape(),
                b.shape()
            )));
        }
        let c = self.full(&[PROBE_ROWS, PROBE_ROWS], f32::NAN)?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (WARPGROUP_THREADS, 1, 1),
            shared_mem_bytes: (2 * PROBE_ROWS * k * 2) as u32,
        };
        let bf16 = usize::from(T::DTYPE == DType::Bf16);
        self.launch(entry::HOPPER_PROBE_WGMMA, config, &[a, b, &c, &k, &bf16, &offsets.leading, &offsets.stride])?;
        Ok(c)
    }

    /// Probe of `wgmma` with A from registers and B MN-major in shared memory (how P multiplies
    /// V): C (64 × 64, `f32`) = A · B for A `[64, k]` and B `[k, 64]` (16-bit, k a multiple of
    /// 16 from 16 to 128), B's descriptor carrying `offsets` ([`DescriptorOffsets::mn_major_n64`]
    /// is the layout's). Output poisoned with NaN first.
    ///
    /// # Errors
    /// [`Error::Shape`] for other shapes; [`Error::Unsupported`] off Hopper; [`Error::Driver`].
    pub fn hopper_probe_wgmma_register_a<T: Element>(
        &self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
        offsets: DescriptorOffsets,
    ) -> Result<DeviceTensor<f32>> {
        let k = a.shape().get(1).copied().unwrap_or(0);
        if T::DTYPE == DType::F32
            || a.shape() != [PROBE_ROWS, k]
            || b.shape() != [k, PROBE_ROWS]
            || !k.is_multiple_of(16)
            || !(16..=128).contains(&k)
        {
            return Err(Error::Shape(format!(
                "the register-A wgmma probe takes 16-bit A [64, k] and B [k, 64], k a multiple of 16 in 16..=128; \
                 got {:?} and {:?}",
                a.shape(),
                b.shape()
            )));
        }
        let c = self.full(&[PROBE_ROWS, PROBE_ROWS], f32::NAN)?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (WARPGROUP_THREADS, 1, 1),
            shared_mem_bytes: (k * PROBE_ROWS * 2) as u32,
        };
        let bf16 = usize::from(T::DTYPE == DType::Bf16);
        let args: [&dyn KernelArg; 7] = [a, b, &c, &k, &bf16, &offsets.leading, &offsets.stride];
        self.launch(entry::HOPPER_PROBE_WGMMA_REGISTER_A, config, &args)?;
        Ok(c)
    }

    /// FlashAttention forward on Hopper (`kernels/src/flash_forward_wgmma.rs`, the structure of
    /// FlashAttention-3: Shah et al. 2024, Algorithms 1 and 2): O = softmax(Q Kᵀ · scale) V and
    /// the logsumexp, for `f16`/`bf16` tensors of head_dim 64 or 128, with the shapes, masks
    /// (causal either alignment), GQA and scale of [`Context::flash_attention_forward`]. A block
    /// has a producer warpgroup, which loads tiles with TMA, and consumer warpgroups of 64 query
    /// rows each (block_n = 128, a two-stage K/V ring): two (block_m = 128) at head_dim 128; at
    /// 64 three (block_m = 192) on grids at least one wave deep (two under a causal mask) whose
    /// heads fill at least one block of 192 rows, else two taking ping-pong turns. On the sm_90a
    /// path [`Context::flash_attention_forward`] runs this kernel for its default tile.
    ///
    /// # Errors
    /// [`Error::Shape`] for inconsistent shapes or `f32`; [`Error::HeadDimNotCompiled`] for a
    /// head_dim other than 64 or 128; [`Error::InvalidScale`]; [`Error::Unsupported`] off Hopper;
    /// [`Error::Driver`].
    pub fn flash_attention_forward_hopper<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: &AttentionOptions,
    ) -> Result<AttentionOutput<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        HopperForward::for_problem(T::DTYPE, &shape, options.causal, self.device().sm_count)?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.flash_attention_forward_hopper_into(q, k, v, &mut out, options)?;
        Ok(out)
    }

    /// [`Context::flash_attention_forward_hopper`] into existing output tensors.
    pub fn flash_attention_forward_hopper_into<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shape = self.check_attention(q, k, v, &out.o, &out.lse)?;
        let kernel = HopperForward::for_problem(T::DTYPE, &shape, options.causal, self.device().sm_count)?;
        self.launch_hopper_forward(kernel, &shape, q, k, v, out, options)
    }

    /// Runs the Hopper forward `kernel` on tensors of `shape`, which [`Context::check_attention`]
    /// returned for them: the rest of [`Context::flash_attention_forward_hopper_into`], and what
    /// [`Context::flash_attention_forward_into`] runs when [`Context::hopper_forward_for`] picked
    /// `kernel` (so that neither checks the tensors twice).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_hopper_forward<T: Element>(
        &self,
        kernel: HopperForward,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shape = *shape;
        self.require_hopper_kernels()?;
        check_flash_grid(&shape)?;
        let scale_log2 = options.checked_scale(shape.head_dim)? * std::f32::consts::LOG2_E;
        let (s, n) = (&shape, kernel.block_n);
        let maps = self.upload_tensor_maps(&[
            self.attention_tensor_map(q, s.num_heads_q, s.seqlen_q, kernel.block_m, s)?,
            self.attention_tensor_map(k, s.num_heads_kv, s.seqlen_k, n, s)?,
            self.attention_tensor_map(v, s.num_heads_kv, s.seqlen_k, n, s)?,
        ])?;
        let config = flash_config(
            (shape.seqlen_q.div_ceil(kernel.block_m), shape.num_heads_q, shape.batch),
            hopper_forward_threads(kernel.block_m),
            hopper_forward_smem_bytes(kernel.block_m, kernel.block_n, shape.head_dim, kernel.stages),
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 3] = [&maps, &out.o, &out.lse];
        self.launch(kernel.entry, config, &args.with_mask(&head, &[&scale_log2]))
    }

    /// FlashAttention backward on Hopper (`kernels/src/flash_backward_wgmma.rs`: FlashAttention-2's
    /// Algorithm 2 with FlashAttention-3's structure): dQ, dK, dV for `f16`/`bf16` tensors of
    /// head_dim 64 or 128, with the shapes, masks, GQA and scale of
    /// [`Context::flash_attention_backward`]. A block owns 128 keys (two consumer warpgroups of
    /// 64) and loops over query tiles of 64 rows that a producer warpgroup loads with TMA; dQ is
    /// added to an `f32` copy by TMA's atomic reductions (as
    /// [`DqAccumulation::Atomic`]: the last bits of dQ may differ between runs) and rounded at the
    /// end. On the sm_90a path
    /// [`Context::flash_attention_backward`] runs this kernel for its default tile and atomic dQ.
    ///
    /// Extra device memory: D (one `f32` per query row) and the `f32` copy of dQ.
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward_hopper`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_hopper<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        options: &AttentionOptions,
    ) -> Result<Gradients<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        HopperBackward::for_problem(T::DTYPE, shape.head_dim)?;
        let mut grads = self.alloc_gradients(&shape)?;
        self.flash_attention_backward_hopper_into(q, k, v, o, lse, d_o, &mut grads, options)?;
        Ok(grads)
    }

    /// [`Context::flash_attention_backward_hopper`] into existing gradient tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_hopper_into<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shape = self.check_backward(q, k, v, o, lse, d_o, grads)?;
        let kernel = HopperBackward::for_problem(T::DTYPE, shape.head_dim)?;
        self.launch_hopper_backward(kernel, &shape, q, k, v, o, lse, d_o, grads, options)
    }

    /// Runs the Hopper backward `kernel` on tensors of `shape`, which [`Context::check_backward`]
    /// returned for them: the rest of [`Context::flash_attention_backward_hopper_into`], and what
    /// [`Context::flash_attention_backward_into`] runs when [`Context::hopper_backward_for`]
    /// picked `kernel`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_hopper_backward<T: Element>(
        &self,
        kernel: HopperBackward,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shape = *shape;
        self.require_hopper_kernels()?;
        check_flash_grid(&shape)?;
        let scale = options.checked_scale(shape.head_dim)?;
        let delta = self.row_deltas(o, d_o, &shape)?;
        let (s, m, n) = (&shape, HopperBackward::BLOCK_M, HopperBackward::BLOCK_N);
        let mut accum = self.alloc_output::<f32>(&shape.q_shape())?;
        self.fill_zeros(&mut accum)?;
        let maps = self.upload_tensor_maps(&[
            self.attention_tensor_map(q, s.num_heads_q, s.seqlen_q, m, s)?,
            self.attention_tensor_map(k, s.num_heads_kv, s.seqlen_k, n, s)?,
            self.attention_tensor_map(v, s.num_heads_kv, s.seqlen_k, n, s)?,
            self.attention_tensor_map(d_o, s.num_heads_q, s.seqlen_q, m, s)?,
            // The kernel adds each block's share of dQ to this one with TMA.
            self.attention_tensor_map(&accum, s.num_heads_q, s.seqlen_q, m, s)?,
        ])?;
        let config = flash_config(
            (shape.seqlen_k.div_ceil(n), shape.num_heads_kv, shape.batch),
            HopperBackward::THREADS,
            hopper_backward_smem_bytes(shape.head_dim, kernel.stages),
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 5] = [&maps, lse, &delta, &grads.dk, &grads.dv];
        self.launch(kernel.entry, config, &args.with_mask(&head, &[&scale]))?;
        self.round_dq(&accum, &mut grads.dq)
    }

    /// The Hopper backward kernel that [`Context::flash_attention_backward`] runs in place of the
    /// sm_80 ones: on the sm_90a path, for `f16`/`bf16` and the head dimensions it has, when
    /// `tile` is the built-in default ([`TileConfig::default_backward_for_dtype`]) and dQ is
    /// accumulated with atomics.
    pub(crate) fn hopper_backward_for(
        &self,
        dtype: DType,
        head_dim: usize,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Option<HopperBackward> {
        let wanted = self.kernel_path == KernelPath::Sm90a
            && dq == DqAccumulation::Atomic
            && tile == TileConfig::default_backward_for_dtype(dtype, head_dim);
        wanted.then(|| HopperBackward::for_problem(dtype, head_dim).ok()).flatten()
    }

    /// The faster dQ mode for `dtype` and `head_dim` on this context: [`DqAccumulation::Atomic`]
    /// where the Hopper backward runs (it has no deterministic mode), otherwise
    /// [`DqAccumulation::fastest_for`].
    pub fn dq_accumulation_for(&self, dtype: DType, head_dim: usize) -> DqAccumulation {
        let tile = TileConfig::default_backward_for_dtype(dtype, head_dim);
        match self.hopper_backward_for(dtype, head_dim, tile, DqAccumulation::Atomic) {
            Some(_) => DqAccumulation::Atomic,
            None => DqAccumulation::fastest_for(dtype),
        }
    }

    /// A short name of the kernel [`Context::flash_attention_backward`] runs, for tables:
    /// `sm_90a m64_n128_s2` or `sm_80 m64_n128_s2` (see [`Context::forward_kernel_label`]).
    pub fn backward_kernel_label(&self, dtype: DType, head_dim: usize, tile: TileConfig, dq: DqAccumulation) -> String {
        match self.hopper_backward_for(dtype, head_dim, tile, dq) {
            Some(kernel) => format!(
                "{} m{}_n{}_s{}",
                KernelPath::Sm90a,
                HopperBackward::BLOCK_M,
                HopperBackward::BLOCK_N,
                kernel.stages
            ),
            None => format!("{} {tile}", KernelPath::Sm80),
        }
    }

    /// The tensor map of one `[batch, heads, seqlen, head_dim]` attention tensor for the Hopper
    /// kernels: a 3-D map of (head_dim, seqlen, batch · heads), so that a box running past a
    /// head's last row reads zeros (or, for a reduction, skips them) rather than touching the next
    /// head, with boxes of 128 bytes of columns (the 128-byte swizzle's span: 64 16-bit or 32
    /// `f32` values) by `box_rows`, laid out in shared memory with the 128-byte swizzle.
    fn attention_tensor_map<T: Element>(
        &self,
        tensor: &DeviceTensor<T>,
        heads: usize,
        seqlen: usize,
        box_rows: usize,
        shape: &AttentionShape,
    ) -> Result<CUtensorMap> {
        let (d, bytes) = (shape.head_dim, std::mem::size_of::<T>());
        let dims = [d as u64, seqlen as u64, (shape.batch * heads) as u64];
        let strides = [(d * bytes) as u64, (seqlen * d * bytes) as u64];
        let box_dims = [(SWIZZLE_ROW_BYTES / bytes) as u32, box_rows as u32, 1];
        self.encode_tensor_map(tensor, &dims, &strides, &box_dims, CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
    }

    /// Copies tensor maps back to back into one device buffer, the Hopper kernels' first argument
    /// (they are read by TMA, from global memory).
    fn upload_tensor_maps(&self, maps: &[CUtensorMap]) -> Result<TensorMaps> {
        let Backend::Cuda { stream, tensor_maps, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("tensor maps (TMA)"));
        };
        let words: Vec<u64> = maps.iter().flat_map(|map| map.opaque).collect();
        Ok(TensorMaps { maps: tensor_maps.get(stream, &words)? })
    }

    /// Encodes a tensor map of `tensor` with `cuTensorMapEncodeTiled`: `dims` and
    /// `box_dims` innermost first, `strides` in bytes for every dimension but the innermost.
    fn encode_tensor_map<T: Element>(
        &self,
        tensor: &DeviceTensor<T>,
        dims: &[u64],
        strides: &[u64],
        box_dims: &[u32],
        swizzle: CUtensorMapSwizzle,
    ) -> Result<CUtensorMap> {
        let Backend::Cuda { stream, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("tensor maps (TMA)"));
        };
        let data_type = match T::DTYPE {
            DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F32 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        let rank = dims.len();
        debug_assert!(box_dims.len() == rank && strides.len() + 1 == rank);
        let slice = tensor.cuda_slice().expect("a GPU tensor on a GPU context");
        let (address, _guard) = cudarc::driver::DevicePtr::device_ptr(slice, stream);
        let element_strides = vec![1u32; rank];
        let mut map = CUtensorMap { opaque: [0; 16] };
        // SAFETY: every pointer refers to a live local array of the length `rank` implies (the
        // strides one shorter); the address is the tensor's device allocation.
        unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                rank as u32,
                address as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
        }
        .during("encoding a tensor map (cuTensorMapEncodeTiled)")?;
        Ok(map)
    }

    /// Probe of TMA: the 64 × 64 box at column `x`, row `y` of `tensor` (`[rows, cols]`, 16-bit),
    /// loaded by TMA into shared memory (completion on an `mbarrier`) and written back
    /// as a `[64, 64]` tensor; zeros where the box leaves the tensor. Output poisoned first.
    ///
    /// # Errors
    /// As [`Context::tensor_map_2d`]; [`Error::Unsupported`] off Hopper; [`Error::Driver`].
    pub fn hopper_probe_tma<T: Element>(
        &self,
        tensor: &DeviceTensor<T>,
        x: usize,
        y: usize,
    ) -> Result<DeviceTensor<T>> {
        const BOX: usize = 64;
        let map = self.tensor_map_2d(tensor, BOX, BOX)?;
        let out = self.full(&[BOX, BOX], T::from_f32(f32::NAN))?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (WARPGROUP_THREADS, 1, 1),
            // The box, then the 8-byte mbarrier.
            shared_mem_bytes: (BOX * BOX * 2 + 8) as u32,
        };
        let (x, y) = (x as isize, y as isize);
        self.launch(entry::HOPPER_PROBE_TMA, config, &[&map, &out, &x, &y])?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{MODULE_ARCHS, PTX, module_of};
    use attn_kernels::tiles::by_sections;

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
    const HOPPER_SHARED_MEMORY: usize = 227 * 1024;

    /// A problem of `head_dim` whose grid is `blocks` blocks of 192 query rows deep.
    fn shape_of(head_dim: usize, blocks: usize) -> AttentionShape {
        AttentionShape { batch: blocks, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 192, seqlen_k: 192, head_dim }
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
                (128, waves(1), false),
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
                // The entry names the configuration the host launches it with.
                let (m, n, stages) = (forward.block_m, forward.block_n, forward.stages);
                assert!(forward.entry.contains(&format!("_m{m}_n{n}_d{head_dim}_s{stages}")), "{}", forward.entry);
                assert_eq!(forward.entry.ends_with("_pingpong"), forward.pingpong, "{}", forward.entry);
                let deep = head_dim == 64 && blocks >= waves(HopperForward::waves_for_192_rows(causal));
                assert_eq!(forward.block_m, if deep { 192 } else { 128 }, "{}", forward.entry);

                let backward = HopperBackward::for_problem(dtype, head_dim).unwrap();
                assert_eq!(MODULE_ARCHS[module_of(backward.entry)], "sm_90a", "{}", backward.entry);
                assert_eq!(max_threads(backward.entry), Some(HopperBackward::THREADS), "{}", backward.entry);
                let smem = hopper_backward_smem_bytes(head_dim, backward.stages);
                assert!(smem <= HOPPER_SHARED_MEMORY, "{}: {smem} bytes", backward.entry);
            }
        }
    }

    #[test]
    fn hopper_configurations_refuse_f32_and_other_head_dims() {
        assert!(matches!(
            HopperForward::for_problem(DType::F32, &shape_of(64, 1), Causal::None, H200_SMS),
            Err(Error::Shape(_))
        ));
        assert!(matches!(HopperBackward::for_problem(DType::F32, 128), Err(Error::Shape(_))));
        assert!(matches!(
            HopperForward::for_problem(DType::F16, &shape_of(32, 1), Causal::None, H200_SMS),
            Err(Error::HeadDimNotCompiled { head_dim: 32, .. })
        ));
        assert!(matches!(
            HopperBackward::for_problem(DType::Bf16, 256),
            Err(Error::HeadDimNotCompiled { head_dim: 256, .. })
        ));
    }
}

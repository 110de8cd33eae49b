//! Tile-size sweeps and autotuning.
//!
//! [`sweep_tiles`] times every compiled [`TileConfig`] of one flash pass (forward, or backward in
//! both [`DqAccumulation`] modes) on one problem and reports, for each, the facts that decide
//! occupancy: dynamic shared memory per block, registers per thread (read from the function the
//! driver loaded) and the resulting resident blocks per SM. `cargo bench --bench tile_sweep` and
//! `rust-attention --tune` are built on it.
//!
//! [`TunedTiles`] keeps the fastest tile per (pass, dtype, head_dim, masked or not) for one device
//! in a JSON file in the user's cache directory ([`TunedTiles::default_path`]); the main job
//! uses it in place of the built-in defaults ([`TileConfig::default_for_dtype`]) when it was
//! tuned on the same device, and falls back to them for anything it does not cover.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::check::random_normal;
use crate::dtype::from_f32_slice;
use crate::kernels::backward_kernels;
use crate::timing::{tflops, time_gpu};
use crate::{
    AttentionOptions, AttentionShape, Causal, Context, DType, DeviceInfo, DqAccumulation, Element, Error, FlashKernel,
    Result, TileConfig, bf16, f16,
};

/// A FlashAttention pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// O and LSE from Q, K, V.
    Forward,
    /// dQ, dK, dV from Q, K, V, O, LSE and dO.
    Backward,
}

impl Pass {
    /// `forward` or `backward`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Backward => "backward",
        }
    }

    /// Floating-point operations of this pass on `shape` with `causal`, in the field's
    /// convention: the forward's 4·B·Hq·Sq·Sk·D (halved with a mask), the backward 2.5× that.
    pub fn flops(self, shape: &AttentionShape, causal: Causal) -> f64 {
        let forward = AttentionOptions::causal(causal).forward_flops(shape);
        match self {
            Self::Forward => forward,
            Self::Backward => 2.5 * forward,
        }
    }
}

/// One tile of a sweep: how fast it ran and what it asks of an SM.
#[derive(Clone, Debug, Serialize)]
pub struct TileMeasurement {
    /// The pass timed.
    pub pass: Pass,
    /// Element type of Q, K, V, O (and the gradients).
    pub dtype: DType,
    /// Head dimension.
    pub head_dim: usize,
    /// Whether a causal mask was applied (top-left).
    pub causal: bool,
    /// The tile.
    pub tile: TileConfig,
    /// dQ mode of a backward measurement; `None` for the forward.
    pub dq: Option<DqAccumulation>,
    /// Registers per thread of the pass's main kernel (the K/V-outer one in the backward).
    pub registers: usize,
    /// Dynamic shared memory per block of the main kernel, in bytes.
    pub shared_memory_bytes: usize,
    /// Threads per block of the main kernel.
    pub threads: usize,
    /// Blocks of the main kernel that fit on one SM at once (registers, shared memory and
    /// threads together; `cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    pub blocks_per_sm: usize,
    /// Median time of the pass, in milliseconds.
    pub ms: f64,
    /// Throughput in TFLOP/s ([`Pass::flops`]).
    pub tflops: f64,
}

/// Warm-up and timed repeats of each tile in a sweep.
#[derive(Clone, Copy, Debug)]
pub struct SweepTiming {
    /// Untimed runs before timing.
    pub warmup: usize,
    /// Timed runs; the median is reported.
    pub repeats: usize,
}

impl Default for SweepTiming {
    fn default() -> Self {
        Self { warmup: 3, repeats: 10 }
    }
}

/// The number of measurements [`sweep_tiles`] makes for `pass` at `dtype` and `head_dim` (a
/// backward tile counts once per dQ mode): for progress bars.
pub fn sweep_len(pass: Pass, dtype: DType, head_dim: usize) -> usize {
    match pass {
        Pass::Forward => TileConfig::compiled_for(FlashKernel::Forward, dtype, head_dim).len(),
        Pass::Backward => 2 * TileConfig::compiled_for(FlashKernel::Backward, dtype, head_dim).len(),
    }
}

/// Times every compiled tile of `pass` at `dtype` on `shape` (GQA allowed) with `causal`, on fresh
/// normal random inputs; tiles whose shared memory does not fit the device are left out. Calls
/// `on_each` after each measurement (for a progress bar). The result is in compiled order; sort
/// by `ms` for a ranking.
///
/// # Errors
/// [`Error::HeadDimNotCompiled`] if `dtype` has no kernels for `shape.head_dim`; [`Error::Shape`];
/// [`Error::Driver`] (out of device memory for the inputs, a failed launch);
/// [`Error::NotOnEmulator`] on the emulator, which has no registers or occupancy to report.
pub fn sweep_tiles(
    ctx: &Context,
    shape: &AttentionShape,
    dtype: DType,
    causal: Causal,
    pass: Pass,
    timing: SweepTiming,
    on_each: &mut dyn FnMut(&TileMeasurement),
) -> Result<Vec<TileMeasurement>> {
    if ctx.is_emulated() {
        return Err(Error::NotOnEmulator("a tile sweep"));
    }
    AttentionShape::from_qkv(&shape.q_shape(), &shape.kv_shape(), &shape.kv_shape())?;
    TileConfig::default_for_dtype(dtype, shape.head_dim).compiled_entry_for(
        FlashKernel::Forward,
        dtype,
        shape.head_dim,
    )?;
    let sweep = Sweep { ctx, shape, causal, timing };
    match dtype {
        DType::F32 => sweep.run::<f32>(pass, on_each),
        DType::F16 => sweep.run::<f16>(pass, on_each),
        DType::Bf16 => sweep.run::<bf16>(pass, on_each),
    }
}

/// One problem of a sweep.
struct Sweep<'a> {
    ctx: &'a Context,
    shape: &'a AttentionShape,
    causal: Causal,
    timing: SweepTiming,
}

impl Sweep<'_> {
    fn run<T: Element>(&self, pass: Pass, on_each: &mut dyn FnMut(&TileMeasurement)) -> Result<Vec<TileMeasurement>> {
        let (ctx, shape, dtype, d) = (self.ctx, self.shape, T::DTYPE, self.shape.head_dim);
        let upload = |dims: [usize; 4], seed| {
            ctx.upload(&from_f32_slice::<T>(&random_normal(dims.iter().product(), seed)), &dims)
        };
        let (q, k, v) = (upload(shape.q_shape(), 1)?, upload(shape.kv_shape(), 2)?, upload(shape.kv_shape(), 3)?);
        let options = AttentionOptions::causal(self.causal);
        let mut out = ctx.flash_attention_forward(&q, &k, &v, &options, ctx.default_tile(dtype, d))?;
        let mut measurements = Vec::new();
        match pass {
            Pass::Forward => {
                let checked = ctx.check_attention(&q, &k, &v, &out.o, &out.lse)?;
                for tile in TileConfig::compiled_for(FlashKernel::Forward, dtype, d) {
                    if tile.validate_kernel(FlashKernel::Forward, dtype, d, ctx.device()).is_err() {
                        continue;
                    }
                    let ms = self.time(|| {
                        ctx.flash_attention_forward_sm80_into(&checked, &q, &k, &v, &mut out, &options, tile)
                    })?;
                    measurements.push(self.measure(pass, dtype, tile, None, ms)?);
                    on_each(measurements.last().expect("just pushed"));
                }
            }
            Pass::Backward => {
                let d_o = upload(shape.q_shape(), 4)?;
                let default = ctx.default_backward_tile(dtype, d, DqAccumulation::Atomic);
                let mut grads = ctx.flash_attention_backward(
                    &q,
                    &k,
                    &v,
                    &out.o,
                    &out.lse,
                    &d_o,
                    &options,
                    default,
                    DqAccumulation::Atomic,
                )?;
                let (o, lse) = (&out.o, &out.lse);
                let checked = ctx.check_backward(&q, &k, &v, o, lse, &d_o, &grads)?;
                for tile in TileConfig::compiled_for(FlashKernel::Backward, dtype, d) {
                    for dq in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                        let fits = backward_kernels(dq)
                            .iter()
                            .all(|&kernel| tile.validate_kernel(kernel, dtype, d, ctx.device()).is_ok());
                        if !fits {
                            continue;
                        }
                        let ms = self.time(|| {
                            ctx.flash_attention_backward_sm80_into(
                                &checked, &q, &k, &v, o, lse, &d_o, &mut grads, &options, tile, dq,
                            )
                        })?;
                        measurements.push(self.measure(pass, dtype, tile, Some(dq), ms)?);
                        on_each(measurements.last().expect("just pushed"));
                    }
                }
            }
        }
        Ok(measurements)
    }

    fn time(&self, work: impl FnMut() -> Result<()>) -> Result<f64> {
        Ok(time_gpu(self.ctx, self.timing.warmup, self.timing.repeats, work)?.median_ms)
    }

    /// The measurement of `tile` with the resources of the pass's main kernel.
    fn measure(
        &self,
        pass: Pass,
        dtype: DType,
        tile: TileConfig,
        dq: Option<DqAccumulation>,
        ms: f64,
    ) -> Result<TileMeasurement> {
        let d = self.shape.head_dim;
        let kernel = match dq {
            None => FlashKernel::Forward,
            Some(dq) => backward_kernels(dq)[0],
        };
        let entry = tile.compiled_entry_for(kernel, dtype, d)?;
        let threads = tile.threads_for(kernel, dtype, d);
        let shared_memory_bytes = tile.shared_memory_bytes_for(kernel, dtype, d);
        Ok(TileMeasurement {
            pass,
            dtype,
            head_dim: d,
            causal: self.causal != Causal::None,
            tile,
            dq,
            registers: self.ctx.kernel_resources(entry)?.0,
            shared_memory_bytes,
            threads,
            blocks_per_sm: self.ctx.kernel_blocks_per_sm(entry, threads, shared_memory_bytes)?,
            ms,
            tflops: tflops(pass.flops(self.shape, self.causal), ms),
        })
    }
}

/// The fastest tile of one (pass, dtype, head_dim, mask) on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedTile {
    /// The pass.
    pub pass: Pass,
    /// Element type.
    pub dtype: DType,
    /// Head dimension.
    pub head_dim: usize,
    /// Whether it was tuned with a causal mask (either alignment).
    pub causal: bool,
    /// The fastest tile.
    pub tile: TileConfig,
    /// The fastest dQ mode (backward only).
    pub dq: Option<DqAccumulation>,
    /// Its measured throughput, TFLOP/s.
    pub tflops: f64,
}

/// The tuned tiles of one device, as saved by `rust-attention --tune`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedTiles {
    /// The device they were measured on ([`DeviceInfo::name`]); another device ignores the file.
    pub device: String,
    /// Its compute capability.
    pub compute_capability: (i32, i32),
    /// Its SM count (a cut-down part with the same name tunes differently).
    pub sm_count: usize,
    /// The problem size they were measured at, `[batch, num_heads, seqlen]` (head_dim per entry).
    pub shape_class: [usize; 3],
    /// Seconds since the Unix epoch when they were measured.
    pub tuned_at_unix_s: u64,
    /// One entry per (pass, dtype, head_dim, causal).
    pub tiles: Vec<TunedTile>,
}

/// The environment variable that overrides the directory of the tuned-tiles file.
pub const CACHE_DIR_VARIABLE: &str = "RUST_ATTENTION_CACHE_DIR";

impl TunedTiles {
    /// The fastest measurement per (pass, dtype, head_dim, causal) of `measurements`, for `device`.
    pub fn from_measurements(device: &DeviceInfo, shape_class: [usize; 3], measurements: &[TileMeasurement]) -> Self {
        let mut tiles: Vec<TunedTile> = Vec::new();
        for m in measurements {
            let same =
                |t: &&mut TunedTile| (t.pass, t.dtype, t.head_dim, t.causal) == (m.pass, m.dtype, m.head_dim, m.causal);
            let candidate = TunedTile {
                pass: m.pass,
                dtype: m.dtype,
                head_dim: m.head_dim,
                causal: m.causal,
                tile: m.tile,
                dq: m.dq,
                tflops: m.tflops,
            };
            match tiles.iter_mut().find(same) {
                Some(best) if best.tflops >= m.tflops => {}
                Some(best) => *best = candidate,
                None => tiles.push(candidate),
            }
        }
        let tuned_at_unix_s =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_secs());
        Self {
            device: device.name.clone(),
            compute_capability: device.compute_capability,
            sm_count: device.sm_count,
            shape_class,
            tuned_at_unix_s,
            tiles,
        }
    }

    /// `$RUST_ATTENTION_CACHE_DIR/tuned-tiles.json` if that is set, else
    /// `<user cache directory>/rust-attention/tuned-tiles.json` (`~/.cache` on Linux); `None` if
    /// the platform has no cache directory.
    pub fn default_path() -> Option<PathBuf> {
        let dir = match std::env::var_os(CACHE_DIR_VARIABLE) {
            Some(dir) => PathBuf::from(dir),
            None => dirs::cache_dir()?.join("rust-attention"),
        };
        Some(dir.join("tuned-tiles.json"))
    }

    /// Whether these tiles were measured on `device`.
    pub fn matches(&self, device: &DeviceInfo) -> bool {
        self.device == device.name
            && self.compute_capability == device.compute_capability
            && self.sm_count == device.sm_count
    }

    /// Reads the file at `path`: `Ok(None)` if there is none or it was tuned on another device.
    ///
    /// # Errors
    /// [`Error::TunedTiles`] if the file exists but cannot be read or parsed.
    pub fn load(path: &Path, device: &DeviceInfo) -> Result<Option<Self>> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::TunedTiles { path: path.to_owned(), reason: e.to_string() }),
        };
        let tiles: Self = serde_json::from_str(&text)
            .map_err(|e| Error::TunedTiles { path: path.to_owned(), reason: e.to_string() })?;
        Ok(tiles.matches(device).then_some(tiles))
    }

    /// Writes these tiles to `path` (creating its directory), replacing what was there.
    ///
    /// # Errors
    /// [`Error::TunedTiles`] if the directory or file cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        let error = |e: std::io::Error| Error::TunedTiles { path: path.to_owned(), reason: e.to_string() };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(error)?;
        }
        let text = serde_json::to_string_pretty(self).expect("plain data serialises");
        std::fs::write(path, text).map_err(error)
    }

    /// The tuned tile (and dQ mode, for the backward) for `pass` at `dtype`, `head_dim` and
    /// `causal`, if one was tuned and is still compiled into this build.
    pub fn tile(&self, pass: Pass, dtype: DType, head_dim: usize, causal: Causal) -> Option<&TunedTile> {
        let masked = causal != Causal::None;
        self.tiles
            .iter()
            .find(|t| (t.pass, t.dtype, t.head_dim, t.causal) == (pass, dtype, head_dim, masked) && t.still_compiled())
    }
}

impl TunedTile {
    /// Whether every kernel this tile needs is in this build (a file from an older build may
    /// name a tile since removed).
    fn still_compiled(&self) -> bool {
        let kernels = match (self.pass, self.dq) {
            (Pass::Forward, _) => &[FlashKernel::Forward][..],
            (Pass::Backward, dq) => backward_kernels(dq.unwrap_or_default()),
        };
        kernels.iter().all(|&k| self.tile.compiled_entry_for(k, self.dtype, self.head_dim).is_ok())
    }
}

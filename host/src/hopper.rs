//! The Hopper path (compute capability 9.0, PTX for `sm_90a`): tensor maps for the copy engine
//! (TMA) and the probes that check the device crate's Hopper building blocks (`wgmma` from
//! shared-memory descriptors, TMA loads completing on an `mbarrier`; `kernels/src/hopper.rs`).
//!
//! The `sm_90a` module is loaded only on compute capability 9.0 ([`Context::has_hopper_kernels`]);
//! elsewhere these calls return [`Error::Unsupported`]. The CPU emulator does not run them either.

use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{
    CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};

use attn_kernels::emu::Arg;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::context::{Backend, KernelArg};
use crate::dtype::{DType, Element};
use crate::error::{During, Error, Result};
use crate::kernels::entry;
use crate::ops::{AttentionOutput, ProblemArgs, flash_config};
use crate::problem::check_flash_grid;
use crate::{AttentionOptions, AttentionShape};
use crate::{Context, DeviceTensor};

/// Threads of the probe kernels: one warpgroup.
const WARPGROUP_THREADS: u32 = 128;

/// Rows of a `wgmma` tile (m64) and columns of the probe's B (n64).
const PROBE_ROWS: usize = 64;

/// The head dimension of the `wgmma` forward's first version.
const HOPPER_HEAD_DIM: usize = 64;

/// Dynamic shared memory of the `wgmma` forward: Q and two K/V slots, 64 × 64 16-bit values per tile.
const HOPPER_FORWARD_SMEM_BYTES: usize = 5 * 64 * 64 * 2;

/// Bytes of one core matrix, the unit `wgmma` reads from shared memory (8 rows of 16 bytes).
const CORE_MATRIX_BYTES: usize = 128;

/// A tensor map (`CUtensorMap`, 128 bytes) in device memory, where the copy engine reads it: the
/// shape, strides and box of a tensor for `cp.async.bulk.tensor`. Kernels take it by pointer
/// (a by-value kernel parameter aligned to 64 bytes would need `__grid_constant__`, which rustc's
/// nvptx backend cannot express).
pub struct TensorMap {
    map: CudaSlice<u64>,
    /// `[box_rows, box_cols]`.
    box_shape: [usize; 2],
}

impl TensorMap {
    /// The box the copy engine moves per load, `[rows, cols]`.
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

    /// A tensor map of `tensor`, a row-major `[rows, cols]` matrix of 16-bit floats, for loading
    /// boxes of `[box_rows, box_cols]` (no swizzle; elements outside the matrix read as zero).
    ///
    /// # Errors
    /// [`Error::Shape`] unless the tensor is two-dimensional and 16-bit, its rows a multiple of 16
    /// bytes, and the box within the copy engine's limits (1–256 per dimension, rows of the box a
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
        let data_type = match T::DTYPE {
            DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F32 => return Err(Error::Shape("the probes' tensor maps are for 16-bit tensors".into())),
        };
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
        let slice = tensor.cuda_slice().expect("a GPU tensor on a GPU context");
        let (address, _guard) = cudarc::driver::DevicePtr::device_ptr(slice, stream);
        // Innermost dimension first, as the driver takes them.
        let global_dims = [cols as u64, rows as u64];
        let global_strides = [row_bytes as u64];
        let box_dims = [box_cols as u32, box_rows as u32];
        let element_strides = [1u32, 1];
        let mut map = CUtensorMap { opaque: [0; 16] };
        // SAFETY: every pointer refers to a live local array of the length the rank (2) implies;
        // the address is the tensor's device allocation.
        unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                2,
                address as *mut std::ffi::c_void,
                global_dims.as_ptr(),
                global_strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
        }
        .during("encoding a tensor map (cuTensorMapEncodeTiled)")?;
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

    /// FlashAttention forward on Hopper's `wgmma`, first version (`kernels/src/flash_forward_wgmma.rs`):
    /// O = softmax(Q Kᵀ · scale) V and the logsumexp, for `f16`/`bf16` tensors of head_dim 64,
    /// with the shapes, masks (causal either alignment), GQA and scale of
    /// [`Context::flash_attention_forward`]. One warpgroup per 64 query rows, 64-key tiles.
    ///
    /// # Errors
    /// [`Error::Shape`] for inconsistent shapes or `f32`; [`Error::HeadDimNotCompiled`] for a
    /// head_dim other than 64; [`Error::InvalidScale`]; [`Error::Unsupported`] off Hopper;
    /// [`Error::Driver`].
    pub fn flash_attention_forward_hopper<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: &AttentionOptions,
    ) -> Result<AttentionOutput<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
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
        let entry = match T::DTYPE {
            DType::F16 => entry::HOPPER_FLASH_FWD_F16_M64_N64_D64,
            DType::Bf16 => entry::HOPPER_FLASH_FWD_BF16_M64_N64_D64,
            DType::F32 => return Err(Error::Shape("the wgmma forward takes f16 or bf16 tensors".into())),
        };
        if shape.head_dim != HOPPER_HEAD_DIM {
            return Err(Error::HeadDimNotCompiled {
                head_dim: shape.head_dim,
                allowed: format!("{HOPPER_HEAD_DIM} (the wgmma forward's first version)"),
            });
        }
        check_flash_grid(&shape)?;
        let scale_log2 = options.checked_scale(shape.head_dim)? * std::f32::consts::LOG2_E;
        let config = flash_config(
            (shape.seqlen_q.div_ceil(PROBE_ROWS), shape.num_heads_q, shape.batch),
            WARPGROUP_THREADS as usize,
            HOPPER_FORWARD_SMEM_BYTES,
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 5] = [q, k, v, &out.o, &out.lse];
        self.launch(entry, config, &args.with_mask(&head, &[&scale_log2]))
    }

    /// Probe of TMA: the 64 × 64 box at column `x`, row `y` of `tensor` (`[rows, cols]`, 16-bit),
    /// loaded by the copy engine into shared memory (completion on an `mbarrier`) and written back
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

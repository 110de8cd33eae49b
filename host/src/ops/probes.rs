//! **Ops layer.** Probes of the device crate's Hopper building blocks (level 7,
//! `kernels/src/sm90/probes.rs`): `wgmma` from shared-memory descriptors ([`DescriptorOffsets`]), with
//! A from registers, and TMA loads completing on an `mbarrier` ([`Context::tensor_map_2d`]).
//! Like the Hopper passes ([`super::sm90`]) they need the `sm_90a` module.

use cudarc::driver::LaunchConfig;
use cudarc::driver::sys::CUtensorMapSwizzle;

use crate::dtype::{DType, Element};
use crate::error::{During, Error, Result};
use crate::kernels::entry;
use crate::runtime::{Context, DeviceTensor, KernelArg, TensorMap};

/// Threads of the probe kernels: one warpgroup.
const WARPGROUP_THREADS: u32 = 128;

/// Rows of a `wgmma` tile (m64) and columns of the probe's B (n64).
const PROBE_ROWS: usize = 64;

/// Bytes of one core matrix, the unit `wgmma` reads from shared memory (8 rows of 16 bytes).
const CORE_MATRIX_BYTES: usize = 128;

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
        let Some(stream) = self.cuda_stream() else {
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
        Ok(TensorMap::new(map, [box_rows, box_cols]))
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

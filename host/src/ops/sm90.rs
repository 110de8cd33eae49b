//! **Ops layer.** FlashAttention on Hopper (compute capability 9.0, PTX for `sm_90a`; levels 8
//! and 9): the forward and backward passes of `kernels/src/flash_{forward,backward}_wgmma.rs`,
//! launched with the tensor maps from which TMA loads their tiles. Which configuration runs is
//! the selection policy's ([`crate::select`]); the probes of the Hopper building blocks are in
//! [`super::probes`].
//!
//! The `sm_90a` module is loaded only on compute capability 9.0 ([`Context::has_hopper_kernels`]);
//! elsewhere these calls return [`Error::Unsupported`](crate::Error::Unsupported). The CPU
//! emulator does not run them either.

use cudarc::driver::sys::{CUtensorMap, CUtensorMapSwizzle};

use super::args::{ProblemArgs, flash_config};
use super::{AttentionOutput, Gradients, refuse_bias};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::kernels::{HopperInstance, HopperVariant};
use crate::layout::{hopper_backward_smem_bytes, hopper_forward_smem_bytes, hopper_forward_threads};
use crate::problem::{AttentionOptions, AttentionShape, DqAccumulation, check_flash_grid};
use crate::runtime::{Context, DeviceTensor, KernelArg, NullPointer};
use crate::select::{HopperBackward, HopperForward};

/// Bytes of one row of a 128-byte swizzled box: the inner box dimension of the Hopper kernels'
/// tensor maps.
const SWIZZLE_ROW_BYTES: usize = 128;

impl Context {
    /// FlashAttention forward on Hopper (`kernels/src/sm90/forward.rs`, the structure of
    /// FlashAttention-3: Shah et al. 2024, Algorithms 1 and 2): O = softmax(Q Kᵀ · scale) V and
    /// the logsumexp, for `f16`/`bf16` tensors of any head_dim that is a multiple of 8 up to 256
    /// (compiled for 64, 80, 96, 128, 160, 192 and 256; the others run on the next one, the TMA boxes reading
    /// zeros past the last column and the stores skipping it), with the shapes, masks
    /// (causal either alignment), GQA and scale of [`Context::flash_attention_forward`]. A block
    /// has a producer warpgroup, which loads tiles with TMA, and consumer warpgroups of 64 query
    /// rows each over a two-stage K/V ring of block_n keys (128 up to head_dim 128, 96 at 160 and 192, 64
    /// at 256): two (block_m = 128) from head_dim 128 on; at
    /// 64 three (block_m = 192) on grids at least one wave deep (two under a causal mask) whose
    /// heads fill at least one block of 192 rows, else two taking ping-pong turns; with at most 256
    /// keys (1024 under a causal mask) one (block_m = 64), two blocks per SM
    /// (`HopperForward::for_problem`). The grid is persistent where the query blocks outnumber
    /// the blocks that fit on the GPU at once (`HopperForward::grid`), drawing its units from a
    /// counter under a causal mask (dynamic scheduling). On the sm_90a path
    /// [`Context::flash_attention_forward`] runs this kernel for its default tile.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) for inconsistent shapes or `f32`, and for a sequence
    /// or a batch · num_heads above `i32::MAX` (TMA's coordinates are 32-bit);
    /// [`Error::HeadDimNotCompiled`](crate::Error::HeadDimNotCompiled) for a head_dim above 256
    /// or not a multiple of 8 (a tensor map's rows must be multiples of 16 bytes;
    /// [`Context::flash_attention_forward`] runs those on the sm_80 kernels);
    /// [`Error::InvalidScale`](crate::Error::InvalidScale);
    /// [`Error::Unsupported`](crate::Error::Unsupported) off Hopper;
    /// [`Error::Driver`](crate::Error::Driver).
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
        self.check_sinks(&shape, options)?;
        refuse_bias(
            options,
            "Hopper kernels",
            "Context::flash_attention_forward and flash_attention_backward run it on the sm_80 kernels",
        )?;
        if shape.is_empty() {
            return self.write_empty_forward(&shape, out, options);
        }
        let kernel = HopperForward::for_problem(T::DTYPE, &shape, options.causal, self.device().sm_count)?;
        self.launch_hopper_forward(kernel, &shape, q, k, v, out, options)
    }

    /// Runs the Hopper forward `kernel` on tensors of `shape`, which [`Context::check_attention`]
    /// returned for them: the rest of [`Context::flash_attention_forward_hopper_into`], and what
    /// [`Context::flash_attention_forward_into`] runs when the selection policy
    /// ([`Target::hopper_forward`]) picked `kernel` (so that neither checks the tensors twice).
    ///
    /// [`Target::hopper_forward`]: crate::select::Target::hopper_forward
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_hopper_forward<T: Element>(
        &self,
        kernel: &HopperInstance,
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
        check_tma_coordinates(&shape)?;
        let scale_log2 = options.checked_scale(shape.head_dim)? * std::f32::consts::LOG2_E;
        let (s, n) = (&shape, kernel.block_n);
        let maps = self.upload_tensor_maps(&[
            self.attention_tensor_map(q, s.num_heads_q, s.seqlen_q, kernel.block_m, s)?,
            self.attention_tensor_map(k, s.num_heads_kv, s.seqlen_k, n, s)?,
            self.attention_tensor_map(v, s.num_heads_kv, s.seqlen_k, n, s)?,
        ])?;
        let grid = HopperForward::grid(kernel, &shape, options.causal, self.device().sm_count);
        let config = flash_config(
            (grid.blocks, 1, 1),
            hopper_forward_threads(kernel.block_m),
            hopper_forward_smem_bytes(kernel.block_m, kernel.block_n, kernel.head_dim, kernel.stages),
        );
        // A dynamic grid's ticket counter.
        let counter = self.zeroed_counters(grid.dynamic.then_some(1))?;
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 4] = [&maps, &out.o, &out.lse, counters_arg(&counter)];
        self.launch(kernel.entry, config, &args.with_mask(&head, &[&scale_log2]))
    }

    /// FlashAttention backward on Hopper (`kernels/src/sm90/backward.rs`: FlashAttention-2's
    /// Algorithm 2 with FlashAttention-3's structure): dQ, dK, dV for `f16`/`bf16` tensors of
    /// any head_dim that is a multiple of 8 up to 256 (compiled for 64, 80, 96, 128, 160, 192 and 256;
    /// [`DqAccumulation::Deterministic`] up to 128), with the shapes, masks, GQA and scale of
    /// [`Context::flash_attention_backward`]. A block owns 128 keys (two consumer warpgroups of
    /// 64; above head_dim 128, 64 keys that both consumers share, each taking half of every query
    /// tile) and loops over query tiles of 64 rows that a producer warpgroup loads with TMA; dQ is
    /// added to an `f32` copy by TMA's atomic reductions and rounded at the end. With
    /// [`DqAccumulation::Atomic`] the blocks add in whatever order they come, so the last bits of
    /// dQ may differ between runs; with [`DqAccumulation::Deterministic`] they take turns per dQ
    /// tile, in key-block order, and dQ is bit-identical on every run (dK and dV always are). On
    /// the sm_90a path [`Context::flash_attention_backward`] runs this kernel for its default
    /// tile in either dQ mode (`RUST_ATTENTION_HOPPER_DETERMINISTIC=0` sends the deterministic
    /// mode to the sm_80 kernels instead).
    ///
    /// Extra device memory: D (one `f32` per query row), the `f32` copy of dQ, and for the
    /// deterministic mode one `u32` turn counter per 64 query rows.
    ///
    /// [`DqAccumulation::Atomic`]: crate::DqAccumulation::Atomic
    /// [`DqAccumulation::Deterministic`]: crate::DqAccumulation::Deterministic
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward_hopper`]; [`Error::MaskTable`] for deterministic
    /// dQ with a varlen table that has gaps ([`Context::varlen_mask`] says which).
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
        dq: DqAccumulation,
    ) -> Result<Gradients<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        HopperBackward::for_problem(T::DTYPE, shape.head_dim, dq)?;
        let mut grads = self.alloc_gradients(&shape, options)?;
        self.flash_attention_backward_hopper_into(q, k, v, o, lse, d_o, &mut grads, options, dq)?;
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
        dq: DqAccumulation,
    ) -> Result<()> {
        let shape = self.check_backward(q, k, v, o, lse, d_o, grads)?;
        self.check_backward_sinks(&shape, options, grads)?;
        refuse_bias(
            options,
            "Hopper kernels",
            "Context::flash_attention_forward and flash_attention_backward run it on the sm_80 kernels",
        )?;
        if shape.is_empty() {
            return self.write_empty_backward(&shape, grads, options);
        }
        let kernel = HopperBackward::for_problem(T::DTYPE, shape.head_dim, dq)?;
        if !options.hopper_backward_allowed(dq) {
            return Err(Error::MaskTable(
                "this varlen table leaves keys or queries that nobody sees between two sequences; the deterministic \
                 Hopper backward's key blocks take turns on each query tile and need none (run it atomic, or through \
                 Context::flash_attention_backward, which runs the sm_80 kernels then)"
                    .into(),
            ));
        }
        self.launch_hopper_backward(kernel, &shape, q, k, v, o, lse, d_o, grads, options)
    }

    /// Runs the Hopper backward `kernel` on tensors of `shape`, which [`Context::check_backward`]
    /// returned for them: the rest of [`Context::flash_attention_backward_hopper_into`], and what
    /// [`Context::flash_attention_backward_into`] runs when the selection policy
    /// ([`Target::hopper_backward`](crate::select::Target::hopper_backward)) picked `kernel`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_hopper_backward<T: Element>(
        &self,
        kernel: &HopperInstance,
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
        check_tma_coordinates(&shape)?;
        let scale = options.checked_scale(shape.head_dim)?;
        let delta = self.row_deltas(o, d_o, &shape)?;
        self.sink_gradient(&shape, lse, &delta, options, grads)?;
        let (s, m, n) = (&shape, kernel.block_m, kernel.block_n);
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
            hopper_backward_smem_bytes(kernel.head_dim, kernel.stages),
        );
        // The deterministic kernel's turn counters, one per dQ tile of 64 query rows.
        let tiles = shape.batch * shape.num_heads_q * shape.seqlen_q.div_ceil(m);
        let turns = self.zeroed_counters((kernel.variant == HopperVariant::Deterministic).then_some(tiles))?;
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 6] = [&maps, lse, &delta, &grads.dk, &grads.dv, counters_arg(&turns)];
        let entry = match options.score.is_none() {
            true => kernel.entry.to_string(),
            false => modified_entry(kernel.entry),
        };
        self.launch(&entry, config, &args.with_mask(&head, &[&scale]))?;
        self.round_to(&accum, &mut grads.dq)
    }

    /// `count` zeroed `u32` counters in device memory, through which a kernel's blocks take
    /// turns or draw work (held as `i32`, which has the same bits); `None` for a kernel that
    /// reads none.
    fn zeroed_counters(&self, count: Option<usize>) -> Result<Option<DeviceTensor<i32>>> {
        count
            .map(|count| {
                let mut counters = self.alloc_output::<i32>(&[count])?;
                self.fill_zeros(&mut counters)?;
                Ok(counters)
            })
            .transpose()
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
}

/// Checks that TMA can address every row of `shape`'s tensors: the Hopper kernels give a box's
/// row and its (batch · heads) plane as signed 32-bit coordinates, so a sequence or a batch ·
/// heads above `i32::MAX` would wrap around and read or write other rows. Checked before
/// anything is computed or written.
///
/// # Errors
/// [`Error::Shape`] above that limit.
pub(crate) fn check_tma_coordinates(shape: &AttentionShape) -> Result<()> {
    const LIMIT: usize = i32::MAX as usize;
    let longest = shape.seqlen_q.max(shape.seqlen_k);
    let planes = shape.batch * shape.num_heads_q.max(shape.num_heads_kv);
    if longest > LIMIT || planes > LIMIT {
        return Err(Error::Shape(format!(
            "the Hopper kernels address rows and heads with TMA's 32-bit coordinates: seqlen_q = {}, seqlen_k = {} \
             and batch · num_heads = {planes} must each be at most {LIMIT}",
            shape.seqlen_q, shape.seqlen_k
        )));
    }
    Ok(())
}

/// The kernel argument for [`Context::zeroed_counters`]' result: the counters, or a null pointer.
fn counters_arg(counters: &Option<DeviceTensor<i32>>) -> &dyn KernelArg {
    static NONE: NullPointer = NullPointer("i32");
    match counters {
        Some(counters) => counters,
        None => &NONE,
    }
}

/// The entry of a Hopper backward kernel for problems with a score modification: the plain
/// entry's name with `_mods` (each configuration has both, `kernels/src/sm90/backward.rs` says
/// why; the registry lists the plain ones).
fn modified_entry(entry: &str) -> String {
    format!("{entry}_mods")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, num_heads_q: usize, seqlen_q: usize, seqlen_k: usize) -> AttentionShape {
        AttentionShape { batch, num_heads_q, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 64 }
    }

    #[test]
    fn tma_coordinates_stop_at_i32_max() {
        let limit = i32::MAX as usize;
        assert!(check_tma_coordinates(&shape(1, 1, limit, limit)).is_ok());
        assert!(check_tma_coordinates(&shape(1, 1, 1, limit + 1)).is_err());
        assert!(check_tma_coordinates(&shape(1, 1, limit + 1, 1)).is_err());
        assert!(check_tma_coordinates(&shape(65_535, 65_535, 1, 1)).is_err());
        assert!(check_tma_coordinates(&shape(65_535, 32_768, 1, 1)).is_ok());
    }
}

//! The operations: shape checks, output allocation and kernel launches.

use cudarc::driver::LaunchConfig;

use crate::context::{Context, KernelArg};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::kernels::{FlashKernel, entry};
use crate::layout::{ELEMENTWISE_THREADS, SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_THREADS};
use crate::problem::{AttentionOptions, AttentionShape, TileConfig, check_flash_grid};
use crate::tensor::DeviceTensor;

/// The outputs of an attention forward pass: O in the inputs' element type, LSE always `f32`.
#[derive(Debug)]
pub struct AttentionOutput<T: Element = f32> {
    /// O, `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub o: DeviceTensor<T>,
    /// Natural-log logsumexp of each score row, LSE = ln Σ_j exp(scale · q·k_j) over the keys
    /// the row sees (−∞ for a row that sees none), `[batch, num_heads_q, seqlen_q]`; what the
    /// backward pass needs to recompute P.
    pub lse: DeviceTensor,
}

/// The gradients of a loss with respect to the attention inputs, in the inputs' element type.
#[derive(Debug)]
pub struct Gradients<T: Element = f32> {
    /// ∂loss/∂Q, Q's shape `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub dq: DeviceTensor<T>,
    /// ∂loss/∂K, K's shape `[batch, num_heads_kv, seqlen_k, head_dim]` (summed over the query heads
    /// of each group under grouped-query attention).
    pub dk: DeviceTensor<T>,
    /// ∂loss/∂V, V's shape.
    pub dv: DeviceTensor<T>,
}

/// How the FlashAttention backward pass accumulates dQ. Which is faster depends on the kernels:
/// [`DqAccumulation::fastest_for`] gives the measured choice per element type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DqAccumulation {
    /// The K/V-outer kernel adds each key tile's share of dQ to device memory with atomic adds
    /// (for `f16`/`bf16` into an `f32` copy of dQ, rounded by a last small kernel): no second
    /// pass over the tiles, the faster mode for `f32`, but the additions land in a different
    /// order on every run, so the last bits of dQ can differ between runs (dK and dV never do).
    #[default]
    Atomic,
    /// A second kernel, outer loop over query tiles, recomputes P and dS and sums dQ in a fixed
    /// order: bit-identical results on every run, at the cost of recomputing the tiles.
    Deterministic,
}

impl DqAccumulation {
    /// The faster mode on an H200 for `dtype` (see `PERFORMANCE.md`): [`DqAccumulation::Atomic`]
    /// for `f32`; [`DqAccumulation::Deterministic`] for `f16` and `bf16`, whose second kernel
    /// recomputes S and dP on the tensor cores more cheaply than the K/V-outer kernel can add a
    /// 16-bit problem's dQ with `f32` atomics (at 4×16×4096×64: 4.2 ms against 5.2 ms).
    pub fn fastest_for(dtype: DType) -> Self {
        match dtype {
            DType::F32 => Self::Atomic,
            DType::F16 | DType::Bf16 => Self::Deterministic,
        }
    }
}

/// Blocks for a grid-stride loop over `work` items at `per_block` items per block: enough to
/// cover the work, but no more than 32 blocks per SM (beyond that extra blocks only queue).
fn grid_stride_blocks(ctx: &Context, work: usize, per_block: usize) -> u32 {
    let wanted = work.div_ceil(per_block).max(1);
    wanted.min(ctx.device().sm_count * 32) as u32
}

fn one_dim(blocks: u32, threads: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 }
}

/// The problem as kernel arguments, in the kernels' order: the shape's six integers, then (with a
/// mask) the mask flag and diagonal offset.
pub(crate) struct ProblemArgs {
    shape: [usize; 6],
    causal: usize,
    causal_offset: isize,
}

impl ProblemArgs {
    pub(crate) fn new(shape: &AttentionShape, options: &AttentionOptions) -> Self {
        let (causal, causal_offset) = options.causal.kernel_args(shape);
        let s = shape;
        Self {
            shape: [s.batch, s.num_heads_q, s.num_heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim],
            causal,
            causal_offset,
        }
    }

    /// `head`, the six shape integers, then `tail`.
    fn with_shape<'a>(&'a self, head: &[&'a dyn KernelArg], tail: &[&'a dyn KernelArg]) -> Vec<&'a dyn KernelArg> {
        let mut args = head.to_vec();
        args.extend(self.shape.iter().map(|a| a as &dyn KernelArg));
        args.extend_from_slice(tail);
        args
    }

    /// `head`, the shape, the mask flag and offset, then `tail`.
    pub(crate) fn with_mask<'a>(
        &'a self,
        head: &[&'a dyn KernelArg],
        tail: &[&'a dyn KernelArg],
    ) -> Vec<&'a dyn KernelArg> {
        let mut args = self.with_shape(head, &[&self.causal, &self.causal_offset]);
        args.extend_from_slice(tail);
        args
    }
}

impl Context {
    /// C = A + B for two tensors of the same shape (any rank, any length).
    ///
    /// # Errors
    /// [`Error::Shape`] when the shapes differ; [`Error::Driver`] if allocation or launch fails.
    pub fn vector_add(&self, a: &DeviceTensor, b: &DeviceTensor) -> Result<DeviceTensor> {
        let mut c = self.alloc_output(a.shape())?;
        self.vector_add_into(a, b, &mut c)?;
        Ok(c)
    }

    /// C = A + B into an existing tensor of the same shape.
    pub fn vector_add_into(&self, a: &DeviceTensor, b: &DeviceTensor, c: &mut DeviceTensor) -> Result<()> {
        for (name, t) in [("a", a), ("b", b), ("c", &*c)] {
            self.check_owner(name, t)?;
        }
        if a.shape() != b.shape() || a.shape() != c.shape() {
            return Err(Error::Shape(format!(
                "vector_add needs equal shapes; got a {:?}, b {:?}, c {:?}",
                a.shape(),
                b.shape(),
                c.shape()
            )));
        }
        let n = a.len();
        // Each thread handles one 4-float chunk per trip of its grid-stride loop.
        let config = one_dim(grid_stride_blocks(self, n.div_ceil(4), ELEMENTWISE_THREADS), ELEMENTWISE_THREADS);
        self.launch(entry::VECTOR_ADD_F32, config, &[a, b, c, &n])
    }

    /// Standard attention, O = softmax(Q Kᵀ · scale) V, with the `[batch, num_heads_q, seqlen_q,
    /// seqlen_k]` score matrix materialised in device memory (FlashAttention paper, Algorithm 0).
    /// Q is `[batch, num_heads_q, seqlen_q, head_dim]`, K and V are `[batch, num_heads_kv,
    /// seqlen_k, head_dim]` (`num_heads_kv` divides `num_heads_q`); any head_dim; causal masks as
    /// in [`AttentionOptions`].
    ///
    /// Needs [`AttentionShape::naive_workspace_bytes`] of extra device memory for the duration of
    /// the call.
    ///
    /// # Errors
    /// [`Error::Shape`] for inconsistent shapes; [`Error::Driver`] if an allocation (typically
    /// the score matrix) or a launch fails.
    pub fn attention_naive(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        options: &AttentionOptions,
    ) -> Result<AttentionOutput> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.attention_naive_into(q, k, v, &mut out, options)?;
        Ok(out)
    }

    /// [`Context::attention_naive`] into existing output tensors.
    pub fn attention_naive_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        out: &mut AttentionOutput,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shape = self.check_attention(q, k, v, &out.o, &out.lse)?;
        let scores = self.naive_probabilities(q, k, &out.lse, &shape, options)?;
        let args = ProblemArgs::new(&shape, options);
        let pv_threads = shape.head_dim.next_multiple_of(32).min(ELEMENTWISE_THREADS);
        let per_row = one_dim(grid_stride_blocks(self, shape.query_rows(), 1), pv_threads);
        self.launch(entry::NAIVE_PV_F32, per_row, &args.with_shape(&[&scores, v, &out.o], &[&1.0f32]))
        // `scores` is freed here; the driver orders the free after the queued kernels.
    }

    /// P = softmax(S) of the naive path in a new `[batch, heads, seqlen_q, seqlen_k]` buffer, and
    /// its logsumexp into `lse`.
    fn naive_probabilities(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        lse: &DeviceTensor,
        shape: &AttentionShape,
        options: &AttentionOptions,
    ) -> Result<DeviceTensor> {
        let scores = self.alloc_output(&[shape.batch, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k])?;
        let rows = shape.query_rows();
        let scale = options.checked_scale(shape.head_dim)?;
        let args = ProblemArgs::new(shape, options);
        // One block per query row; threads stride over the row's keys.
        let per_row = one_dim(grid_stride_blocks(self, rows, 1), ELEMENTWISE_THREADS);
        self.launch(entry::NAIVE_SCORES_F32, per_row, &args.with_mask(&[q, k, &scores], &[&scale]))?;
        let softmax = one_dim(grid_stride_blocks(self, rows, SOFTMAX_ROWS_PER_BLOCK), SOFTMAX_THREADS);
        self.launch(entry::NAIVE_SOFTMAX_F32, softmax, &[&scores, lse, &rows, &shape.seqlen_k])?;
        Ok(scores)
    }

    /// FlashAttention-2 forward pass (Dao 2023, Algorithm 1): O = softmax(Q Kᵀ · scale) V and the
    /// logsumexp, without materialising the score matrix. Shapes and masks as
    /// [`Context::attention_naive`]. `T` is `f32` (CUDA-core kernels) or [`half::f16`] /
    /// [`half::bf16`] (tensor-core kernels, `f32` accumulation, LSE in `f32`); head_dim must have
    /// compiled kernels for `T` and `tile` must be compiled for it and fit the device's shared
    /// memory ([`TileConfig::validate_kernel`]; defaults: [`TileConfig::default_for_dtype`]).
    ///
    /// On the sm_90a path ([`Context::kernel_path`]) a 16-bit forward pass of head_dim 64 or 128
    /// given the default tile runs the Hopper kernel instead
    /// ([`Context::flash_attention_forward_hopper`]); [`Context::forward_kernel_entry`] names the
    /// kernel a call runs.
    ///
    /// # Errors
    /// [`Error::Shape`], [`Error::HeadDimNotCompiled`], [`Error::TileNotCompiled`],
    /// [`Error::SharedMemory`], [`Error::Driver`].
    pub fn flash_attention_forward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<AttentionOutput<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        // Validate before allocating, so a bad tile costs no device memory.
        tile.validate_kernel(FlashKernel::Forward, T::DTYPE, shape.head_dim, self.device())?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.flash_attention_forward_into(q, k, v, &mut out, options, tile)?;
        Ok(out)
    }

    /// [`Context::flash_attention_forward`] into existing output tensors.
    pub fn flash_attention_forward_into<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        let shape = self.check_attention(q, k, v, &out.o, &out.lse)?;
        if let Some(kernel) = self.hopper_forward_for(T::DTYPE, &shape, options.causal, tile) {
            return self.launch_hopper_forward(kernel, &shape, q, k, v, out, options);
        }
        self.flash_attention_forward_sm80_into(&shape, q, k, v, out, options, tile)
    }

    /// [`Context::flash_attention_forward_into`] on the sm_80 kernel of `tile`, whatever the
    /// kernel path: what the tile sweep measures. `shape` is what
    /// [`Context::check_attention`] returned for these tensors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention_forward_sm80_into<T: Element>(
        &self,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        let shape = *shape;
        let kernel = FlashKernel::Forward;
        let entry = tile.validate_kernel(kernel, T::DTYPE, shape.head_dim, self.device())?;
        check_flash_grid(&shape)?;
        // The forward kernel only ever exponentiates, so it takes the scale with log₂e folded in
        // (it uses exp2); the backward kernels also need the plain scale for dQ and dK, and fold
        // log₂e in themselves.
        let scale_log2 = options.checked_scale(shape.head_dim)? * std::f32::consts::LOG2_E;
        let config = flash_config(
            (shape.seqlen_q.div_ceil(tile.block_m), shape.num_heads_q, shape.batch),
            kernel.threads(T::DTYPE, tile.block_m, tile.block_n),
            tile.shared_memory_bytes_for(kernel, T::DTYPE, shape.head_dim),
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 5] = [q, k, v, &out.o, &out.lse];
        self.launch(entry, config, &args.with_mask(&head, &[&scale_log2]))
    }

    /// FlashAttention-2 backward pass (Dao 2023, Algorithm 2): dQ, dK, dV from Q, K, V, the
    /// forward's O and LSE, and dO = ∂loss/∂O, recomputing attention tiles on chip instead of
    /// reading a stored score matrix. Shapes: O and dO as Q, LSE `[batch, num_heads_q,
    /// seqlen_q]`; element type, masks, scale and head_dim as
    /// [`Context::flash_attention_forward`], which must have produced O and LSE with the same
    /// options. `dq` selects how dQ is summed ([`DqAccumulation`]); defaults for `tile`:
    /// [`TileConfig::default_backward_for_dtype`].
    ///
    /// Extra device memory, all O(seqlen): one `f32` per query row (D = rowsum(dO ∘ O)); with
    /// 16-bit types and atomic dQ also an `f32` copy of dQ to accumulate into.
    ///
    /// On the sm_90a path ([`Context::kernel_path`]) a 16-bit backward pass with the default tile and [`DqAccumulation::Atomic`] runs the Hopper kernel instead
    /// ([`Context::flash_attention_backward_hopper`]); [`Context::dq_accumulation_for`] gives the
    /// mode that is fastest on this context.
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward`]; the backward kernels need more shared memory per
    /// tile than the forward one.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<Gradients<T>> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        for &kernel in backward_kernels(dq) {
            tile.validate_kernel(kernel, T::DTYPE, shape.head_dim, self.device())?;
        }
        let mut grads = self.alloc_gradients(&shape)?;
        self.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, options, tile, dq)?;
        Ok(grads)
    }

    /// [`Context::flash_attention_backward`] into existing gradient tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_into<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<()> {
        let shape = self.check_backward(q, k, v, o, lse, d_o, grads)?;
        if let Some(kernel) = self.hopper_backward_for(T::DTYPE, shape.head_dim, tile, dq) {
            return self.launch_hopper_backward(kernel, &shape, q, k, v, o, lse, d_o, grads, options);
        }
        self.flash_attention_backward_sm80_into(&shape, q, k, v, o, lse, d_o, grads, options, tile, dq)
    }

    /// The sm_80 kernels of `tile` and `dq`, on either kernel path: what
    /// [`Context::flash_attention_backward_into`] runs when no Hopper kernel replaces them, and
    /// what the tile sweep measures. `shape` is what [`Context::check_backward`] returned for
    /// these tensors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention_backward_sm80_into<T: Element>(
        &self,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<()> {
        let shape = *shape;
        let dtype = T::DTYPE;
        let entries: Vec<&'static str> = backward_kernels(dq)
            .iter()
            .map(|&kernel| tile.validate_kernel(kernel, dtype, shape.head_dim, self.device()))
            .collect::<Result<_>>()?;
        check_flash_grid(&shape)?;
        let delta = self.row_deltas(o, d_o, &shape)?;
        let scale = options.checked_scale(shape.head_dim)?;
        let args = ProblemArgs::new(&shape, options);
        let d = shape.head_dim;
        let config = |kernel: FlashKernel| {
            let blocks = match kernel {
                FlashKernel::Backward | FlashKernel::BackwardDkDv => {
                    (shape.seqlen_k.div_ceil(tile.block_n), shape.num_heads_kv, shape.batch)
                }
                FlashKernel::Forward | FlashKernel::BackwardDq => {
                    (shape.seqlen_q.div_ceil(tile.block_m), shape.num_heads_q, shape.batch)
                }
            };
            flash_config(
                blocks,
                kernel.threads(dtype, tile.block_m, tile.block_n),
                tile.shared_memory_bytes_for(kernel, dtype, d),
            )
        };
        let [q_, k_, v_, do_, lse_, delta_]: [&dyn KernelArg; 6] = [q, k, v, d_o, lse, &delta];
        match (dtype, dq) {
            // The f32 kernels share one signature, dQ included.
            (DType::F32, DqAccumulation::Atomic) => {
                // The kernel adds into dQ: start from zero.
                self.fill_zeros(&mut grads.dq)?;
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &grads.dq, &grads.dk, &grads.dv];
                self.launch(entries[0], config(FlashKernel::Backward), &args.with_mask(&head, &[&scale]))
            }
            (DType::F32, DqAccumulation::Deterministic) => {
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &grads.dq, &grads.dk, &grads.dv];
                let args = args.with_mask(&head, &[&scale]);
                self.launch(entries[0], config(FlashKernel::BackwardDkDv), &args)?;
                self.launch(entries[1], config(FlashKernel::BackwardDq), &args)
            }
            // The tensor-core kernels add dQ into an f32 accumulator, rounded to T at the end.
            (_, DqAccumulation::Atomic) => {
                let mut accum = self.alloc_output::<f32>(&shape.q_shape())?;
                self.fill_zeros(&mut accum)?;
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &accum, &grads.dk, &grads.dv];
                self.launch(entries[0], config(FlashKernel::Backward), &args.with_mask(&head, &[&scale]))?;
                self.round_dq(&accum, &mut grads.dq)
            }
            (_, DqAccumulation::Deterministic) => {
                let head: [&dyn KernelArg; 8] = [q_, k_, v_, do_, lse_, delta_, &grads.dk, &grads.dv];
                self.launch(entries[0], config(FlashKernel::BackwardDkDv), &args.with_mask(&head, &[&scale]))?;
                let head: [&dyn KernelArg; 7] = [q_, k_, v_, do_, lse_, delta_, &grads.dq];
                self.launch(entries[1], config(FlashKernel::BackwardDq), &args.with_mask(&head, &[&scale]))
            }
        }
    }

    /// The backward pass of standard attention (FlashAttention paper, Algorithm 3): P is
    /// recomputed into a `[batch, num_heads_q, seqlen_q, seqlen_k]` buffer in device memory, then
    /// dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D) in place of P, dQ = scale · dS K and dK = scale · dSᵀ Q,
    /// each a kernel that reads the N×N buffer from HBM. Shapes and masks as
    /// [`Context::attention_naive`]; O is the forward output (for D = rowsum(dO ∘ O)).
    ///
    /// Extra device memory: the N×N buffer and two `f32` per query row.
    ///
    /// # Errors
    /// [`Error::Shape`]; [`Error::Driver`] if an allocation (typically the N×N buffer) fails.
    pub fn attention_naive_backward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        d_o: &DeviceTensor,
        options: &AttentionOptions,
    ) -> Result<Gradients> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        let mut grads = self.alloc_gradients(&shape)?;
        self.attention_naive_backward_into(q, k, v, o, d_o, &mut grads, options)?;
        Ok(grads)
    }

    /// [`Context::attention_naive_backward`] into existing gradient tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_naive_backward_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        d_o: &DeviceTensor,
        grads: &mut Gradients,
        options: &AttentionOptions,
    ) -> Result<()> {
        let lse = self.alloc_output(&AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?.lse_shape())?;
        let shape = self.check_backward(q, k, v, o, &lse, d_o, grads)?;
        let p = self.naive_probabilities(q, k, &lse, &shape, options)?;
        let delta = self.row_deltas(o, d_o, &shape)?;
        let scale = options.checked_scale(shape.head_dim)?;
        let args = ProblemArgs::new(&shape, options);
        let threads = shape.head_dim.next_multiple_of(32).min(ELEMENTWISE_THREADS);
        let per_kv_row =
            one_dim(grid_stride_blocks(self, shape.batch * shape.num_heads_kv * shape.seqlen_k, 1), threads);
        let per_q_row = one_dim(grid_stride_blocks(self, shape.query_rows(), 1), threads);
        let per_score_row = one_dim(grid_stride_blocks(self, shape.query_rows(), 1), ELEMENTWISE_THREADS);
        // dV = Pᵀ dO, before P is overwritten.
        self.launch(entry::NAIVE_PT_X_F32, per_kv_row, &args.with_shape(&[&p, d_o, &grads.dv], &[&1.0f32]))?;
        // P becomes dS.
        self.launch(entry::NAIVE_DS_F32, per_score_row, &args.with_shape(&[&p, v, d_o, &delta], &[]))?;
        self.launch(entry::NAIVE_PV_F32, per_q_row, &args.with_shape(&[&p, k, &grads.dq], &[&scale]))?;
        self.launch(entry::NAIVE_PT_X_F32, per_kv_row, &args.with_shape(&[&p, q, &grads.dk], &[&scale]))
    }

    /// Rounds the `f32` dQ accumulator of the atomic backward kernels to `dq`'s 16-bit type.
    pub(crate) fn round_dq<T: Element>(&self, accum: &DeviceTensor<f32>, dq: &mut DeviceTensor<T>) -> Result<()> {
        let n = accum.len();
        let convert = one_dim(grid_stride_blocks(self, n / 8, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS);
        let entry =
            if T::DTYPE == DType::F16 { entry::FLASH_BWD_CONVERT_DQ_F16 } else { entry::FLASH_BWD_CONVERT_DQ_BF16 };
        self.launch(entry, convert, &[accum, &*dq, &n])
    }

    /// D = rowsum(dO ∘ O), one `f32` per query row, in a new tensor.
    pub(crate) fn row_deltas<T: Element>(
        &self,
        o: &DeviceTensor<T>,
        d_o: &DeviceTensor<T>,
        shape: &AttentionShape,
    ) -> Result<DeviceTensor<f32>> {
        let delta = self.alloc_output(&shape.lse_shape())?;
        let rows = shape.query_rows();
        let config = one_dim(grid_stride_blocks(self, rows, SOFTMAX_ROWS_PER_BLOCK), SOFTMAX_THREADS);
        let entry = match T::DTYPE {
            DType::F32 => entry::FLASH_BWD_PREPROCESS_F32,
            DType::F16 => entry::FLASH_BWD_PREPROCESS_F16,
            DType::Bf16 => entry::FLASH_BWD_PREPROCESS_BF16,
        };
        self.launch(entry, config, &[o, d_o, &delta, &rows, &shape.head_dim])?;
        Ok(delta)
    }

    /// Uninitialised O and LSE tensors for `shape`, for a kernel to overwrite whole.
    pub(crate) fn alloc_attention_output<T: Element>(&self, shape: &AttentionShape) -> Result<AttentionOutput<T>> {
        Ok(AttentionOutput { o: self.alloc_output(&shape.q_shape())?, lse: self.alloc_output(&shape.lse_shape())? })
    }

    /// Uninitialised dQ, dK, dV tensors for `shape`.
    pub(crate) fn alloc_gradients<T: Element>(&self, shape: &AttentionShape) -> Result<Gradients<T>> {
        Ok(Gradients {
            dq: self.alloc_output(&shape.q_shape())?,
            dk: self.alloc_output(&shape.kv_shape())?,
            dv: self.alloc_output(&shape.kv_shape())?,
        })
    }

    /// Checks owners and shapes of attention inputs and outputs; returns the problem shape.
    pub(crate) fn check_attention<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
    ) -> Result<AttentionShape> {
        for (name, t) in [("q", q), ("k", k), ("v", v), ("o", o)] {
            self.check_owner(name, t)?;
        }
        self.check_owner("lse", lse)?;
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        for (name, got, want) in [("o", o.shape(), &shape.q_shape()[..]), ("lse", lse.shape(), &shape.lse_shape()[..])]
        {
            if got != want {
                return Err(Error::Shape(format!("`{name}` must have shape {want:?}; got {got:?}")));
            }
        }
        Ok(shape)
    }

    /// [`Context::check_attention`] plus dO and the gradients.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_backward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &Gradients<T>,
    ) -> Result<AttentionShape> {
        let shape = self.check_attention(q, k, v, o, lse)?;
        let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
        for (name, t, want) in [
            ("d_o", d_o, q_shape),
            ("dq", &grads.dq, q_shape),
            ("dk", &grads.dk, kv_shape),
            ("dv", &grads.dv, kv_shape),
        ] {
            self.check_owner(name, t)?;
            if t.shape() != want {
                return Err(Error::Shape(format!("`{name}` must have shape {want:?}; got {:?}", t.shape())));
            }
        }
        Ok(shape)
    }
}

/// The kernels a backward pass launches, in order.
pub(crate) fn backward_kernels(dq: DqAccumulation) -> &'static [FlashKernel] {
    match dq {
        DqAccumulation::Atomic => &[FlashKernel::Backward],
        DqAccumulation::Deterministic => &[FlashKernel::BackwardDkDv, FlashKernel::BackwardDq],
    }
}

/// A FlashAttention launch: a `(x, y, z)` grid of `threads`-thread blocks with `smem` bytes of
/// dynamic shared memory.
pub(crate) fn flash_config((x, y, z): (usize, usize, usize), threads: usize, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

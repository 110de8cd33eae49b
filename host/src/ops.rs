//! The operations: shape checks, output allocation and kernel launches.

use cudarc::driver::LaunchConfig;

use crate::context::{Context, KernelArg};
use crate::error::{Error, Result};
use crate::kernels::{FlashKernel, entry};
use crate::layout::{ELEMENTWISE_THREADS, FLASH_THREADS, SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_THREADS};
use crate::problem::{AttentionOptions, AttentionShape, TileConfig, check_flash_grid};
use crate::tensor::DeviceTensor;

/// The outputs of an attention forward pass.
#[derive(Debug)]
pub struct AttentionOutput {
    /// O, `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub o: DeviceTensor,
    /// Natural-log logsumexp of each score row, LSE = ln Σ_j exp(scale · q·k_j) over the keys
    /// the row sees (−∞ for a row that sees none), `[batch, num_heads_q, seqlen_q]`; what the
    /// backward pass needs to recompute P.
    pub lse: DeviceTensor,
}

/// The gradients of a loss with respect to the attention inputs.
#[derive(Debug)]
pub struct Gradients {
    /// ∂loss/∂Q, Q's shape `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub dq: DeviceTensor,
    /// ∂loss/∂K, K's shape `[batch, num_heads_kv, seqlen_k, head_dim]` (summed over the query heads
    /// of each group under grouped-query attention).
    pub dk: DeviceTensor,
    /// ∂loss/∂V, V's shape.
    pub dv: DeviceTensor,
}

/// How the FlashAttention backward pass accumulates dQ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DqAccumulation {
    /// The K/V-outer kernel adds each key tile's share of dQ to device memory with atomic adds:
    /// one kernel, fastest, but the additions land in a different order on every run, so the
    /// last bits of dQ can differ between runs (dK and dV never do).
    #[default]
    Atomic,
    /// A second kernel, outer loop over query tiles, recomputes P and dS and sums dQ in a fixed
    /// order: bit-identical results on every run, at the cost of recomputing the tiles.
    Deterministic,
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
struct ProblemArgs {
    shape: [usize; 6],
    causal: usize,
    causal_offset: isize,
}

impl ProblemArgs {
    fn new(shape: &AttentionShape, options: &AttentionOptions) -> Self {
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
    fn with_mask<'a>(&'a self, head: &[&'a dyn KernelArg], tail: &[&'a dyn KernelArg]) -> Vec<&'a dyn KernelArg> {
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
        let scale = options.scale_for(shape.head_dim);
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
    /// [`Context::attention_naive`]; head_dim must have compiled kernels (32, 64, 128) and `tile`
    /// must be compiled and fit the device's shared memory ([`TileConfig::validate`]).
    ///
    /// # Errors
    /// [`Error::Shape`], [`Error::TileNotCompiled`], [`Error::SharedMemory`], [`Error::Driver`].
    pub fn flash_attention_forward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<AttentionOutput> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        // Validate before allocating, so a bad tile costs no device memory.
        tile.validate(shape.head_dim, self.device())?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.flash_attention_forward_into(q, k, v, &mut out, options, tile)?;
        Ok(out)
    }

    /// [`Context::flash_attention_forward`] into existing output tensors.
    pub fn flash_attention_forward_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        out: &mut AttentionOutput,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        let shape = self.check_attention(q, k, v, &out.o, &out.lse)?;
        let entry = tile.validate(shape.head_dim, self.device())?;
        check_flash_grid(&shape)?;
        // The forward kernel only ever exponentiates, so it takes the scale with log₂e folded in
        // (it uses exp2); the backward kernels also need the plain scale for dQ and dK, and fold
        // log₂e in themselves.
        let scale_log2 = options.scale_for(shape.head_dim) * std::f32::consts::LOG2_E;
        let config = flash_config(
            shape.seqlen_q.div_ceil(tile.block_m),
            shape.num_heads_q,
            shape.batch,
            tile.shared_memory_bytes(shape.head_dim),
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 5] = [q, k, v, &out.o, &out.lse];
        self.launch(entry, config, &args.with_mask(&head, &[&scale_log2]))
    }

    /// FlashAttention-2 backward pass (Dao 2023, Algorithm 2): dQ, dK, dV from Q, K, V, the
    /// forward's O and LSE, and dO = ∂loss/∂O, recomputing attention tiles on chip instead of
    /// reading a stored score matrix. Shapes: O and dO as Q, LSE `[batch, num_heads_q,
    /// seqlen_q]`; masks, scale and head_dim as [`Context::flash_attention_forward`], which must
    /// have produced O and LSE with the same options. `dq` selects how dQ is summed
    /// ([`DqAccumulation`]).
    ///
    /// Extra device memory: one `f32` per query row (D = rowsum(dO ∘ O)).
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward`]; the backward kernels need more shared memory per
    /// tile than the forward one.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        lse: &DeviceTensor,
        d_o: &DeviceTensor,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<Gradients> {
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        for &kernel in backward_kernels(dq) {
            tile.validate_for(kernel, shape.head_dim, self.device())?;
        }
        let mut grads = self.alloc_gradients(&shape)?;
        self.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, options, tile, dq)?;
        Ok(grads)
    }

    /// [`Context::flash_attention_backward`] into existing gradient tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        lse: &DeviceTensor,
        d_o: &DeviceTensor,
        grads: &mut Gradients,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<()> {
        let shape = self.check_backward(q, k, v, o, lse, d_o, grads)?;
        let entries: Vec<&'static str> = backward_kernels(dq)
            .iter()
            .map(|&kernel| tile.validate_for(kernel, shape.head_dim, self.device()))
            .collect::<Result<_>>()?;
        check_flash_grid(&shape)?;
        if dq == DqAccumulation::Atomic {
            // The kernel adds into dQ: start from zero.
            self.fill_zeros(&mut grads.dq)?;
        }
        let delta = self.row_deltas(o, d_o, &shape)?;
        let scale = options.scale_for(shape.head_dim);
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 9] = [q, k, v, d_o, lse, &delta, &grads.dq, &grads.dk, &grads.dv];
        let args = args.with_mask(&head, &[&scale]);
        let (block_m, block_n, d) = (tile.block_m, tile.block_n, shape.head_dim);
        let kv_config = |kernel: FlashKernel| {
            flash_config(
                shape.seqlen_k.div_ceil(block_n),
                shape.num_heads_kv,
                shape.batch,
                kernel.shared_memory_bytes(block_m, block_n, d),
            )
        };
        match dq {
            DqAccumulation::Atomic => self.launch(entries[0], kv_config(FlashKernel::Backward), &args),
            DqAccumulation::Deterministic => {
                self.launch(entries[0], kv_config(FlashKernel::BackwardDkDv), &args)?;
                let smem = FlashKernel::BackwardDq.shared_memory_bytes(block_m, block_n, d);
                let q_config = flash_config(shape.seqlen_q.div_ceil(block_m), shape.num_heads_q, shape.batch, smem);
                self.launch(entries[1], q_config, &args)
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
        let scale = options.scale_for(shape.head_dim);
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

    /// D = rowsum(dO ∘ O), one `f32` per query row, in a new tensor.
    fn row_deltas(&self, o: &DeviceTensor, d_o: &DeviceTensor, shape: &AttentionShape) -> Result<DeviceTensor> {
        let delta = self.alloc_output(&shape.lse_shape())?;
        let rows = shape.query_rows();
        let config = one_dim(grid_stride_blocks(self, rows, SOFTMAX_ROWS_PER_BLOCK), SOFTMAX_THREADS);
        self.launch(entry::FLASH_BWD_PREPROCESS_F32, config, &[o, d_o, &delta, &rows, &shape.head_dim])?;
        Ok(delta)
    }

    /// Uninitialised O and LSE tensors for `shape`, for a kernel to overwrite whole.
    fn alloc_attention_output(&self, shape: &AttentionShape) -> Result<AttentionOutput> {
        Ok(AttentionOutput { o: self.alloc_output(&shape.q_shape())?, lse: self.alloc_output(&shape.lse_shape())? })
    }

    /// Uninitialised dQ, dK, dV tensors for `shape`.
    fn alloc_gradients(&self, shape: &AttentionShape) -> Result<Gradients> {
        Ok(Gradients {
            dq: self.alloc_output(&shape.q_shape())?,
            dk: self.alloc_output(&shape.kv_shape())?,
            dv: self.alloc_output(&shape.kv_shape())?,
        })
    }

    /// Checks owners and shapes of attention inputs and outputs; returns the problem shape.
    fn check_attention(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        lse: &DeviceTensor,
    ) -> Result<AttentionShape> {
        for (name, t) in [("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)] {
            self.check_owner(name, t)?;
        }
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        for (name, t, want) in [("o", o, &shape.q_shape()[..]), ("lse", lse, &shape.lse_shape()[..])] {
            if t.shape() != want {
                return Err(Error::Shape(format!("`{name}` must have shape {want:?}; got {:?}", t.shape())));
            }
        }
        Ok(shape)
    }

    /// [`Context::check_attention`] plus dO and the gradients.
    #[allow(clippy::too_many_arguments)]
    fn check_backward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &DeviceTensor,
        lse: &DeviceTensor,
        d_o: &DeviceTensor,
        grads: &Gradients,
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
fn backward_kernels(dq: DqAccumulation) -> &'static [FlashKernel] {
    match dq {
        DqAccumulation::Atomic => &[FlashKernel::Backward],
        DqAccumulation::Deterministic => &[FlashKernel::BackwardDkDv, FlashKernel::BackwardDq],
    }
}

/// A FlashAttention launch: a `(x, y, z)` grid of 128-thread blocks with `smem` bytes of dynamic
/// shared memory.
fn flash_config(x: usize, y: usize, z: usize, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (FLASH_THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

//! The operations: shape checks, output allocation and kernel launches.

use cudarc::driver::LaunchConfig;

use crate::context::{Context, KernelArg};
use crate::error::{Error, Result};
use crate::kernels::entry;
use crate::layout::{ELEMENTWISE_THREADS, FLASH_THREADS, SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_THREADS};
use crate::problem::{AttentionOptions, AttentionShape, TileConfig, check_flash_grid};
use crate::tensor::DeviceTensor;

/// The outputs of an attention forward pass.
#[derive(Debug)]
pub struct AttentionOutput {
    /// O, `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub o: DeviceTensor,
    /// Natural-log logsumexp of each score row, LSE = ln Σ_j exp(scale · q·k_j),
    /// `[batch, num_heads_q, seqlen_q]`; what the backward pass needs to recompute P.
    pub lse: DeviceTensor,
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
        self.launch(entry::VECTOR_ADD_F32, config, &[a.data(), b.data(), c.data(), &n])
    }

    /// Standard attention, O = softmax(Q Kᵀ · scale) V, with the `[batch, num_heads_q, seqlen_q,
    /// seqlen_k]` score matrix materialised in device memory (FlashAttention paper, Algorithm 0).
    /// Q is `[batch, num_heads_q, seqlen_q, head_dim]`, K and V are `[batch, num_heads_kv,
    /// seqlen_k, head_dim]` (`num_heads_kv` divides `num_heads_q`); any head_dim.
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
        let shape = self.check_attention(q, k, v, out)?;
        let scores = self.alloc_output(&[shape.batch, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k])?;
        let rows = shape.query_rows();
        let scale = options.scale_for(shape.head_dim);
        let shape_args = shape_args(&shape);
        // One block per query row; threads stride over the row's keys (scores) or its head_dim
        // columns (P V).
        let per_row = one_dim(grid_stride_blocks(self, rows, 1), ELEMENTWISE_THREADS);
        let mut args: Vec<&dyn KernelArg> = vec![q.data(), k.data(), scores.data()];
        args.extend(shape_args.iter().map(|a| a as &dyn KernelArg));
        args.push(&scale);
        self.launch(entry::NAIVE_SCORES_F32, per_row, &args)?;

        let softmax = one_dim(grid_stride_blocks(self, rows, SOFTMAX_ROWS_PER_BLOCK), SOFTMAX_THREADS);
        self.launch(entry::NAIVE_SOFTMAX_F32, softmax, &[scores.data(), out.lse.data(), &rows, &shape.seqlen_k])?;

        let pv_threads = shape.head_dim.next_multiple_of(32).min(ELEMENTWISE_THREADS);
        let per_row = one_dim(grid_stride_blocks(self, rows, 1), pv_threads);
        let mut args: Vec<&dyn KernelArg> = vec![scores.data(), v.data(), out.o.data()];
        args.extend(shape_args.iter().map(|a| a as &dyn KernelArg));
        self.launch(entry::NAIVE_PV_F32, per_row, &args)
        // `scores` is freed here; the driver orders the free after the queued kernels.
    }

    /// FlashAttention-2 forward pass (Dao 2023, Algorithm 1): O = softmax(Q Kᵀ · scale) V and the
    /// logsumexp, without materialising the score matrix. Shapes as
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
        let shape = self.check_attention(q, k, v, out)?;
        let entry = tile.validate(shape.head_dim, self.device())?;
        check_flash_grid(&shape)?;
        let scale_log2 = options.scale_for(shape.head_dim) * std::f32::consts::LOG2_E;
        let config = LaunchConfig {
            grid_dim: (shape.seqlen_q.div_ceil(tile.block_m) as u32, shape.num_heads_q as u32, shape.batch as u32),
            block_dim: (FLASH_THREADS as u32, 1, 1),
            shared_mem_bytes: tile.shared_memory_bytes(shape.head_dim) as u32,
        };
        let shape_args = shape_args(&shape);
        let mut args: Vec<&dyn KernelArg> = vec![q.data(), k.data(), v.data(), out.o.data(), out.lse.data()];
        args.extend(shape_args.iter().map(|a| a as &dyn KernelArg));
        args.push(&scale_log2);
        self.launch(entry, config, &args)
    }

    /// Uninitialised O and LSE tensors for `shape`, for a kernel to overwrite whole.
    fn alloc_attention_output(&self, shape: &AttentionShape) -> Result<AttentionOutput> {
        Ok(AttentionOutput { o: self.alloc_output(&shape.q_shape())?, lse: self.alloc_output(&shape.lse_shape())? })
    }

    /// Checks owners and shapes of attention inputs and outputs; returns the problem shape.
    fn check_attention(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        out: &AttentionOutput,
    ) -> Result<AttentionShape> {
        for (name, t) in [("q", q), ("k", k), ("v", v), ("o", &out.o), ("lse", &out.lse)] {
            self.check_owner(name, t)?;
        }
        let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
        if out.o.shape() != shape.q_shape() || out.lse.shape() != shape.lse_shape() {
            return Err(Error::Shape(format!(
                "outputs must be o {:?} and lse {:?}; got o {:?} and lse {:?}",
                shape.q_shape(),
                shape.lse_shape(),
                out.o.shape(),
                out.lse.shape()
            )));
        }
        Ok(shape)
    }
}

/// The shape as the six integer kernel arguments, in the kernels' order.
fn shape_args(shape: &AttentionShape) -> [usize; 6] {
    [shape.batch, shape.num_heads_q, shape.num_heads_kv, shape.seqlen_q, shape.seqlen_k, shape.head_dim]
}

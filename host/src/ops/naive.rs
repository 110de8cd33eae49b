//! **Ops layer.** The CUDA-core kernels without tiling (levels 1 and 2): vector add, and standard
//! attention forward and backward with the score matrix in device memory.

use super::args::{ProblemArgs, grid_stride_blocks, one_dim};
use super::{AttentionOutput, Gradients, refuse_bias};
use crate::error::{Error, Result};
use crate::kernels::entry;
use crate::layout::{ELEMENTWISE_THREADS, SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_THREADS};
use crate::problem::{AttentionOptions, AttentionShape};
use crate::runtime::{Context, DeviceTensor};

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

    // ANCHOR: vector_add_launch
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
        // One thread per 4-float chunk, up to the largest grid (2^31 − 1 blocks); past that the
        // kernel's grid-stride loop takes the rest. (A grid capped at 32 blocks per SM, each
        // thread looping over many chunks, moved 2–5 % fewer bytes per second on an H200 from
        // 2^24 elements on: PERFORMANCE.md.)
        let blocks = n.div_ceil(4).div_ceil(ELEMENTWISE_THREADS).clamp(1, i32::MAX as usize) as u32;
        let config = one_dim(blocks, ELEMENTWISE_THREADS);
        self.launch(entry::VECTOR_ADD_F32, config, &[a, b, c, &n])
    }
    // ANCHOR_END: vector_add_launch

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
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.attention_naive_into(q, k, v, &mut out, options)?;
        Ok(out)
    }

    // ANCHOR: naive_launch
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
        refuse_sinks(options)?;
        refuse_bias(options, "naive kernels", "the flash kernels do")?;
        self.check_mask_table(&shape, options)?;
        if shape.is_empty() {
            return self.write_empty_forward(&shape, out, options);
        }
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
    // ANCHOR_END: naive_launch

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
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        let mut grads = self.alloc_gradients(&shape, options)?;
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
        let lse =
            self.alloc_output(&AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?.lse_shape())?;
        let shape = self.check_backward(q, k, v, o, &lse, d_o, grads)?;
        refuse_sinks(options)?;
        refuse_bias(options, "naive kernels", "the flash kernels do")?;
        self.check_mask_table(&shape, options)?;
        if options.score.softcap.is_some() {
            // Its dS kernel has no factor for the softcap's derivative.
            return Err(Error::ScoreMod(
                "the naive backward pass does not take softcapping; the flash kernels do".into(),
            ));
        }
        if shape.is_empty() {
            return self.write_empty_backward(&shape, grads, options);
        }
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
}

/// The naive kernels' softmax has no attention sinks ([`crate::Sinks`]): refuses them.
///
/// # Errors
/// [`Error::Sinks`].
fn refuse_sinks(options: &AttentionOptions) -> Result<()> {
    match options.sinks {
        Some(_) => Err(Error::Sinks("the naive kernels do not take attention sinks; the flash kernels do".into())),
        None => Ok(()),
    }
}

//! **Ops layer.** Problems too large for one grid. The flash kernels put the heads on grid y and
//! the batch on grid z, where CUDA allows at most 65,535 blocks each; a problem with more runs in
//! chunks of the batch, one launch (or one backward) per chunk, on views of the caller's tensors.
//!
//! First the problem is *folded*: `[B, Hq, S, D]` with `Hkv` key/value heads is, in memory, the
//! same as `[B·Hkv, Hq/Hkv, S, D]` over `[B·Hkv, 1, S, D]` (each key/value head with the query
//! heads of its group is one "sequence"), and the mask is per sequence, so nothing else changes.
//! Then the folded batch is cut into chunks of at most the grid limit (a multiple of 16, so
//! that every chunk starts 16-byte aligned, as the kernels' copies need). Only the group size
//! must fit in one grid dimension.

use super::{AttentionOutput, Gradients};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::problem::{AttentionOptions, AttentionShape, DqAccumulation, TileConfig};
use crate::runtime::{Context, DeviceTensor};

/// One chunk: its folded shape and where its rows start in Q (and O, dO, dQ), in K (and V, dK,
/// dV) and in the LSE, in elements.
struct Chunk {
    shape: AttentionShape,
    q_offset: usize,
    kv_offset: usize,
    lse_offset: usize,
}

impl Context {
    /// Whether `shape`'s grid exceeds this context's limit in heads or batch.
    pub(crate) fn needs_chunks(&self, shape: &AttentionShape) -> bool {
        [shape.batch, shape.num_heads_q, shape.num_heads_kv].iter().any(|&n| n > self.grid_limit)
    }

    /// The chunks of `shape` (see the module docs).
    ///
    /// # Errors
    /// [`Error::Shape`] when one group's query heads alone exceed the grid limit.
    fn chunks(&self, shape: &AttentionShape, options: &AttentionOptions) -> Result<Vec<Chunk>> {
        // Folding renumbers the query heads, and ALiBi's slopes follow the head number.
        if options.score.alibi.is_some() {
            return Err(Error::ScoreMod(format!(
                "ALiBi on more than {} heads or batch entries (a problem run in chunks) is not supported",
                self.grid_limit
            )));
        }
        let group = shape.group_size();
        if group > self.grid_limit {
            return Err(Error::Shape(format!(
                "{} query heads per key/value head must be at most {} (CUDA grid limit)",
                group, self.grid_limit
            )));
        }
        let folded =
            AttentionShape { batch: shape.batch * shape.num_heads_kv, num_heads_q: group, num_heads_kv: 1, ..*shape };
        let limit = self.grid_limit;
        let step = if limit >= 16 { limit / 16 * 16 } else { limit };
        let (q_rows, kv_rows) = (group * shape.seqlen_q, shape.seqlen_k);
        Ok((0..folded.batch)
            .step_by(step)
            .map(|start| Chunk {
                shape: AttentionShape { batch: step.min(folded.batch - start), ..folded },
                q_offset: start * q_rows * shape.head_dim,
                kv_offset: start * kv_rows * shape.head_dim,
                lse_offset: start * q_rows,
            })
            .collect())
    }

    /// [`Context::flash_attention_forward_into`] chunk by chunk.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_in_chunks<T: Element>(
        &self,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        for c in self.chunks(shape, options)? {
            let (q_shape, kv_shape) = (c.shape.q_shape(), c.shape.kv_shape());
            let mut part = AttentionOutput {
                o: out.o.view(c.q_offset, &q_shape)?,
                lse: out.lse.view(c.lse_offset, &c.shape.lse_shape())?,
            };
            let (q, k, v) =
                (q.view(c.q_offset, &q_shape)?, k.view(c.kv_offset, &kv_shape)?, v.view(c.kv_offset, &kv_shape)?);
            self.flash_attention_forward_into(&q, &k, &v, &mut part, options, tile)?;
        }
        Ok(())
    }

    /// [`Context::flash_attention_backward_into`] chunk by chunk (each chunk's sequences are
    /// whole, so its dQ, dK and dV are final: nothing is summed across chunks).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_in_chunks<T: Element>(
        &self,
        shape: &AttentionShape,
        (q, k, v): (&DeviceTensor<T>, &DeviceTensor<T>, &DeviceTensor<T>),
        (o, lse, d_o): (&DeviceTensor<T>, &DeviceTensor<f32>, &DeviceTensor<T>),
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<()> {
        for c in self.chunks(shape, options)? {
            let (q_shape, kv_shape) = (c.shape.q_shape(), c.shape.kv_shape());
            let at_q = |t: &DeviceTensor<T>| t.view(c.q_offset, &q_shape);
            let at_kv = |t: &DeviceTensor<T>| t.view(c.kv_offset, &kv_shape);
            // `check_sinks` refuses sinks and a bias here: no part has a dSinks or a dBias.
            let mut part = Gradients {
                dq: at_q(&grads.dq)?,
                dk: at_kv(&grads.dk)?,
                dv: at_kv(&grads.dv)?,
                d_sinks: None,
                d_bias: None,
            };
            let lse = lse.view(c.lse_offset, &c.shape.lse_shape())?;
            let (q, k, v, o, d_o) = (at_q(q)?, at_kv(k)?, at_kv(v)?, at_q(o)?, at_q(d_o)?);
            self.flash_attention_backward_into(&q, &k, &v, &o, &lse, &d_o, &mut part, options, tile, dq)?;
        }
        Ok(())
    }
}

//! **Ops layer.** The one-call API: [`Context::attention`] and [`Context::attention_backward`]
//! pick the kernel path, the tile and the dQ mode themselves, from the tensors and the device,
//! and the forward's result carries what the backward needs. The calls with explicit tiles
//! ([`Context::flash_attention_forward`], [`Context::flash_attention_backward`]) stay, for
//! measurements and for the guide's levels.

use super::{AttentionOutput, Gradients};
use crate::dtype::Element;
use crate::error::Result;
use crate::problem::{AttentionOptions, AttentionShape};
use crate::runtime::{Context, DeviceTensor};

/// The result of [`Context::attention`]: O and the logsumexp, and the inputs and options that
/// [`Context::attention_backward`] needs (borrowed: the backward reads Q, K and V again, as
/// FlashAttention's backward pass does).
#[derive(Debug)]
pub struct Attention<'a, T: Element = f32> {
    /// O and the LSE (`f32`, natural log, `[batch, num_heads_q, seqlen_q]`).
    pub output: AttentionOutput<T>,
    q: &'a DeviceTensor<T>,
    k: &'a DeviceTensor<T>,
    v: &'a DeviceTensor<T>,
    options: AttentionOptions<'a>,
}

impl<'a, T: Element> Attention<'a, T> {
    /// O, `[batch, num_heads_q, seqlen_q, head_dim]`, in the inputs' element type.
    pub fn o(&self) -> &DeviceTensor<T> {
        &self.output.o
    }

    /// The logsumexp of each score row, `[batch, num_heads_q, seqlen_q]` `f32` (see
    /// [`AttentionOutput::lse`]).
    pub fn lse(&self) -> &DeviceTensor<f32> {
        &self.output.lse
    }

    /// The options of the forward pass, which the backward pass uses too.
    pub fn options(&self) -> &AttentionOptions<'a> {
        &self.options
    }
}

impl Context {
    /// Attention forward, O = softmax(Q Kᵀ · scale) V (FlashAttention: the score matrix never
    /// reaches device memory), with the kernels, tile and path this context runs fastest: the
    /// Hopper kernels on an sm_90a context, the `mma.sync` tensor-core kernels for `f16`/`bf16`
    /// elsewhere, the CUDA-core kernels for `f32`, or the same kernels on the CPU emulator; the
    /// tile is [`Context::default_tile`], which fits the device's shared memory.
    ///
    /// Q is `[batch, num_heads_q, seqlen_q, head_dim]`, K and V `[batch, num_heads_kv, seqlen_k,
    /// head_dim]` (grouped-query attention when `num_heads_kv` divides `num_heads_q`), contiguous,
    /// all of one element type (`f32`, `f16` or `bf16`); head_dim 1 to 256. `options`: the scale
    /// (default 1/√head_dim), the causal mask and its alignment, a sliding window, softcapping
    /// or ALiBi, attention sinks ([`crate::Sinks`]), an additive bias ([`crate::Bias`]), and
    /// whether [`Context::attention_backward`] must be deterministic.
    ///
    /// ```no_run
    /// # fn main() -> attn_host::Result<()> {
    /// use attn_host::{AttentionOptions, Causal, Context, check};
    /// let ctx = Context::new(0)?; // or Context::cpu_emulated()
    /// let shape = [2, 8, 1024, 64];
    /// let n = shape.iter().product();
    /// let q = ctx.upload(&check::random_normal(n, 1), &shape)?;
    /// let k = ctx.upload(&check::random_normal(n, 2), &shape)?;
    /// let v = ctx.upload(&check::random_normal(n, 3), &shape)?;
    /// let forward = ctx.attention(&q, &k, &v, &AttentionOptions::causal(Causal::TopLeft))?;
    /// let d_o = ctx.upload(&check::random_normal(n, 4), &shape)?;
    /// let grads = ctx.attention_backward(&forward, &d_o)?;
    /// let (o, dq) = (forward.o().to_host()?, grads.dq.to_host()?);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward`]: [`Error::Shape`](crate::Error::Shape) for
    /// inconsistent shapes, [`Error::HeadDimNotCompiled`](crate::Error::HeadDimNotCompiled)
    /// above 256, [`Error::InvalidScale`](crate::Error::InvalidScale), a tensor of another
    /// context, [`Error::Driver`](crate::Error::Driver).
    pub fn attention<'a, T: Element>(
        &self,
        q: &'a DeviceTensor<T>,
        k: &'a DeviceTensor<T>,
        v: &'a DeviceTensor<T>,
        options: &AttentionOptions<'a>,
    ) -> Result<Attention<'a, T>> {
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        let tile = self.default_tile(T::DTYPE, shape.head_dim);
        let output = self.flash_attention_forward(q, k, v, options, tile)?;
        Ok(Attention { output, q, k, v, options: *options })
    }

    /// The backward pass of [`Context::attention`]: dQ, dK and dV for dO = ∂loss/∂O (O's shape and
    /// element type), with the forward's inputs and options. dK and dV are summed over each
    /// group's query heads under grouped-query attention. dQ is summed in a fixed order,
    /// bit-identical on every run, when the options ask for it
    /// ([`AttentionOptions::deterministic`]); otherwise in the faster mode on this context
    /// ([`Context::dq_accumulation_for`]). With attention sinks or a bias the gradients carry
    /// theirs too ([`Gradients::d_sinks`], [`Gradients::d_bias`]). Extra device memory: O(seqlen) (one `f32` per
    /// query row, and an `f32` copy of dQ where it is accumulated with atomics).
    ///
    /// # Errors
    /// As [`Context::flash_attention_backward`]; [`Error::Shape`](crate::Error::Shape) when dO's
    /// shape is not O's.
    pub fn attention_backward<T: Element>(
        &self,
        forward: &Attention<'_, T>,
        d_o: &DeviceTensor<T>,
    ) -> Result<Gradients<T>> {
        let Attention { output, q, k, v, options } = forward;
        let head_dim = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?.head_dim;
        let (tile, dq) = self.default_backward_plan(T::DTYPE, head_dim, options.deterministic);
        self.flash_attention_backward(q, k, v, &output.o, &output.lse, d_o, options, tile, dq)
    }
}

//! # attn-candle: the rust-attention kernels in candle, forward and backward
//!
//! [`flash_attn`] takes what `candle_flash_attn::flash_attn` takes (Q, K, V as `[batch, seqlen,
//! heads, head_dim]` tensors, the softmax scale, a causal flag) and runs this project's
//! FlashAttention kernels: on CUDA tensors the GPU kernels (the Hopper kernels on an H100/H200,
//! the `mma.sync` tensor-core kernels on Ampere and Ada, and on Turing for `f16` only, the
//! CUDA-core kernels for `f32`), on CPU
//! tensors the same kernels on the project's CPU emulator (slow: for tests and for machines
//! without a GPU). Unlike `candle_flash_attn` it has a backward: the op records the logsumexp of
//! each score row, and candle's autograd (`Tensor::backward`) runs our backward kernels with it
//! (FlashAttention-2's algorithm, Dao 2023, §3.1–3.2), so a model trains through it.
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! let device = Device::Cpu; // or Device::new_cuda(0)? with the `cuda` feature
//! let q = Tensor::randn(0f32, 1., (1, 100, 8, 64), &device)?; // [batch, seqlen, heads, head_dim]
//! let (k, v) = (q.clone(), q.clone());
//! let o = attn_candle::flash_attn(&q, &k, &v, 1.0 / 8.0, true)?; // causal, Q's shape
//! # Ok(()) }
//! ```
//!
//! [`FlashAttention`] holds every option: the layout (BSHD, as above, or BHSD), the causal mask
//! in either alignment, a sliding window, softcapping, ALiBi, attention sinks, an additive bias
//! (a float attention mask), a deterministic backward, and a variable-length batch packed in one
//! row ([`flash_attn_varlen`], [`FlashAttention::varlen`]).
//! Grouped-query attention comes from the shapes: K and V may have fewer heads than Q, a divisor
//! of them.
//!
//! **How it runs.** The op is a candle [`CustomOp3`] of Q, K, V in `[B, H, S, D]` (BSHD inputs are
//! transposed to it and back around the op: a copy each way, as in the PyTorch bridge). On CUDA it
//! wraps candle's buffers as borrowed tensors ([`Context::tensor_from_raw_parts`]) on a context
//! that runs on the candle device's own stream ([`Context::on_stream`], one per stream, made on
//! first use and kept), so nothing synchronises and the kernels are ordered with candle's own
//! work; the outputs are allocated by the kernels' context on that stream and handed to candle
//! without a copy ([`attn_host::DeviceTensor::into_cuda_slice`]).
//!
//! **Dtypes and sizes.** `f32`, `f16` and `bf16`; head_dim 1 to 256; any sequence lengths (a
//! query row that sees no key gives zeros). Other dtypes, ranks or mismatched shapes are
//! errors that say why (candle's `Error::Wrapped` around [`attn_host::Error`], or
//! `Error::Msg`).

use std::sync::Mutex;

use attn_host::{AttentionOptions, AttentionShape, Context, DeviceTensor, Element, MaskTable, bf16, f16};
pub use attn_host::{Causal, SlidingWindow};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, D, DType, Device, Layout, Shape, Storage, Tensor, WithDType};

/// Attention as `candle_flash_attn::flash_attn` computes it: softmax(Q Kᵀ · `softmax_scale`) V
/// for Q `[batch, seqlen_q, num_heads_q, head_dim]` and K, V `[batch, seqlen_k, num_heads_kv,
/// head_dim]` (`num_heads_kv` dividing `num_heads_q`: grouped-query attention), `f32`, `f16` or
/// `bf16`, all on one device. `causal` hides key j from query i when j > i + seqlen_k −
/// seqlen_q (the diagonal aligned bottom-right, FlashAttention's convention, which decoding with
/// a KV cache needs). Returns O in Q's shape and dtype; its gradient runs our backward kernels.
///
/// # Errors
/// As [`FlashAttention::forward`].
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> candle_core::Result<Tensor> {
    FlashAttention::new().scale(softmax_scale).causal(causal).forward(q, k, v)
}

/// [`flash_attn`] with a sliding window, as `candle_flash_attn::flash_attn_windowed`: query i
/// sees the keys from i + seqlen_k − seqlen_q − `window_size_left` to i + seqlen_k − seqlen_q +
/// `window_size_right`, `None` for no limit on that side (`Some(0)` on the right is causal;
/// Mistral's window W is `(Some(W − 1), Some(0))`).
///
/// # Errors
/// As [`FlashAttention::forward`].
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> candle_core::Result<Tensor> {
    FlashAttention::new().scale(softmax_scale).window(window_size_left, window_size_right).forward(q, k, v)
}

/// Attention over a variable-length batch, as `candle_flash_attn::flash_attn_varlen`: the
/// sequences are packed end to end, Q `[total_q, num_heads_q, head_dim]` and K, V `[total_k,
/// num_heads_kv, head_dim]`, sequence `s` holding query rows `seqlens_q[s] .. seqlens_q[s + 1]`
/// and key rows `seqlens_k[s] .. seqlens_k[s + 1]` (`u32` tensors of `batch + 1` prefix sums),
/// and each query attends only to the keys of its own sequence (`causal`: only to those at or
/// before it, aligned bottom-right per sequence as in FlashAttention, so that a sequence's last
/// query sees all of its keys). Returns O in Q's shape and dtype; its gradient runs our
/// backward kernels.
///
/// The batch runs as one packed row with a mask table, so the kernels skip the key tiles of
/// other sequences and the work follows the real tokens: a document mask where queries and keys
/// share their lengths (self-attention: training, prefill; [`FlashAttention::varlen`]), a
/// varlen table where they differ (chunked prefill against cached keys, cross-attention;
/// [`FlashAttention::varlen_qk`]). `max_seqlen_q` and `max_seqlen_k` are only checked (the
/// kernels need no bound), so code written for `candle_flash_attn` runs unchanged.
///
/// # Errors
/// As [`FlashAttention::forward_varlen`], and `candle_core::Error::Msg` for offsets that are not
/// a 1-dimensional `u32` tensor, and for a sequence longer than its `max_seqlen`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let offsets = |name: &str, t: &Tensor| {
        if t.dtype() != DType::U32 || t.rank() != 1 {
            candle_core::bail!(
                "attn_candle: {name} must be a 1-dimensional u32 tensor of offsets, not {:?} of shape {:?}",
                t.dtype(),
                t.dims()
            );
        }
        t.to_vec1::<u32>()
    };
    let (cu_q, cu_k) = (offsets("seqlens_q", seqlens_q)?, offsets("seqlens_k", seqlens_k)?);
    for (name, cu, max) in [("q", &cu_q, max_seqlen_q), ("k", &cu_k, max_seqlen_k)] {
        let longest = cu.windows(2).map(|w| w[1].saturating_sub(w[0]) as usize).max().unwrap_or(0);
        if longest > max {
            candle_core::bail!(
                "attn_candle: a sequence of {longest} tokens in seqlens_{name} is longer than max_seqlen_{name} = {max}"
            );
        }
    }
    let attention = FlashAttention::new().scale(softmax_scale).causal(causal);
    let attention = if cu_q == cu_k { attention.varlen(&cu_q) } else { attention.varlen_qk(&cu_q, &cu_k) };
    attention.forward_varlen(q, k, v)
}

/// Attention written with candle's own operations, for comparisons (the tests' oracle, the
/// training example's baseline): softmax(Q Kᵀ · `softmax_scale` + mask) V on BHSD tensors (Q
/// `[B, Hq, Sq, D]`, K and V `[B, Hkv, Sk, D]`, Hkv dividing Hq) of any float dtype, with
/// `visible(i, j)` saying whether query i sees key j. The scores and P are in the inputs' dtype
/// and the softmax in `f32` (`f64` for `f64` inputs), as a framework's unfused attention; a row
/// that sees no key gives zeros (as the kernels do). It materialises the `[B, Hq, Sq, Sk]`
/// scores, so it is for small problems; candle differentiates it.
///
/// # Errors
/// Shapes that do not fit together; candle's own errors.
pub fn plain_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f64,
    visible: impl Fn(usize, usize) -> bool,
) -> candle_core::Result<Tensor> {
    plain_attention_with(q, k, v, softmax_scale, visible, None, None)
}

/// [`plain_attention`] with an additive `bias` (broadcastable to `[B, Hq, Sq, Sk]`, added to the
/// scaled scores) and attention `sinks` (`[Hq]`, one logit per query head that joins each row's
/// softmax as a key with no value), where given: [`FlashAttention::bias`] and
/// [`FlashAttention::sinks`] written out. A row that sees no key gives zeros.
///
/// # Errors
/// As [`plain_attention`].
pub fn plain_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f64,
    visible: impl Fn(usize, usize) -> bool,
    bias: Option<&Tensor>,
    sinks: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (b, hq, sq, d) = q.dims4()?;
    let (_, hkv, sk, _) = k.dims4()?;
    if hkv == 0 || hq % hkv != 0 {
        candle_core::bail!("attn_candle: {hkv} key/value heads do not divide {hq} query heads");
    }
    // Each K/V head repeated for the query heads of its group.
    let expand = |t: &Tensor| t.unsqueeze(2)?.expand((b, hkv, hq / hkv, sk, d))?.reshape((b, hq, sk, d));
    let (k, v) = (expand(k)?, expand(v)?);
    let softmax_dtype = if q.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let mut scores = (q.matmul(&k.t()?.contiguous()?)?.to_dtype(softmax_dtype)? * softmax_scale)?;
    if let Some(bias) = bias {
        scores = scores.broadcast_add(&bias.to_dtype(softmax_dtype)?)?;
    }
    let mask: Vec<f64> = (0..sq * sk).map(|n| if visible(n / sk, n % sk) { 0.0 } else { f64::NEG_INFINITY }).collect();
    let scores = scores.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?.to_dtype(softmax_dtype)?)?;
    let sinks = sinks.map(|s| s.to_dtype(softmax_dtype)?.reshape((1, hq, 1, 1))).transpose()?;
    // A row that sees no key has the maximum −∞: shift it by 0 instead, so its exponentials are 0
    // and its sum (made 1) gives zeros rather than NaN. A sink takes part in the maximum and
    // adds its exponential to the sum only.
    let mut max = scores.max_keepdim(D::Minus1)?;
    if let Some(sinks) = &sinks {
        max = max.broadcast_maximum(sinks)?;
    }
    let max = max.ne(f64::NEG_INFINITY)?.where_cond(&max, &max.zeros_like()?)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let mut sum = e.sum_keepdim(D::Minus1)?;
    if let Some(sinks) = &sinks {
        sum = (sum + sinks.broadcast_sub(&max)?.exp()?)?;
    }
    let sum = sum.ne(0.0)?.where_cond(&sum, &sum.ones_like()?)?;
    e.broadcast_div(&sum)?.to_dtype(q.dtype())?.matmul(&v)
}

/// The order of a tensor's dimensions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TensorLayout {
    /// `[batch, seqlen, heads, head_dim]`: FlashAttention's and most models' projections.
    #[default]
    Bshd,
    /// `[batch, heads, seqlen, head_dim]`: what the kernels read (no transposition).
    Bhsd,
}

/// Attention with every option the kernels take, built up from [`FlashAttention::new`] (BSHD,
/// no mask, scale 1/√head_dim) and run by [`FlashAttention::forward`].
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// # let (q, k, v) = (candle_core::Tensor::zeros((1, 4, 16, 64), candle_core::DType::F32, &candle_core::Device::Cpu)?, candle_core::Tensor::zeros((1, 4, 16, 64), candle_core::DType::F32, &candle_core::Device::Cpu)?, candle_core::Tensor::zeros((1, 4, 16, 64), candle_core::DType::F32, &candle_core::Device::Cpu)?);
/// use attn_candle::{Causal, FlashAttention, TensorLayout};
/// let attention = FlashAttention::new().layout(TensorLayout::Bhsd).mask(Causal::TopLeft).softcap(50.0);
/// let o = attention.forward(&q, &k, &v)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct FlashAttention {
    /// The offsets of a packed row's sequences ([`FlashAttention::varlen`]); their queries'
    /// where they have keys of their own lengths.
    cu_seqlens: Option<std::sync::Arc<[u32]>>,
    /// The offsets of the sequences' keys, where they differ from `cu_seqlens`
    /// ([`FlashAttention::varlen_qk`]).
    cu_seqlens_k: Option<std::sync::Arc<[u32]>>,
    scale: Option<f32>,
    causal: Causal,
    window: Option<SlidingWindow>,
    softcap: Option<f32>,
    alibi_max_bias: Option<f32>,
    /// `f32` `[num_heads_q]` ([`FlashAttention::sinks`]).
    sinks: Option<Tensor>,
    /// `f32` `[batch or 1, num_heads_q or 1, seqlen_q, seqlen_k]` ([`FlashAttention::bias`]).
    bias: Option<Tensor>,
    deterministic: bool,
    layout: TensorLayout,
}

impl FlashAttention {
    /// BSHD tensors, no mask, scale 1/√head_dim, the faster (atomic) dQ accumulation.
    pub fn new() -> Self {
        Self::default()
    }

    /// The score scale (default 1/√head_dim); it must be finite.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// `true`: the causal mask aligned bottom-right (FlashAttention's); `false`: none.
    pub fn causal(self, causal: bool) -> Self {
        self.mask(if causal { Causal::BottomRight } else { Causal::None })
    }

    /// The causal mask in either alignment: [`Causal::TopLeft`] is PyTorch's `is_causal`
    /// (j ≤ i), [`Causal::BottomRight`] FlashAttention's (j ≤ i + seqlen_k − seqlen_q).
    pub fn mask(mut self, causal: Causal) -> Self {
        self.causal = causal;
        self
    }

    /// A sliding window aligned bottom-right, as [`flash_attn_windowed`]'s; intersected with the
    /// causal mask if there is one.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Some(SlidingWindow::new(left, right));
        self
    }

    /// Any sliding window ([`SlidingWindow`], either alignment).
    pub fn sliding_window(mut self, window: SlidingWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// Logit softcapping, `cap · tanh(s / cap)` on each scaled score (Gemma 2, Grok); `cap` > 0.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// ALiBi (Press et al. 2022): the score of query i and key j minus slope_h · |i + seqlen_k −
    /// seqlen_q − j|, with the paper's slopes for the query heads (`max_bias` 8 in the paper).
    pub fn alibi(mut self, max_bias: f32) -> Self {
        self.alibi_max_bias = Some(max_bias);
        self
    }

    /// Attention sinks (GPT-OSS): one logit per query head, an `f32` tensor `[num_heads_q]` on
    /// Q's device, that joins every row's softmax as a key with no value (`attn_host::Sinks`
    /// says how; a row that sees no key gets zeros). To autograd the sinks are a constant: the
    /// backward returns dQ, dK and dV with the sinks taken into account, not dSinks, so
    /// [`FlashAttention::forward`] refuses sinks that track a gradient (a [`candle_core::Var`],
    /// or a tensor computed from one) rather than leave it out silently. Give `sinks.detach()`
    /// to use such a tensor as a constant; the PyTorch bridge and `attn_host` return dSinks.
    pub fn sinks(mut self, sinks: &Tensor) -> Self {
        self.sinks = Some(sinks.clone());
        self
    }

    /// An additive bias on the logits: the logit of query `i` and key `j` of batch entry `b`
    /// and query head `h` becomes `scale · q·k + bias[b][h][i][j]` (Swin's and T5's position
    /// biases, a float attention mask; −∞ hides the key from that query). An `f32` tensor
    /// `[batch or 1, num_heads_q or 1, seqlen_q, seqlen_k]` on Q's device, a dimension of 1
    /// broadcast, in this order whatever [`FlashAttention::layout`] says (`[1, H or 1, total_q,
    /// total_k]` for [`FlashAttention::forward_varlen`]). It runs the sm_80 kernels, also on
    /// Hopper, and cannot be combined with softcapping (`attn_host::Bias`). A constant to
    /// autograd, as [`FlashAttention::sinks`] says: a bias that tracks a gradient is refused
    /// (`bias.detach()` uses it as a constant; the PyTorch bridge and `attn_host` return dBias).
    pub fn bias(mut self, bias: &Tensor) -> Self {
        self.bias = Some(bias.clone());
        self
    }

    /// Whether the backward sums dQ in a fixed order, bit-identical on every run (slower).
    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// The layout of Q, K, V and O.
    pub fn layout(mut self, layout: TensorLayout) -> Self {
        self.layout = layout;
        self
    }

    /// A variable-length batch packed in one row: sequence `s` holds tokens `cu_seqlens[s] ..
    /// cu_seqlens[s + 1]` (prefix sums from 0 to the row's length; FlashAttention's
    /// `cu_seqlens`), and each token attends only to its own sequence (a document mask: the
    /// kernels skip the other sequences' tiles). Run it with [`FlashAttention::forward_varlen`] on
    /// `[total, heads, head_dim]` tensors, or with [`FlashAttention::forward`] on a batch of one
    /// row; causal masks, windows and ALiBi then count positions inside each sequence.
    pub fn varlen(mut self, cu_seqlens: &[u32]) -> Self {
        (self.cu_seqlens, self.cu_seqlens_k) = (Some(cu_seqlens.into()), None);
        self
    }

    /// A variable-length batch whose queries and keys differ in length: sequence `s` holds
    /// queries `cu_seqlens_q[s] .. cu_seqlens_q[s + 1]` and keys `cu_seqlens_k[s] ..
    /// cu_seqlens_k[s + 1]` of one packed row (FlashAttention's `cu_seqlens_q` and
    /// `cu_seqlens_k`), its queries see only its keys, and the causal mask and window apply to
    /// each sequence on its own lengths ([`Context::varlen_mask`]; [`FlashAttention::causal`]'s
    /// bottom-right alignment lets a sequence's last query see all of its keys). For chunked
    /// prefill and ragged cross-attention; run it with [`FlashAttention::forward_varlen`] on Q
    /// `[total_q, Hq, D]` and K, V `[total_k, Hkv, D]`. ALiBi counts positions along the packed
    /// row, not per sequence, so it is refused here.
    pub fn varlen_qk(mut self, cu_seqlens_q: &[u32], cu_seqlens_k: &[u32]) -> Self {
        (self.cu_seqlens, self.cu_seqlens_k) = (Some(cu_seqlens_q.into()), Some(cu_seqlens_k.into()));
        self
    }

    /// [`FlashAttention::forward`] on packed `[total, heads, head_dim]` Q, K, V (the varlen
    /// layout: [`FlashAttention::varlen`], or [`FlashAttention::varlen_qk`] where K and V have
    /// `total_k` rows of their own); returns O `[total_q, num_heads_q, head_dim]`.
    ///
    /// # Errors
    /// As [`FlashAttention::forward`]; `candle_core::Error::Msg` for tensors that are not
    /// 3-dimensional, without [`FlashAttention::varlen`] or [`FlashAttention::varlen_qk`], for
    /// offsets that do not start at 0, decrease, or do not end at the rows of Q (and of K and V),
    /// for query and key offsets of different counts, and for ALiBi with
    /// [`FlashAttention::varlen_qk`].
    pub fn forward_varlen(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 3 {
                candle_core::bail!(
                    "attn_candle: {name} has shape {:?}; varlen attention takes [total, heads, head_dim] tensors",
                    t.dims()
                );
            }
        }
        let Some(cu_seqlens) = &self.cu_seqlens else {
            candle_core::bail!(
                "attn_candle: forward_varlen needs the sequences' offsets (FlashAttention::varlen or varlen_qk)"
            );
        };
        let check = |name: &str, cu: &[u32], tensors: &str, rows: &[usize]| {
            let (first, last) = (cu.first().copied(), cu.last().copied());
            if first != Some(0)
                || rows.iter().any(|&n| last != Some(n as u32) || n > u32::MAX as usize)
                || cu.windows(2).any(|w| w[1] < w[0])
            {
                candle_core::bail!(
                    "attn_candle: {name} must start at 0, never decrease and end at the rows of {tensors} ({rows:?}); \
                     got {} offsets from {first:?} to {last:?}",
                    cu.len()
                );
            }
            Ok(())
        };
        let (q_rows, k_rows) = (q.dim(0)?, [k.dim(0)?, v.dim(0)?]);
        match &self.cu_seqlens_k {
            None => check("cu_seqlens", cu_seqlens, "q, k and v", &[q_rows, k_rows[0], k_rows[1]])?,
            Some(cu_k) => {
                check("cu_seqlens_q", cu_seqlens, "q", &[q_rows])?;
                check("cu_seqlens_k", cu_k, "k and v", &k_rows)?;
                if cu_k.len() != cu_seqlens.len() {
                    candle_core::bail!(
                        "attn_candle: cu_seqlens_q has {} offsets and cu_seqlens_k {}; one pair per sequence",
                        cu_seqlens.len(),
                        cu_k.len()
                    );
                }
                if self.alibi_max_bias.is_some() {
                    candle_core::bail!(
                        "attn_candle: ALiBi counts positions along the packed row; with varlen_qk it would cross sequences"
                    );
                }
            }
        }
        let packed = self.clone().layout(TensorLayout::Bshd);
        packed.forward(&q.unsqueeze(0)?, &k.unsqueeze(0)?, &v.unsqueeze(0)?)?.squeeze(0)
    }

    /// The mask table of the varlen offsets on `ctx`, if there are any: a document mask for
    /// [`FlashAttention::varlen`], a varlen table with this causal mask and window per sequence
    /// for [`FlashAttention::varlen_qk`].
    fn mask_table(&self, ctx: &Context) -> candle_core::Result<Option<MaskTable>> {
        let Some(cu_seqlens) = &self.cu_seqlens else { return Ok(None) };
        let signed = |cu: &[u32]| {
            cu.iter()
                .map(|&x| i32::try_from(x))
                .collect::<Result<Vec<i32>, _>>()
                .map_err(|_| candle_core::Error::Msg("attn_candle: an offset of cu_seqlens exceeds i32::MAX".into()))
        };
        let table = match &self.cu_seqlens_k {
            None => ctx.document_mask_from_cu_seqlens(&signed(cu_seqlens)?),
            Some(cu_k) => ctx.varlen_mask(&signed(cu_seqlens)?, &signed(cu_k)?, self.causal, self.window),
        };
        table.map(Some).map_err(wrap)
    }

    /// The kernels' options; with [`FlashAttention::varlen_qk`] the causal mask and window are
    /// the table's (per sequence), not the call's.
    fn options(&self) -> AttentionOptions<'static> {
        let per_sequence = self.cu_seqlens_k.is_some();
        let causal = if per_sequence { Causal::None } else { self.causal };
        let mut options = AttentionOptions { scale: self.scale, causal, ..Default::default() };
        if let Some(window) = self.window.filter(|_| !per_sequence) {
            options = options.with_window(window);
        }
        if let Some(cap) = self.softcap {
            options = options.with_softcap(cap);
        }
        if let Some(max_bias) = self.alibi_max_bias {
            options = options.with_alibi(attn_host::Alibi { max_bias });
        }
        options.deterministic = self.deterministic;
        options
    }

    /// Runs attention on Q, K, V in this layout (see [`flash_attn`] for the shapes); returns O in
    /// Q's shape, layout and dtype. On CUDA tensors the work is queued on the device's stream.
    ///
    /// # Errors
    /// `candle_core::Error::Msg` for a tensor that is not 4-dimensional, dtypes other than one of
    /// `f32`, `f16`, `bf16` for all three, tensors on different devices, and shapes that do not
    /// fit together (K and V differ, batch or head_dim differ from Q's, the K/V heads do not
    /// divide Q's); the same for sinks or a bias that are not `f32`, are on another device or
    /// track a gradient ([`FlashAttention::sinks`]); [`attn_host::Error`], wrapped, for head_dim
    /// above 256, a non-finite scale, bad softcap/ALiBi values, and sinks or a bias of the wrong
    /// shape or with softcapping; candle's own errors for a Metal device or a CUDA failure.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 4 {
                candle_core::bail!(
                    "attn_candle: {name} has shape {:?}; attention takes 4-dimensional tensors",
                    t.dims()
                );
            }
        }
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            candle_core::bail!(
                "attn_candle: q, k, v are {:?}, {:?}, {:?}; they must have one dtype",
                q.dtype(),
                k.dtype(),
                v.dtype()
            );
        }
        kernel_dtype(q.dtype())?;
        if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
            candle_core::bail!("attn_candle: q, k and v must be on one device");
        }
        let to_bhsd = |t: &Tensor| match self.layout {
            TensorLayout::Bshd => t.transpose(1, 2),
            TensorLayout::Bhsd => Ok(t.clone()),
        };
        let (q, k, v) = (kernel_ready(&to_bhsd(q)?)?, kernel_ready(&to_bhsd(k)?)?, kernel_ready(&to_bhsd(v)?)?);
        // The shapes are checked here, before candle allocates anything, and named in the
        // caller's layout.
        if let Err(e) = AttentionShape::from_qkv_allowing_empty(q.dims(), k.dims(), v.dims()) {
            let order = match self.layout {
                TensorLayout::Bshd => "[batch, heads, seqlen, head_dim] order, after transposing the BSHD inputs",
                TensorLayout::Bhsd => "[batch, heads, seqlen, head_dim] order",
            };
            candle_core::bail!("attn_candle: {e} (shapes in {order})");
        }
        let mut options = self.clone();
        options.sinks = self.sinks.as_ref().map(|t| constant_f32("sinks", t, &q)).transpose()?;
        options.bias = self.bias.as_ref().map(|t| constant_f32("bias", t, &q)).transpose()?;
        let o = q.apply_op3(&k, &v, AttentionOp { options, lse: Mutex::new(None) })?;
        match self.layout {
            TensorLayout::Bshd => o.transpose(1, 2),
            TensorLayout::Bhsd => Ok(o),
        }
    }
}

/// `t` itself if the kernels can read it in place (contiguous, starting 16 bytes aligned: they
/// copy rows 16 bytes at a time), otherwise a contiguous copy (which candle differentiates).
fn kernel_ready(t: &Tensor) -> candle_core::Result<Tensor> {
    let aligned = (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    if t.is_contiguous() && aligned { Ok(t.clone()) } else { t.force_contiguous() }
}

/// Sinks or a bias (`what`) as the kernels read them: an `f32` tensor on Q's device that
/// tracks no gradient (the backward does not return theirs: [`FlashAttention::sinks`]), made
/// contiguous. Their shapes are checked by `attn_host`, with the problem's.
fn constant_f32(what: &str, t: &Tensor, q: &Tensor) -> candle_core::Result<Tensor> {
    if t.dtype() != DType::F32 {
        candle_core::bail!("attn_candle: the {what} must be f32, not {:?}", t.dtype());
    }
    if !t.device().same_device(q.device()) {
        candle_core::bail!("attn_candle: the {what} must be on q's device");
    }
    if t.track_op() {
        candle_core::bail!(
            "attn_candle: the {what} track a gradient, which this op does not return (dQ, dK, dV only); \
             pass `{what}.detach()` to use them as a constant, or the PyTorch bridge to learn them"
        );
    }
    kernel_ready(t)
}

fn kernel_dtype(dtype: DType) -> candle_core::Result<attn_host::DType> {
    match dtype {
        DType::F32 => Ok(attn_host::DType::F32),
        DType::F16 => Ok(attn_host::DType::F16),
        DType::BF16 => Ok(attn_host::DType::Bf16),
        other => candle_core::bail!("attn_candle: the kernels take f32, f16 and bf16 tensors, not {other:?}"),
    }
}

/// Evaluates `$body` with the type alias `$t` naming the Rust type of the candle dtype `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match kernel_dtype($dtype)? {
            attn_host::DType::F32 => {
                type $t = f32;
                $body
            }
            attn_host::DType::F16 => {
                type $t = f16;
                $body
            }
            attn_host::DType::Bf16 => {
                type $t = bf16;
                $body
            }
        }
    };
}

/// An element type both sides know: `f32`, `f16`, `bf16`.
#[cfg(not(feature = "cuda"))]
trait KernelType: Element + WithDType {}
#[cfg(not(feature = "cuda"))]
impl<T: Element + WithDType> KernelType for T {}
#[cfg(feature = "cuda")]
trait KernelType: Element + WithDType + candle_core::cuda::CudaDType {}
#[cfg(feature = "cuda")]
impl<T: Element + WithDType + candle_core::cuda::CudaDType> KernelType for T {}

/// The logsumexp the forward wrote, `[B, Hq, Sq]` `f32`, kept for the backward.
enum SavedLse {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<f32>),
}

/// The candle op: O of BHSD Q, K, V (contiguous, aligned: [`kernel_ready`]). One instance per
/// call, so that it can keep that call's LSE for its backward.
struct AttentionOp {
    options: FlashAttention,
    lse: Mutex<Option<SavedLse>>,
}

/// What the kernels read besides Q, K, V (and O, dO, LSE), made on the call's context: the
/// varlen mask table ([`FlashAttention::mask_table`]) and the op's sinks and bias (uploaded to
/// the emulator, borrowed on CUDA). They live to the end of the op's call; device memory the op
/// allocated is freed in stream order, after the kernels that read it.
struct Extras {
    table: Option<MaskTable>,
    sinks: Option<DeviceTensor<f32>>,
    bias: Option<DeviceTensor<f32>>,
}

impl Extras {
    /// The table of `op`'s offsets on `ctx`, and `op`'s sinks and bias as `make` gives them there.
    fn of(
        op: &FlashAttention,
        ctx: &Context,
        make: impl Fn(&Tensor) -> candle_core::Result<DeviceTensor<f32>>,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            table: op.mask_table(ctx)?,
            sinks: op.sinks.as_ref().map(&make).transpose()?,
            bias: op.bias.as_ref().map(&make).transpose()?,
        })
    }

    /// `op`'s kernel options with these extras attached.
    fn options<'a>(&'a self, op: &FlashAttention) -> AttentionOptions<'a> {
        let mut options: AttentionOptions<'a> = op.options();
        if let Some(table) = &self.table {
            options = options.with_mask_table(table);
        }
        if let Some(sinks) = &self.sinks {
            options = options.with_sinks(sinks);
        }
        if let Some(bias) = &self.bias {
            options = options.with_bias(bias);
        }
        options
    }
}

fn wrap(error: attn_host::Error) -> candle_core::Error {
    candle_core::Error::wrap(error)
}

/// The problem of BHSD Q, K, V with these layouts.
fn problem(q: &Layout, k: &Layout, v: &Layout) -> candle_core::Result<AttentionShape> {
    for layout in [q, k, v] {
        if !layout.is_contiguous() {
            candle_core::bail!("attn_candle: the attention op takes contiguous tensors");
        }
    }
    AttentionShape::from_qkv_allowing_empty(q.dims(), k.dims(), v.dims()).map_err(|e| wrap(e.into()))
}

/// A contiguous CPU tensor's elements copied to the emulator's context `ctx`.
fn upload_tensor<T: KernelType>(ctx: &Context, t: &Tensor) -> candle_core::Result<DeviceTensor<T>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(storage) = &*storage else {
        candle_core::bail!("attn_candle: a CPU op's tensor is not on the CPU")
    };
    ctx.upload(host_slice::<T>(storage, layout)?, layout.dims()).map_err(wrap)
}

/// The elements of a contiguous CPU tensor.
fn host_slice<'a, T: KernelType>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [T]> {
    let start = layout.start_offset();
    Ok(&storage.as_slice::<T>()?[start..start + layout.shape().elem_count()])
}

impl AttentionOp {
    fn save(&self, lse: SavedLse) {
        *self.lse.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(lse);
    }

    /// The forward on the CPU emulator.
    fn cpu_forward<T: KernelType>(
        &self,
        (q, k, v): (&CpuStorage, &CpuStorage, &CpuStorage),
        (lq, lk, lv): (&Layout, &Layout, &Layout),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = problem(lq, lk, lv)?;
        let ctx = Context::cpu_emulated();
        let upload = |s, l: &Layout| ctx.upload(host_slice::<T>(s, l)?, l.dims()).map_err(wrap);
        let (q, k, v) = (upload(q, lq)?, upload(k, lk)?, upload(v, lv)?);
        let extras = Extras::of(&self.options, &ctx, |t| upload_tensor(&ctx, t))?;
        let options = extras.options(&self.options);
        let out = ctx
            .flash_attention_forward(&q, &k, &v, &options, ctx.default_tile(<T as Element>::DTYPE, shape.head_dim))
            .map_err(wrap)?;
        self.save(SavedLse::Host(out.lse.to_host().map_err(wrap)?));
        Ok((T::to_cpu_storage_owned(out.o.to_host().map_err(wrap)?), Shape::from_dims(&shape.q_shape())))
    }

    /// The backward on the CPU emulator: dQ, dK, dV as CPU tensors.
    fn cpu_backward<T: KernelType>(&self, tensors: [&Tensor; 5]) -> candle_core::Result<[Tensor; 3]> {
        let ctx = Context::cpu_emulated();
        let upload = |t: &Tensor| upload_tensor::<T>(&ctx, t);
        let [q, k, v, o, d_o] =
            [upload(tensors[0])?, upload(tensors[1])?, upload(tensors[2])?, upload(tensors[3])?, upload(tensors[4])?];
        let lse = match &*self.lse.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) {
            Some(SavedLse::Host(lse)) => ctx.upload(lse, &q.shape()[..3]).map_err(wrap)?,
            _ => candle_core::bail!("attn_candle: the backward ran before its forward"),
        };
        let extras = Extras::of(&self.options, &ctx, |t| upload_tensor(&ctx, t))?;
        let options = extras.options(&self.options);
        let (tile, dq_mode) = ctx.default_backward_plan(<T as Element>::DTYPE, q.shape()[3], options.deterministic);
        // (The gradients of the sinks and bias, if any, are dropped: they are constants to
        // autograd, `FlashAttention::sinks`.)
        let grads = ctx.flash_attention_backward(&q, &k, &v, &o, &lse, &d_o, &options, tile, dq_mode).map_err(wrap)?;
        let host = |t: DeviceTensor<T>| Tensor::from_vec(t.to_host().map_err(wrap)?, t.shape(), &Device::Cpu);
        Ok([host(grads.dq)?, host(grads.dk)?, host(grads.dv)?])
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA half: candle's buffers as borrowed tensors on a context on candle's stream.
    use super::*;
    use candle_core::cuda::{CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use cudarc::driver::{CudaSlice, DevicePtr};
    use std::collections::HashMap;
    use std::sync::{Arc, OnceLock};

    /// The kernels' context on `device`'s stream: made on first use and kept (with the stream, so
    /// its handle is never reused). The contexts of one CUDA context share its kernel modules
    /// ([`Context::with_stream`]), each loaded the first time a kernel of it runs.
    pub(super) fn context(device: &CudaDevice) -> candle_core::Result<Arc<Context>> {
        static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<Context>>>> = OnceLock::new();
        let stream = device.cuda_stream();
        let mut all = CONTEXTS.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(ctx) = all.get(&(stream.cu_stream() as usize)) {
            return Ok(ctx.clone());
        }
        let cu_ctx = stream.context().cu_ctx();
        let sibling = all.values().find(|ctx| ctx.cuda_stream().is_some_and(|s| s.context().cu_ctx() == cu_ctx));
        let ctx = Arc::new(
            match sibling {
                Some(base) => base.with_stream(stream.clone()),
                None => Context::on_stream(stream.clone()),
            }
            .map_err(wrap)?,
        );
        all.insert(stream.cu_stream() as usize, ctx.clone());
        Ok(ctx)
    }

    /// A borrowed tensor over the elements a contiguous candle CUDA tensor views.
    pub(super) fn borrow<T: KernelType>(
        ctx: &Context,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<DeviceTensor<T>> {
        let slice = storage.as_cuda_slice::<T>()?;
        let stream = storage.device.cuda_stream();
        let (base, _record) = slice.device_ptr(&stream);
        let address = base + (layout.start_offset() * size_of::<T>()) as u64;
        // SAFETY: `address` holds the tensor's elements (a contiguous layout inside `slice`),
        // which candle keeps alive for the op's duration; the kernels use it on the device's own
        // stream, in order with candle's work.
        unsafe { ctx.tensor_from_raw_parts::<T>(address, layout.dims()) }.map_err(wrap)
    }

    /// [`borrow`] of a contiguous candle CUDA tensor.
    pub(super) fn borrow_tensor<T: KernelType>(ctx: &Context, t: &Tensor) -> candle_core::Result<DeviceTensor<T>> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            candle_core::bail!("attn_candle: a CUDA op's tensor is not on CUDA")
        };
        borrow::<T>(ctx, storage, layout)
    }

    /// A tensor's device buffer for candle (an empty one for a tensor of no elements, which holds
    /// no memory).
    pub(super) fn give<T: KernelType>(device: &CudaDevice, t: DeviceTensor<T>) -> candle_core::Result<CudaSlice<T>> {
        match t.into_cuda_slice() {
            Some(slice) => Ok(slice),
            None => device.alloc_zeros::<T>(0),
        }
    }

    impl AttentionOp {
        pub(super) fn cuda_forward<T: KernelType>(
            &self,
            (q, k, v): (&CudaStorage, &CudaStorage, &CudaStorage),
            (lq, lk, lv): (&Layout, &Layout, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let shape = problem(lq, lk, lv)?;
            let ctx = context(&q.device)?;
            let (q_t, k_t, v_t) = (borrow::<T>(&ctx, q, lq)?, borrow::<T>(&ctx, k, lk)?, borrow::<T>(&ctx, v, lv)?);
            let extras = Extras::of(&self.options, &ctx, |t| borrow_tensor(&ctx, t))?;
            let options = extras.options(&self.options);
            let tile = ctx.default_tile(<T as Element>::DTYPE, shape.head_dim);
            let out = ctx.flash_attention_forward(&q_t, &k_t, &v_t, &options, tile).map_err(wrap)?;
            self.save(SavedLse::Cuda(give(&q.device, out.lse)?));
            Ok((
                CudaStorage::wrap_cuda_slice(give(&q.device, out.o)?, q.device.clone()),
                Shape::from_dims(&shape.q_shape()),
            ))
        }

        pub(super) fn cuda_backward<T: KernelType>(
            &self,
            device: &CudaDevice,
            tensors: [&Tensor; 5],
        ) -> candle_core::Result<[Tensor; 3]> {
            let ctx = context(device)?;
            let borrowed = |t: &Tensor| borrow_tensor::<T>(&ctx, t);
            let [q, k, v, o, d_o] = [
                borrowed(tensors[0])?,
                borrowed(tensors[1])?,
                borrowed(tensors[2])?,
                borrowed(tensors[3])?,
                borrowed(tensors[4])?,
            ];
            let saved = self.lse.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let lse = match &*saved {
                Some(SavedLse::Cuda(lse)) => {
                    let stream = device.cuda_stream();
                    let (address, _record) = lse.device_ptr(&stream);
                    // SAFETY: the saved LSE, `[B, Hq, Sq]` f32, lives in `saved` past the launch
                    // (its later free is stream-ordered after it).
                    unsafe { ctx.tensor_from_raw_parts::<f32>(address, &q.shape()[..3]) }.map_err(wrap)?
                }
                _ => candle_core::bail!("attn_candle: the backward ran before its forward"),
            };
            let extras = Extras::of(&self.options, &ctx, |t| borrow_tensor(&ctx, t))?;
            let options = extras.options(&self.options);
            let (tile, dq_mode) = ctx.default_backward_plan(<T as Element>::DTYPE, q.shape()[3], options.deterministic);
            // (The sinks' and bias's gradients are dropped: constants, `FlashAttention::sinks`.)
            let grads =
                ctx.flash_attention_backward(&q, &k, &v, &o, &lse, &d_o, &options, tile, dq_mode).map_err(wrap)?;
            let tensor = |t: DeviceTensor<T>| -> candle_core::Result<Tensor> {
                let shape = t.shape().to_vec();
                let storage = CudaStorage::wrap_cuda_slice(give(device, t)?, device.clone());
                Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
            };
            Ok([tensor(grads.dq)?, tensor(grads.dk)?, tensor(grads.dv)?])
        }
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "rust-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (storages, layouts) = ((q, k, v), (lq, lk, lv));
        by_dtype!(q.dtype(), T => self.cpu_forward::<T>(storages, layouts))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (storages, layouts) = ((q, k, v), (lq, lk, lv));
        by_dtype!(q.dtype(), T => self.cuda_forward::<T>(storages, layouts))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d_o = kernel_ready(d_o)?;
        let tensors = [q, k, v, o, &d_o];
        let [dq, dk, dv] = match q.device() {
            Device::Cpu => by_dtype!(q.dtype(), T => self.cpu_backward::<T>(tensors)),
            #[cfg(feature = "cuda")]
            Device::Cuda(device) => by_dtype!(q.dtype(), T => self.cuda_backward::<T>(device, tensors)),
            other => candle_core::bail!("attn_candle: no kernels for {:?}", other.location()),
        }?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

//! **Base layer.** The problem (shapes, scale, mask, dQ mode) and tile (block sizes)
//! descriptions, validated on the host. Which tiles are compiled and fit a device is the
//! registry's ([`crate::kernels`]), which tile and kernel a problem gets the selection policy's
//! ([`crate::select`]); both add their methods to [`TileConfig`] there.

use crate::error::{Error, Result};
pub use crate::layout::AttentionShape;

/// CUDA's limit on the y and z dimensions of a grid; the flash kernel puts heads on y and the
/// batch on z.
pub(crate) const MAX_GRID_YZ: usize = 65_535;

/// Causal masking: which keys a query may attend to.
///
/// With `seqlen_q == seqlen_k` both causal variants are the usual "query i sees keys 0..=i".
/// They differ when the lengths differ:
///
/// * [`Causal::TopLeft`]: query i sees keys `j ≤ i`, the mask's diagonal starting at the top-left
///   corner of the `seqlen_q × seqlen_k` score matrix (PyTorch's `is_causal=True`). With
///   `seqlen_q > seqlen_k` the last queries see every key; with `seqlen_q < seqlen_k` the last keys
///   are seen by nobody.
/// * [`Causal::BottomRight`]: query i sees keys `j ≤ i + seqlen_k − seqlen_q`, the diagonal ending
///   at the bottom-right corner (FlashAttention ≥ 2.1; decoding with a KV cache: the last query
///   sees every key). With `seqlen_q > seqlen_k` the first `seqlen_q − seqlen_k` queries see no key.
///
/// A query that sees no key gets O = 0 and LSE = −∞, and contributes nothing to the gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Causal {
    /// Every query sees every key.
    #[default]
    None,
    /// Query i sees keys j ≤ i.
    TopLeft,
    /// Query i sees keys j ≤ i + seqlen_k − seqlen_q.
    BottomRight,
}

impl Causal {
    /// The kernels' two mask arguments: whether to mask (0 or 1) and the diagonal's offset, so
    /// that key j is visible to query i iff `j ≤ i + offset`.
    pub(crate) fn kernel_args(self, shape: &AttentionShape) -> (usize, isize) {
        match self {
            Self::None => (0, 0),
            Self::TopLeft => (1, 0),
            Self::BottomRight => (1, shape.seqlen_k as isize - shape.seqlen_q as isize),
        }
    }

    /// Whether key `key` is visible to query `query` (the definition above).
    pub fn visible(self, query: usize, key: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        match self {
            Self::None => true,
            Self::TopLeft => key <= query,
            Self::BottomRight => key as isize <= query as isize + seqlen_k as isize - seqlen_q as isize,
        }
    }
}

/// A sliding window (local attention; Longformer, Beltagy et al. 2020; Mistral's and Gemma's
/// local layers): query `i` sees only the keys `j` with `i + d − left ≤ j ≤ i + d + right`,
/// where the diagonal `d` is `seqlen_k − seqlen_q` (`bottom_right`, FlashAttention's alignment
/// of windows, and decoding's) or 0 (top-left). `None` on a side leaves that side open
/// (FlashAttention's `window_size` of −1).
///
/// It combines with [`Causal`] by intersection: a query sees a key only if both allow it. A
/// causal sliding window of `w` keys (Mistral's `sliding_window = 4096`: the query and the
/// 4095 before it) is [`SlidingWindow::left`]`(w − 1)`, with or without `Causal::BottomRight`.
///
/// The kernels visit only the key tiles inside some row's window, so a window of `w` keys costs
/// time proportional to `w`, not to `seqlen_k`. A query whose window holds no key follows
/// [`Causal`]'s empty-row convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// Keys before the diagonal that a query sees; `None`: all of them.
    pub left: Option<usize>,
    /// Keys after the diagonal that a query sees; `None`: all of them, `Some(0)`: none (causal).
    pub right: Option<usize>,
    /// The diagonal of query `i` is key `i + seqlen_k − seqlen_q` (`true`) or key `i` (`false`).
    pub bottom_right: bool,
}

impl SlidingWindow {
    /// FlashAttention's `window_size = (left, right)`, aligned bottom-right as there.
    pub fn new(left: Option<usize>, right: Option<usize>) -> Self {
        Self { left, right, bottom_right: true }
    }

    /// A causal window: the diagonal key and the `left` keys before it, none after.
    pub fn left(left: usize) -> Self {
        Self::new(Some(left), Some(0))
    }

    /// The same window with its diagonal at the top-left corner (key `i` for query `i`).
    pub fn top_left(self) -> Self {
        Self { bottom_right: false, ..self }
    }

    /// The diagonal's offset `d` for `shape`'s lengths.
    fn diagonal(&self, seqlen_q: usize, seqlen_k: usize) -> i128 {
        if self.bottom_right { seqlen_k as i128 - seqlen_q as i128 } else { 0 }
    }

    /// Whether key `key` is in query `query`'s window (the definition above).
    pub fn contains(&self, query: usize, key: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        let (diagonal, key) = (query as i128 + self.diagonal(seqlen_q, seqlen_k), key as i128);
        self.left.is_none_or(|l| key >= diagonal - l as i128) && self.right.is_none_or(|r| key <= diagonal + r as i128)
    }
}

/// ALiBi, attention with linear biases (Press et al. 2022): query `i` of head `h` adds
/// `−slope_h · |i + seqlen_k − seqlen_q − j|` to its logit of key `j` (the distance from the
/// bottom-right diagonal, FlashAttention-2's convention, so that under a causal mask a row's
/// latest key has bias 0 whatever the lengths). The slopes are the paper's (section 3): for `n`
/// heads, a power of two, head `h` gets `2^(−max_bias · (h + 1) / n)`; for other head counts
/// the first `n′` heads (`n′` the largest power of two below) get the sequence for `n′` and the
/// rest its odd terms for `2n′` (BLOOM's completion). `max_bias` is 8 in the paper, BLOOM and MPT
/// (`alibi_bias_max`). The slopes follow from the query head, so GQA groups get the query
/// heads' own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Alibi {
    /// The exponent scale of the slopes (8 for the paper's).
    pub max_bias: f32,
}

impl Alibi {
    /// The paper's slopes: `max_bias = 8`.
    pub const fn standard() -> Self {
        Self { max_bias: 8.0 }
    }

    /// The slope of query head `head` of `num_heads` (the definition above).
    pub fn slope(&self, head: usize, num_heads: usize) -> f64 {
        let n = 1usize << num_heads.max(1).ilog2();
        let exponent =
            if head < n { (head + 1) as f64 / n as f64 } else { (2 * (head - n) + 1) as f64 / (2 * n) as f64 };
        (-(self.max_bias as f64) * exponent).exp2()
    }
}

/// A modification of the scores between Q Kᵀ and the softmax (FlexAttention's `score_mod`): what
/// a logit is, where the mask ([`Causal`], [`SlidingWindow`]) says which logits count. With `x
/// = scale · q·k`:
///
/// * none (the default): `ℓ = x`;
/// * [`ScoreMod::softcap`] (Gemma 2's attention logit softcapping, cap 50; Grok's, 30):
///   `ℓ = cap · tanh(x / cap)`, which bounds every logit to `(−cap, cap)`; its gradient carries
///   the factor `1 − tanh²(x / cap)`;
/// * [`ScoreMod::alibi`]: `ℓ = x − slope_h · |i + seqlen_k − seqlen_q − j|` ([`Alibi`]).
///
/// The LSE the forward pass returns is that of the modified logits. Every flash kernel (both
/// paths, forward and backward, every dtype) and the naive forward take them; the naive
/// backward takes ALiBi but not softcapping. Softcapping and ALiBi together are refused (no
/// model combines them; see `attention::score` in the device crate for why it would cost).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoreMod {
    /// The softcap's `cap` (> 0, finite); `None`: no softcapping.
    pub softcap: Option<f32>,
    /// ALiBi's slopes; `None`: no ALiBi.
    pub alibi: Option<Alibi>,
}

impl ScoreMod {
    /// Logit softcapping with `cap`.
    pub fn softcap(cap: f32) -> Self {
        Self { softcap: Some(cap), alibi: None }
    }

    /// ALiBi with `alibi`'s slopes.
    pub fn alibi(alibi: Alibi) -> Self {
        Self { softcap: None, alibi: Some(alibi) }
    }

    /// Whether the scores are left as they are.
    pub fn is_none(&self) -> bool {
        self.softcap.is_none() && self.alibi.is_none()
    }

    /// The logit of query `query`, key `key` of query head `head` from `x = scale · q·k` (the
    /// definitions above; `shape` gives the head count and the lengths), as the CPU references
    /// compute it.
    pub fn logit(&self, x: f64, head: usize, query: usize, key: usize, shape: &AttentionShape) -> f64 {
        let mut logit = x;
        if let Some(cap) = self.softcap {
            logit = cap as f64 * (x / cap as f64).tanh();
        }
        if let Some(alibi) = self.alibi {
            let distance = (query as f64 + shape.seqlen_k as f64 - shape.seqlen_q as f64 - key as f64).abs();
            logit -= alibi.slope(head, shape.num_heads_q) * distance;
        }
        logit
    }

    /// `∂ℓ/∂x` at `x` (see [`ScoreMod::logit`]): `1 − tanh²(x / cap)` with softcapping, else 1.
    pub fn derivative(&self, x: f64) -> f64 {
        self.softcap.map_or(1.0, |cap| 1.0 - (x / cap as f64).tanh().powi(2))
    }

    /// The kernels' two arguments (`attention_kernel!`, `attention::score::ScoreArgs`): the cap
    /// and ALiBi's `max_bias`, 0 for none.
    pub(crate) fn kernel_args(&self) -> (f32, f32) {
        (self.softcap.unwrap_or(0.0), self.alibi.map_or(0.0, |a| a.max_bias))
    }

    /// # Errors
    /// [`Error::ScoreMod`] for a cap or `max_bias` that is not positive and finite, or for both
    /// modifications at once.
    pub fn check(&self) -> Result<()> {
        if let Some(cap) = self.softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(Error::ScoreMod(format!("the softcap must be positive and finite; got {cap}")));
        }
        if let Some(alibi) = self.alibi
            && !(alibi.max_bias.is_finite() && alibi.max_bias > 0.0)
        {
            return Err(Error::ScoreMod(format!(
                "ALiBi's max_bias must be positive and finite; got {}",
                alibi.max_bias
            )));
        }
        if self.softcap.is_some() && self.alibi.is_some() {
            return Err(Error::ScoreMod("softcapping and ALiBi together are not supported".into()));
        }
        Ok(())
    }
}

/// Attention sinks (Xiao et al. 2024, "Efficient Streaming Language Models with Attention
/// Sinks"; learned, one per head, in GPT-OSS): one logit per query head that joins every row's
/// softmax without a value vector, so that a row can put probability on "nothing". With
/// `s_h` the sink of head `h`,
///
/// LSE = ln(e^(s_h) + Σ_j e^(ℓ_j)),   O = Σ_j e^(ℓ_j − LSE) v_j,
///
/// and ∂loss/∂s_h = −Σ_{b, i} e^(s_h − LSE_{b,h,i}) · D_{b,h,i} with D = rowsum(dO ∘ O), which
/// the backward passes return as [`Gradients::d_sinks`](crate::Gradients::d_sinks). Sinks are in
/// the logits' natural-log units (those of `scale · q·k`); neither the scale, a softcap nor
/// ALiBi touches them. A row that sees no key gets O = 0 and LSE = s_h.
///
/// A borrowed `f32` device tensor of shape `[num_heads_q]` on the context that runs the
/// attention, given to [`AttentionOptions::with_sinks`] (`Sinks::from(&tensor)`). The flash
/// kernels of both paths take them; the naive ones, problems run in chunks and problems with
/// query rows but no keys refuse them ([`Error::Sinks`]). The KV-cache decoder takes them too
/// (`DecodeOptions::sinks`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sinks<'a> {
    /// The tensor's address: on a GPU its device pointer, on the emulator its host buffer's.
    pub(crate) address: u64,
    pub(crate) shape: &'a [usize],
    /// The [`Context`](crate::Context) that made the tensor (its id).
    pub(crate) owner: u64,
}

impl Sinks<'_> {
    /// Checks that the sinks fit `shape` on the context with id `context`.
    ///
    /// # Errors
    /// [`Error::Sinks`] naming what is wrong.
    pub(crate) fn check(&self, shape: &AttentionShape, context: u64) -> Result<()> {
        if self.owner != context {
            return Err(Error::Sinks("the sinks tensor belongs to another context".into()));
        }
        if self.shape != [shape.num_heads_q] {
            return Err(Error::Sinks(format!(
                "the sinks must have shape [num_heads_q] = [{}]; got {:?}",
                shape.num_heads_q, self.shape
            )));
        }
        Ok(())
    }
}

/// An additive bias on the logits (FlexAttention's `score_mod` of a bias tensor; Swin's relative
/// position bias, T5's bucketed position bias, PyTorch's float `attn_mask`): with `x = scale ·
/// q·k`, the logit of query `i`, key `j` of batch entry `b` and query head `h` is
///
/// ℓ = x + bias[b][h][i][j]   (plus ALiBi's term, if any),
///
/// and since the bias enters with factor 1, ∂loss/∂bias = dS = P ∘ (dP − D), summed over the
/// batch entries or heads the bias is shared by; the backward passes return it as
/// [`Gradients::d_bias`](crate::Gradients::d_bias). A −∞ entry hides the key from that query
/// (a row whose every logit is −∞ gets O = 0 and LSE = −∞, as a row that sees no key).
///
/// A borrowed `f32` device tensor of shape `[batch or 1, num_heads_q or 1, seqlen_q,
/// seqlen_k]` (row-major, a dimension of 1 broadcast) on the context that runs the attention,
/// given to [`AttentionOptions::with_bias`] (`Bias::from(&tensor)`). The flash kernels of the
/// sm_80 modules take it (levels 3–6, every dtype, every mask, GQA, sinks, ALiBi); a problem
/// with a bias runs there on the sm_90a path too, and the explicit Hopper calls, the naive
/// kernels, the KV-cache decoder, problems run in chunks and softcapping refuse it
/// ([`Error::Bias`]). dBias of a bias shared by batch entries or heads is summed by atomic
/// adds, in an order that can change from run to run, even with a deterministic dQ.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bias<'a> {
    /// The tensor's address: on a GPU its device pointer, on the emulator its host buffer's.
    pub(crate) address: u64,
    pub(crate) shape: &'a [usize],
    /// The [`Context`](crate::Context) that made the tensor (its id).
    pub(crate) owner: u64,
}

impl Bias<'_> {
    /// The bias's shape, `[batch or 1, num_heads_q or 1, seqlen_q, seqlen_k]`.
    pub fn shape(&self) -> &[usize] {
        self.shape
    }

    /// Checks that the bias fits `shape` on the context with id `context`.
    ///
    /// # Errors
    /// [`Error::Bias`] naming what is wrong.
    pub(crate) fn check(&self, shape: &AttentionShape, context: u64) -> Result<()> {
        if self.owner != context {
            return Err(Error::Bias("the bias tensor belongs to another context".into()));
        }
        let fits = matches!(self.shape, &[b, h, sq, sk]
            if (b == 1 || b == shape.batch) && (h == 1 || h == shape.num_heads_q)
                && sq == shape.seqlen_q && sk == shape.seqlen_k);
        if !fits {
            return Err(Error::Bias(format!(
                "the bias must have shape [batch or 1, num_heads_q or 1, seqlen_q, seqlen_k] = [{} or 1, {} or 1, {}, {}]; \
                 got {:?}",
                shape.batch, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k, self.shape
            )));
        }
        Ok(())
    }

    /// The kernels' two strides (`attention::score::ScoreArgs`), in elements: from one batch
    /// entry's `seqlen_q × seqlen_k` plane to the next, and from one head's to the next; 0 along
    /// a broadcast dimension. Only for a bias [`Bias::check`] accepted.
    pub(crate) fn strides(&self) -> (usize, usize) {
        bias_strides(self.shape)
    }
}

/// A bias tensor's batch and head strides in elements for its shape `[batch or 1, num_heads_q or
/// 1, seqlen_q, seqlen_k]`: a plane of `seqlen_q × seqlen_k` per entry, 0 along a broadcast
/// dimension (of size 1). What the kernels ([`Bias::strides`]) and the CPU references
/// (`cpu::BiasValues`) index by.
pub(crate) fn bias_strides(shape: &[usize]) -> (usize, usize) {
    let [b, h, sq, sk] = [0, 1, 2, 3].map(|i| shape.get(i).copied().unwrap_or(1));
    let head = if h == 1 { 0 } else { sq * sk };
    let batch = if b == 1 { 0 } else { h * sq * sk };
    (batch, head)
}

/// What a mask table masks, by the call that made it; some options cannot join some kinds
/// (`Context::check_mask_table`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskTableKind {
    /// Tokens see only their own document ([`Context::document_mask`],
    /// [`Context::document_mask_from_cu_seqlens`]).
    ///
    /// [`Context::document_mask`]: crate::Context::document_mask
    /// [`Context::document_mask_from_cu_seqlens`]: crate::Context::document_mask_from_cu_seqlens
    Documents,
    /// A bidirectional prefix, causal after it ([`Context::prefix_lm_mask`]): a causal mask of
    /// its own.
    ///
    /// [`Context::prefix_lm_mask`]: crate::Context::prefix_lm_mask
    PrefixLm,
    /// Packed sequences with queries and keys of their own lengths, their causal mask and window
    /// applied per sequence ([`Context::varlen_mask`]).
    ///
    /// [`Context::varlen_mask`]: crate::Context::varlen_mask
    Varlen,
}

impl std::fmt::Display for MaskTableKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Documents => "documents",
            Self::PrefixLm => "prefix-LM",
            Self::Varlen => "varlen",
        })
    }
}

/// A mask given per token — a document mask, prefix-LM — as the kernels read it: a borrowed
/// view of a [`MaskTable`](crate::MaskTable) (made by [`Context::document_mask`],
/// [`Context::document_mask_from_cu_seqlens`] or [`Context::prefix_lm_mask`]), given to
/// [`AttentionOptions::with_mask_table`].
///
/// Query `i` of batch entry `b` may see the keys `start ≤ j < limit` of its band in the table;
/// the kernels intersect that band with the causal mask and the sliding window (a key is
/// visible if every part allows it), skip the key tiles no query of a block may see, and mask
/// element by element only the tiles that straddle a band's edge (`attention::mask` in the
/// device crate). The flash kernels of both paths and the naive ones take it; a problem run in
/// chunks (more than 65,535 heads or batch entries) refuses it ([`Error::MaskTable`]).
///
/// [`Context::document_mask`]: crate::Context::document_mask
/// [`Context::document_mask_from_cu_seqlens`]: crate::Context::document_mask_from_cu_seqlens
/// [`Context::prefix_lm_mask`]: crate::Context::prefix_lm_mask
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskTableRef<'a> {
    /// The device table's address: on a GPU its device pointer, on the emulator its host
    /// buffer's.
    pub(crate) address: u64,
    /// The [`Context`](crate::Context) that made it (its id).
    pub(crate) owner: u64,
    /// `[batch, seqlen_q, seqlen_k]` of the problems it masks.
    pub(crate) dims: [usize; 3],
    /// The table on the host (`Mask::table_words` per batch entry), for the CPU references.
    pub(crate) words: &'a [u32],
    /// What it masks.
    pub(crate) kind: MaskTableKind,
    /// Whether it leaves keys between two queries' bands, or queries between two keys', that
    /// nobody sees ([`table_gap`]): a varlen table can. Every kernel masks such tiles; only the
    /// Hopper backward's deterministic dQ turns need none.
    pub(crate) gapped: bool,
}

impl MaskTableRef<'_> {
    /// Whether query `query` of batch entry `batch` may see key `key` by the table alone (false
    /// outside the table's `[batch, seqlen_q, seqlen_k]`).
    pub fn visible(&self, batch: usize, query: usize, key: usize) -> bool {
        let [batches, seqlen_q, seqlen_k] = self.dims;
        if batch >= batches || query >= seqlen_q || key >= seqlen_k {
            return false;
        }
        let words = attn_kernels::attention::mask::Mask::table_words(seqlen_q, seqlen_k);
        let pair = &self.words[batch * words + 2 * query..][..2];
        pair[0] as usize <= key && key < pair[1] as usize
    }

    /// `[batch, seqlen_q, seqlen_k]` of the problems the table masks.
    pub fn dims(&self) -> [usize; 3] {
        self.dims
    }

    /// What the table masks.
    pub fn kind(&self) -> MaskTableKind {
        self.kind
    }

    /// Checks that the table fits `shape` on the context with id `context`.
    ///
    /// # Errors
    /// [`Error::MaskTable`] naming what is wrong.
    pub(crate) fn check(&self, shape: &AttentionShape, context: u64) -> Result<()> {
        if self.owner != context {
            return Err(Error::MaskTable(format!("the {} table belongs to another context", self.kind)));
        }
        let dims = [shape.batch, shape.seqlen_q, shape.seqlen_k];
        if self.dims != dims {
            return Err(Error::MaskTable(format!(
                "the {} table was made for [batch, seqlen_q, seqlen_k] = {:?}; the problem has {dims:?}",
                self.kind, self.dims
            )));
        }
        Ok(())
    }
}

/// The table's words (`Mask::table`'s layout) for per-query bands `bands` (`[batch, seqlen_q]`,
/// each `(start, limit)` with `start ≤ limit ≤ seqlen_k`): each row's query pairs, then its
/// `seqlen_k` key pairs, the queries that see key `k` being those whose band holds it — from the
/// first query whose limit is past `k` to the first whose start is past it (both ends
/// non-decreasing, like the bands').
pub(crate) fn table_words(bands: &[(usize, usize)], batch: usize, seqlen_q: usize, seqlen_k: usize) -> Vec<u32> {
    let mut words = Vec::with_capacity(batch * attn_kernels::attention::mask::Mask::table_words(seqlen_q, seqlen_k));
    for b in 0..batch {
        let row = &bands[b * seqlen_q..(b + 1) * seqlen_q];
        debug_assert!(row.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1), "bands must not decrease");
        debug_assert!(row.iter().all(|&(start, limit)| start <= limit && limit <= seqlen_k), "bands within the keys");
        words.extend(row.iter().flat_map(|&(start, limit)| [start as u32, limit as u32]));
        let (mut first, mut end) = (0, 0);
        for key in 0..seqlen_k {
            while first < seqlen_q && row[first].1 <= key {
                first += 1;
            }
            while end < seqlen_q && row[end].0 <= key {
                end += 1;
            }
            words.extend([first as u32, end as u32]);
        }
    }
    words
}

/// Per-query key bands (`(start, limit)` in packed-row coordinates, as [`table_words`] takes
/// them) of a packed row of variable-length sequences: sequence `s` holds queries `cu_q[s] ..
/// cu_q[s + 1]` and keys `cu_k[s] .. cu_k[s + 1]`, and `causal` and `window` apply to each on
/// its own lengths — the kernels' own mask (`Mask::banded`, through
/// [`AttentionOptions::mask_args`]) computes each sequence's bands, so they are the same
/// definition. A query that sees no key gets the empty band at its limit, which keeps both
/// ends non-decreasing. `cu_q` and `cu_k` have the same length, start at 0 and never decrease.
pub(crate) fn varlen_bands(
    cu_q: &[usize],
    cu_k: &[usize],
    causal: Causal,
    window: Option<SlidingWindow>,
) -> Vec<(usize, usize)> {
    use attn_kernels::attention::mask::Mask;
    let mut bands = Vec::with_capacity(cu_q.last().copied().unwrap_or(0));
    let options = AttentionOptions { causal, window, ..Default::default() };
    for (q, k) in cu_q.windows(2).zip(cu_k.windows(2)) {
        let (seqlen_q, seqlen_k) = (q[1] - q[0], k[1] - k[0]);
        let shape = AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 1 };
        let (causal, offset, start_offset) = options.mask_args(&shape);
        let mask = Mask::from_args(seqlen_q, seqlen_k, causal, offset, start_offset);
        bands.extend((0..seqlen_q).map(|i| {
            let (start, limit) = (mask.key_start(i), mask.key_limit(i));
            (k[0] + start.min(limit), k[0] + limit)
        }));
    }
    bands
}

/// Where a table (`words`, [`table_words`]'s layout, for `seqlen_q` queries and `seqlen_k`
/// keys per batch entry) leaves a gap between neighbours: `("query", i)` when query `i`'s band
/// starts past the limit of query `i − 1`'s (the keys between are seen by no query), `("key",
/// j)` when the first query of key `j` comes after the end of key `j − 1`'s queries. The kernels
/// need none: they take the keys of a block of queries as one range, from its first row's start
/// to its last row's limit (and the queries of a block of keys likewise), and the Hopper
/// backward's dQ turns (`sm90::backward::turn`) count on the key blocks that reach a query tile
/// being consecutive. Every mask of one sequence (causal, windows) and every document or
/// prefix-LM table has none; a packed row of sequences whose queries and keys differ in length
/// can.
pub(crate) fn table_gap(words: &[u32], seqlen_q: usize, seqlen_k: usize) -> Option<(&'static str, usize)> {
    let pair = |index: usize| (words[2 * index], words[2 * index + 1]);
    // The first `i` of `count` pairs from `from` whose start is past pair `i − 1`'s end.
    let first_gap = |from: usize, count: usize| (1..count).find(|&i| pair(from + i).0 > pair(from + i - 1).1);
    let batches = words.len() / (2 * (seqlen_q + seqlen_k)).max(1);
    (0..batches).find_map(|b| {
        let base = b * (seqlen_q + seqlen_k);
        first_gap(base, seqlen_q)
            .map(|i| ("query", i))
            .or_else(|| first_gap(base + seqlen_q, seqlen_k).map(|j| ("key", j)))
    })
}

/// Options shared by every attention entry point.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions<'a> {
    /// Multiplies Q Kᵀ before the softmax; `None` means 1/√head_dim.
    pub scale: Option<f32>,
    /// Causal mask; see [`Causal`].
    pub causal: Causal,
    /// Sliding window (local attention), intersected with the causal mask; see
    /// [`SlidingWindow`]. `None`: every key the causal mask leaves.
    pub window: Option<SlidingWindow>,
    /// Softcapping or ALiBi; see [`ScoreMod`]. The default leaves the scores as they are.
    pub score: ScoreMod,
    /// Attention sinks, one logit per query head ([`Sinks`]); `None`: a plain softmax.
    pub sinks: Option<Sinks<'a>>,
    /// An additive bias on the logits ([`Bias`]); `None`: none.
    pub bias: Option<Bias<'a>>,
    /// A mask given per token (documents, prefix-LM: [`MaskTableRef`]), intersected with the
    /// causal mask and the window; `None`: none.
    pub mask_table: Option<MaskTableRef<'a>>,
    /// Whether [`Context::attention_backward`](crate::Context::attention_backward) sums dQ in a
    /// fixed order ([`DqAccumulation::Deterministic`]: bit-identical on every run) rather than
    /// in the faster mode. The forward passes are deterministic either way; the calls with an
    /// explicit dQ mode ([`Context::flash_attention_backward`](crate::Context::flash_attention_backward))
    /// take theirs instead.
    pub deterministic: bool,
}

impl<'a> AttentionOptions<'a> {
    /// These options with a deterministic backward pass ([`AttentionOptions::deterministic`]).
    pub fn deterministic(self) -> Self {
        Self { deterministic: true, ..self }
    }

    /// Options with an explicit softmax scale.
    pub fn with_scale(scale: f32) -> Self {
        Self { scale: Some(scale), ..Self::default() }
    }

    /// Options with a causal mask.
    pub fn causal(causal: Causal) -> Self {
        Self { causal, ..Self::default() }
    }

    /// These options with a sliding window ([`AttentionOptions::window`]).
    pub fn with_window(self, window: SlidingWindow) -> Self {
        Self { window: Some(window), ..self }
    }

    /// These options with softcapping at `cap` ([`ScoreMod::softcap`]).
    pub fn with_softcap(self, cap: f32) -> Self {
        Self { score: ScoreMod { softcap: Some(cap), ..self.score }, ..self }
    }

    /// These options with ALiBi ([`ScoreMod::alibi`]).
    pub fn with_alibi(self, alibi: Alibi) -> Self {
        Self { score: ScoreMod { alibi: Some(alibi), ..self.score }, ..self }
    }

    /// These options with attention sinks ([`Sinks`]): `options.with_sinks(&tensor)` for an `f32`
    /// [`DeviceTensor`](crate::DeviceTensor) of shape `[num_heads_q]`, which the options borrow.
    pub fn with_sinks<'b>(self, sinks: impl Into<Sinks<'b>>) -> AttentionOptions<'b>
    where
        'a: 'b,
    {
        AttentionOptions { sinks: Some(sinks.into()), ..self }
    }

    /// These options with an additive bias ([`Bias`]): `options.with_bias(&tensor)` for an `f32`
    /// [`DeviceTensor`](crate::DeviceTensor) of shape `[batch or 1, num_heads_q or 1, seqlen_q,
    /// seqlen_k]`, which the options borrow.
    pub fn with_bias<'b>(self, bias: impl Into<Bias<'b>>) -> AttentionOptions<'b>
    where
        'a: 'b,
    {
        AttentionOptions { bias: Some(bias.into()), ..self }
    }

    /// These options with a mask given per token ([`MaskTableRef`]): `options.with_mask_table(&table)`
    /// for a [`MaskTable`](crate::MaskTable), which the options borrow.
    pub fn with_mask_table<'b>(self, table: impl Into<MaskTableRef<'b>>) -> AttentionOptions<'b>
    where
        'a: 'b,
    {
        AttentionOptions { mask_table: Some(table.into()), ..self }
    }

    /// Whether query `query` sees key `key`: the causal mask's and the window's definitions,
    /// as the CPU references apply them.
    pub fn visible(&self, batch: usize, query: usize, key: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        self.causal.visible(query, key, seqlen_q, seqlen_k)
            && self.window.is_none_or(|w| w.contains(query, key, seqlen_q, seqlen_k))
            && self.mask_table.is_none_or(|t| t.visible(batch, query, key))
    }

    /// Whether the mask table leaves keys or queries between neighbours that nobody sees
    /// ([`table_gap`]; a varlen table can).
    pub(crate) fn has_gapped_table(&self) -> bool {
        self.mask_table.is_some_and(|t| t.gapped)
    }

    /// Whether the Hopper backward can run these options in dQ mode `dq`: its deterministic dQ
    /// has each query tile's key blocks take turns, and a key block that reaches none of the
    /// tile's rows (a gap of a varlen table: [`AttentionOptions::has_gapped_table`]) would never
    /// take its turn, so that one case runs the sm_80 kernels. The one home of this rule: the
    /// selection policy (`Target::hopper_backward_for`, which also leaves varlen tables' turns
    /// out for speed) and the explicit Hopper call ask it.
    pub(crate) fn hopper_backward_allowed(&self, dq: DqAccumulation) -> bool {
        self.hopper_allowed() && (dq == DqAccumulation::Atomic || !self.has_gapped_table())
    }

    /// Whether the Hopper kernels (levels 8, 9) take these options at all: not with a bias
    /// ([`Bias`]), which only the sm_80 modules' kernels read. The selection policy sends such a
    /// problem there; the explicit Hopper calls refuse it.
    pub(crate) fn hopper_allowed(&self) -> bool {
        self.bias.is_none()
    }

    /// The kernels' three mask arguments (`attention_kernel!`, `attention::mask::Mask`): whether
    /// keys right of a diagonal are hidden (0 or 1), that diagonal's offset (key `j` visible to
    /// query `i` only if `j ≤ i + offset`) and the left edge's offset (only if `j ≥ i +
    /// start_offset`; `Mask::NO_LEFT_EDGE` without one). Offsets are clamped to
    /// `±(seqlen_q + seqlen_k)`, past which they change nothing, so that no window overflows;
    /// the left edge never lies right of the diagonal (the kernels rely on it).
    pub(crate) fn mask_args(&self, shape: &AttentionShape) -> (usize, isize, isize) {
        use attn_kernels::attention::mask::Mask;
        let (causal, offset) = self.causal.kernel_args(shape);
        let edge = |side: Option<usize>| side.unwrap_or(Mask::OPEN);
        let (window, diagonal) = match self.window {
            Some(w) => ((edge(w.left), edge(w.right)), w.diagonal(shape.seqlen_q, shape.seqlen_k)),
            None => ((Mask::OPEN, Mask::OPEN), 0),
        };
        let diagonal = diagonal.clamp(isize::MIN as i128 / 4, isize::MAX as i128 / 4) as isize;
        let mask = Mask::banded(shape.seqlen_q, shape.seqlen_k, (causal == 1, offset), window, diagonal);
        (mask.causal as usize, mask.offset, mask.start_offset)
    }

    /// The scale to use for `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// [`AttentionOptions::scale_for`], checked: every entry point calls this before a launch.
    ///
    /// The score modification is checked here too ([`ScoreMod::check`]), so that every entry
    /// point refuses a bad one before a launch.
    ///
    /// # Errors
    /// [`Error::InvalidScale`] for a NaN or infinite scale (every kernel would return garbage,
    /// each a different garbage); [`Error::ScoreMod`].
    pub fn checked_scale(&self, head_dim: usize) -> Result<f32> {
        self.score.check()?;
        let scale = self.scale_for(head_dim);
        if scale.is_finite() { Ok(scale) } else { Err(Error::InvalidScale { scale }) }
    }

    /// Floating-point operations of one forward pass in the field's convention: 4 · batch ·
    /// heads · seqlen_q · seqlen_k · head_dim, halved for a causal mask; with a sliding window,
    /// 4 · batch · heads · head_dim times the (query, key) pairs that are visible. The backward
    /// pass counts 2.5 times this.
    pub fn forward_flops(&self, shape: &AttentionShape) -> f64 {
        let full = shape.forward_flops();
        if self.window.is_some() || self.mask_table.is_some() {
            // The visible keys of each query are one band: the kernels' own mask counts them
            // (its table pointer is the host copy's here).
            let (causal, offset, start_offset) = self.mask_args(shape);
            let (sq, sk) = (shape.seqlen_q, shape.seqlen_k);
            // A table made for another shape (which every launch refuses) is not read.
            let table = self.mask_table.filter(|t| t.dims == [shape.batch, sq, sk]);
            let mask = attn_kernels::attention::mask::Mask::from_args(sq, sk, causal, offset, start_offset)
                .with_table(table.map_or(std::ptr::null(), |t| t.words.as_ptr()));
            let batches = if table.is_some() { shape.batch } else { 1 };
            let pairs: usize = (0..batches)
                .map(|b| {
                    let mask = mask.for_batch(b);
                    (0..sq).map(|i| mask.key_limit(i).saturating_sub(mask.key_start(i))).sum::<usize>()
                })
                .sum();
            return full * pairs as f64 / (batches * sq * sk).max(1) as f64;
        }
        if self.causal == Causal::None { full } else { full / 2.0 }
    }
}

/// How the FlashAttention backward pass accumulates dQ. Which is faster depends on the kernels:
/// [`DqAccumulation::fastest_for`] gives the measured choice per element type, and
/// [`Context::dq_accumulation_for`](crate::Context::dq_accumulation_for) the one for a device
/// (`select.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DqAccumulation {
    /// The K/V-outer kernel adds each key tile's share of dQ to device memory with atomic adds
    /// (for `f16`/`bf16` into an `f32` copy of dQ, rounded by a last small kernel): no second
    /// pass over the tiles, the faster mode for `f32`, but the additions land in a different
    /// order on every run, so the last bits of dQ can differ between runs (dK and dV never do).
    #[default]
    Atomic,
    /// dQ summed in a fixed order: bit-identical results on every run. The sm_80 kernels run a
    /// second kernel, outer loop over query tiles, that recomputes P and dS; the Hopper kernel
    /// adds each dQ tile in turns, key block after key block (FlashAttention-3's way).
    Deterministic,
}

impl DqAccumulation {
    /// The mode's name on the command line and in tables: `atomic`, `deterministic`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Atomic => "atomic",
            Self::Deterministic => "deterministic",
        }
    }
}

impl std::str::FromStr for DqAccumulation {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Self::Atomic, Self::Deterministic]
            .into_iter()
            .find(|mode| mode.name() == s)
            .ok_or_else(|| format!("`{s}` is not one of atomic, deterministic"))
    }
}

/// Tile sizes of the FlashAttention kernels: `block_m` query rows per block (the paper's Br),
/// `block_n` key/value rows per shared-memory tile (Bc) and, for the tensor-core kernels
/// (`f16`, `bf16`), `stages`: the slots of the `cp.async` ring that streams tiles in while earlier
/// ones are used. The number of warps follows from the tile: 4 for the `f32` kernels and the
/// tensor-core forward (whose warps each own `block_m / 64` m-tiles of 16 query rows); for the
/// other tensor-core kernels one per 16 rows of the dimension a block owns (`block_m / 16` in the
/// dQ kernel, `block_n / 16` in the K/V-outer backward kernels; see [`TileConfig::warps`]).
///
/// Each compiled (kernel, dtype, block_m, block_n, head_dim, stages) is a separate kernel;
/// [`TileConfig::validate_kernel`] says which exist and fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TileConfig {
    /// Query rows per query tile (Br); a multiple of 16.
    pub block_m: usize,
    /// Key/value rows per key tile (Bc); a multiple of 16 in the compiled set.
    pub block_n: usize,
    /// Pipeline stages of the tensor-core kernels (2 or 3); 1 for the `f32` kernels, which load
    /// tiles synchronously.
    pub stages: usize,
}

impl std::fmt::Display for TileConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "m{}_n{}", self.block_m, self.block_n)?;
        if self.stages > 1 { write!(f, "_s{}", self.stages) } else { Ok(()) }
    }
}

impl TileConfig {
    /// A tile of `block_m` query rows and `block_n` key/value rows, one stage (the `f32`
    /// kernels); not validated until used.
    pub const fn new(block_m: usize, block_n: usize) -> Self {
        Self { block_m, block_n, stages: 1 }
    }

    /// The same tile with `stages` pipeline stages (the tensor-core kernels).
    pub const fn with_stages(self, stages: usize) -> Self {
        Self { stages, ..self }
    }

    /// `(block_m, block_n)`, or `(block_m, block_n, stages)` for a pipelined tile.
    pub(crate) fn describe(&self) -> String {
        if self.stages > 1 {
            format!("({}, {}, {})", self.block_m, self.block_n, self.stages)
        } else {
            format!("({}, {})", self.block_m, self.block_n)
        }
    }
}

/// Checks the grid limits of the flash kernel (heads on grid y, batch on grid z).
pub(crate) fn check_flash_grid(shape: &AttentionShape) -> Result<()> {
    // The entry points write an empty problem's outputs without a kernel; a launcher reached
    // with one is a bug of this crate, which CUDA would report as an invalid grid.
    if shape.is_empty() {
        return Err(Error::Shape(format!("an empty problem {shape:?} reached a kernel launch")));
    }
    if shape.num_heads_q > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(Error::Shape(format!(
            "batch = {} and num_heads_q = {} must each be at most {MAX_GRID_YZ} (CUDA grid limit)",
            shape.batch, shape.num_heads_q
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_kernels::attention::mask::Mask;
    use attn_kernels::attention::schedule::KeyBlock;

    /// Every small mask: causal or not, either alignment, every window side from open to 4 keys.
    fn masks() -> Vec<AttentionOptions<'static>> {
        let sides = [None, Some(0), Some(1), Some(2), Some(4)];
        let mut all = Vec::new();
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            all.push(AttentionOptions::causal(causal));
            for left in sides {
                for right in sides {
                    for bottom_right in [false, true] {
                        let window = SlidingWindow { left, right, bottom_right };
                        all.push(AttentionOptions::causal(causal).with_window(window));
                    }
                }
            }
        }
        all
    }

    /// The words of mask tables of `seqlen` tokens: one document, one per token, two (split in the middle),
    /// three (a one-token document between two others), and prefix-LM with prefixes 0, 1, half
    /// and all of the row.
    fn small_tables(seqlen: usize) -> Vec<Vec<u32>> {
        let documents = |id: &dyn Fn(usize) -> usize| -> Vec<(usize, usize)> {
            (0..seqlen)
                .map(|i| {
                    let start = (0..=i).rev().take_while(|&t| id(t) == id(i)).last().unwrap_or(i);
                    let end = (i..seqlen).take_while(|&t| id(t) == id(i)).last().unwrap_or(i) + 1;
                    (start, end)
                })
                .collect()
        };
        let half = seqlen / 2;
        let mut bands = vec![
            documents(&|_| 0),
            documents(&|i| i),
            documents(&|i| (i < half) as usize),
            documents(&|i| (i >= half) as usize + (i > half) as usize),
        ];
        for prefix in [0, 1, half, seqlen] {
            bands.push((0..seqlen).map(|i| (0, (i + 1).max(prefix))).collect());
        }
        bands.iter().map(|b| table_words(b, 1, seqlen, seqlen)).collect()
    }

    /// The tables of packed rows of two sequences, split at a few points of `seqlen_q` and
    /// `seqlen_k` (empty sequences too), and of three whose middle one has keys but no queries
    /// or queries but no keys (gaps), under each causal mask with and without a window; each
    /// checked against the definition (a query sees the keys of its own sequence that the mask,
    /// on that sequence's lengths, lets it see).
    fn varlen_tables(seqlen_q: usize, seqlen_k: usize) -> Vec<Vec<u32>> {
        let splits = |n: usize| {
            let mut at = vec![0, 1.min(n), n / 2, n];
            at.dedup();
            at
        };
        let mut rows: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
        for a in splits(seqlen_q) {
            for b in splits(seqlen_k) {
                rows.push((vec![0, a, seqlen_q], vec![0, b, seqlen_k]));
            }
        }
        let (a, b) = (seqlen_q / 2, seqlen_k / 2);
        rows.push((vec![0, a, a, seqlen_q], vec![0, b / 2, b, seqlen_k]));
        rows.push((vec![0, a / 2, a, seqlen_q], vec![0, b, b, seqlen_k]));
        // (sequence, position in it, its length) of row `x` of a packed row with offsets `cu`.
        let locate = |cu: &[usize], x: usize| {
            let s = cu.partition_point(|&c| c <= x) - 1;
            (s, x - cu[s], cu[s + 1] - cu[s])
        };
        let mut tables = Vec::new();
        for (cu_q, cu_k) in &rows {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                for window in [None, Some(SlidingWindow::left(1))] {
                    let bands = varlen_bands(cu_q, cu_k, causal, window);
                    let words = table_words(&bands, 1, seqlen_q, seqlen_k);
                    let dims = [1, seqlen_q, seqlen_k];
                    let gapped = table_gap(&words, seqlen_q, seqlen_k).is_some();
                    let table =
                        MaskTableRef { address: 0, owner: 0, dims, words: &words, kind: MaskTableKind::Varlen, gapped };
                    for i in 0..seqlen_q {
                        for j in 0..seqlen_k {
                            let ((sq, t, lq), (sk, u, lk)) = (locate(cu_q, i), locate(cu_k, j));
                            let want = sq == sk
                                && causal.visible(t, u, lq, lk)
                                && window.is_none_or(|w| w.contains(t, u, lq, lk));
                            let what = format!("{causal:?} {window:?} {cu_q:?} / {cu_k:?}");
                            assert_eq!(table.visible(0, i, j), want, "{what}: ({i}, {j})");
                        }
                    }
                    tables.push(words);
                }
            }
        }
        tables
    }

    /// The kernels' mask (from the three arguments the host passes) is the definition, element
    /// by element; the key ranges of query blocks and the query ranges of key blocks skip only
    /// hidden tiles and skip the per-element mask only on fully visible ones.
    #[test]
    fn the_kernels_mask_is_the_definition_and_skips_only_hidden_tiles() {
        for seqlen_q in 1..10 {
            for seqlen_k in 1..10 {
                let words = if seqlen_q == seqlen_k { small_tables(seqlen_q) } else { Vec::new() };
                let dims = [1, seqlen_q, seqlen_k];
                let tables = words.iter().map(|w| MaskTableRef {
                    address: 0,
                    owner: 0,
                    dims,
                    words: w,
                    kind: MaskTableKind::Documents,
                    gapped: false,
                });
                let tables = std::iter::once(None).chain(tables.map(Some));
                // Varlen tables carry their sequences' masks: the calls refuse a mask of their own.
                let varlen = varlen_tables(seqlen_q, seqlen_k);
                let varlen = varlen.iter().map(|w| {
                    let gapped = table_gap(w, seqlen_q, seqlen_k).is_some();
                    MaskTableRef { address: 0, owner: 0, dims, words: w, kind: MaskTableKind::Varlen, gapped }
                });
                let cases = masks().into_iter().flat_map(|o| tables.clone().map(move |t| (o, t)));
                for (options, table) in cases.chain(varlen.map(|t| (AttentionOptions::default(), Some(t)))) {
                    let options = match table {
                        Some(table) => options.with_mask_table(table),
                        None => options,
                    };
                    let shape =
                        AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 8 };
                    let (causal, offset, start) = options.mask_args(&shape);
                    let words = options.mask_table.map_or(std::ptr::null(), |t| t.words.as_ptr());
                    let mask = Mask::from_args(seqlen_q, seqlen_k, causal, offset, start).with_table(words);
                    let sees = |i: usize, j: usize| options.visible(0, i, j, seqlen_q, seqlen_k);
                    let what = format!("{options:?} on {seqlen_q} × {seqlen_k}");
                    for i in 0..seqlen_q {
                        for j in 0..seqlen_k {
                            assert_eq!(mask.visible(i, j), sees(i, j), "{what}: ({i}, {j})");
                        }
                    }
                    // The per-row bands the kernels mask with, padding rows and columns included.
                    let inside = |x: usize, (start, width): (usize, usize)| x.wrapping_sub(start) < width;
                    for i in 0..seqlen_q + 3 {
                        for j in 0..seqlen_k + 3 {
                            let want = i < seqlen_q && j < seqlen_k && sees(i, j);
                            assert_eq!(inside(j, mask.keys_seen_by(i)), want, "{what}: keys of {i}, {j}");
                            assert_eq!(inside(i, mask.queries_seeing(j)), want, "{what}: queries of {j}, {i}");
                        }
                    }
                    for (bm, bn) in [(1, 1), (2, 3), (4, 2), (16, 16)] {
                        for q_start in (0..seqlen_q).step_by(bm) {
                            let rows = bm.min(seqlen_q - q_start);
                            let keys = mask.keys_for(q_start, rows);
                            let first = keys.first_tile(bn) * bn;
                            let end = first + keys.tiles(bn) * bn;
                            for j in 0..seqlen_k {
                                let seen = (q_start..q_start + rows).any(|i| sees(i, j));
                                assert!(!seen || (first..end).contains(&j), "{what}: block {q_start} skips key {j}");
                            }
                            for k_start in (first..end).step_by(bn) {
                                let all = (q_start..q_start + rows)
                                    .all(|i| (k_start..(k_start + bn).min(seqlen_k)).all(|j| sees(i, j)));
                                let whole = k_start + bn <= seqlen_k;
                                assert!(keys.needs_mask(k_start, bn) || (all && whole), "{what}: tile {k_start}");
                            }
                        }
                        let key_block = |block| match (bm, bn) {
                            (1, 1) => KeyBlock::new_for_tests::<1, 1>(&shape, &mask, block),
                            (2, 3) => KeyBlock::new_for_tests::<2, 3>(&shape, &mask, block),
                            (4, 2) => KeyBlock::new_for_tests::<4, 2>(&shape, &mask, block),
                            _ => KeyBlock::new_for_tests::<16, 16>(&shape, &mask, block),
                        };
                        // The deterministic Hopper backward's turns (`sm90::backward::turn`): the
                        // key blocks that visit a query tile are consecutive, from the block of
                        // its first row's start to the block of its last row's limit. (A table
                        // with gaps never gets there: `AttentionOptions::has_gapped_table`.)
                        let gapped = options.has_gapped_table();
                        for tile in (0..seqlen_q.div_ceil(bm)).filter(|_| !gapped) {
                            let visitors: Vec<usize> = (0..seqlen_k.div_ceil(bn))
                                .filter(|&b| (key_block(b).first_tile..key_block(b).end_tile).contains(&tile))
                                .collect();
                            let (Some(&a), Some(&b)) = (visitors.first(), visitors.last()) else { continue };
                            assert_eq!(visitors.len(), b - a + 1, "{what}: tile {tile}: {visitors:?}");
                            let last_row = ((tile + 1) * bm).min(seqlen_q) - 1;
                            if mask.causal {
                                assert_eq!(b, (mask.key_limit(last_row) - 1) / bn, "{what}: tile {tile}");
                            } else {
                                assert_eq!(a, mask.key_start(tile * bm) / bn, "{what}: tile {tile}");
                            }
                        }
                        for block in 0..seqlen_k.div_ceil(bn) {
                            let kb = key_block(block);
                            let (rows, keys) =
                                (kb.first_tile * bm..kb.end_tile * bm, kb.k_start..kb.k_start + kb.k_rows);
                            for i in 0..seqlen_q {
                                let seen = keys.clone().any(|j| sees(i, j));
                                assert!(!seen || rows.contains(&i), "{what}: key block {block} skips query {i}");
                            }
                            for q_start in rows.clone().step_by(bm) {
                                let all =
                                    (q_start..q_start + bm).all(|i| keys.clone().all(|j| i < seqlen_q && sees(i, j)));
                                assert!(mask.tile_needs_mask(q_start, bm, kb.k_start, bn) || all, "{what}: {q_start}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_window_counts_only_its_visible_pairs() {
        let shape =
            AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 100, seqlen_k: 100, head_dim: 64 };
        let window = AttentionOptions::default().with_window(SlidingWindow::left(9));
        // 10 keys for rows 9..100, 1..=9 for the first nine: 910 + 45 pairs of 10 000.
        let expected = shape.forward_flops() * 955.0 / 10_000.0;
        assert!((window.forward_flops(&shape) - expected).abs() < 1e-6 * expected);
    }
}

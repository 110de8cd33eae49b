//! CPU references (rayon, `f64` accumulation): the ground truth the GPU kernels are tested
//! against, and, in [`flash_attention`], the FlashAttention algorithm without any GPU detail.
//!
//! Inputs are `f32` tensors in the layouts of [`AttentionShape`]; outputs are `f64`. Masks follow
//! [`Causal::visible`]; a query row that sees no key gets O = 0, LSE = −∞ and no gradient. Every
//! function checks its inputs' lengths against the shape and returns [`Error`] rather than
//! panicking.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::problem::{AttentionOptions, AttentionShape, Causal, MaskTableRef, ScoreMod, SlidingWindow, TileConfig};

/// C = A + B elementwise.
///
/// # Errors
/// [`Error::Length`] if the lengths differ.
pub fn vector_add(a: &[f32], b: &[f32]) -> Result<Vec<f64>> {
    if a.len() != b.len() {
        return Err(Error::Length { expected: a.len(), got: b.len() });
    }
    Ok(a.par_iter().zip(b).map(|(&x, &y)| x as f64 + y as f64).collect())
}

/// Checks `shape` (as [`AttentionShape::from_qkv_allowing_empty`] does: empty problems are fine) and that Q (and dO) hold
/// `shape.q_shape()` elements and K, V `shape.kv_shape()`.
/// Checks that the sinks of `params`, if any, are one per query head, and that its mask table
/// and bias, if any, were made for `shape`.
fn check_sinks(shape: &AttentionShape, params: &Params) -> Result<()> {
    if let Some(table) = params.mask_table
        && table.dims() != [shape.batch, shape.seqlen_q, shape.seqlen_k]
    {
        return Err(Error::MaskTable(format!(
            "the {} table was made for [batch, seqlen_q, seqlen_k] = {:?}; the problem is {shape:?}",
            table.kind(),
            table.dims()
        )));
    }
    if let Some(bias) = params.bias {
        let [b, h, sq, sk] = bias.shape;
        let fits = (b == 1 || b == shape.batch)
            && (h == 1 || h == shape.num_heads_q)
            && [sq, sk] == [shape.seqlen_q, shape.seqlen_k]
            && bias.values.len() == bias.shape.iter().product::<usize>();
        if !fits {
            return Err(Error::Bias(format!(
                "{} bias values of shape {:?} for the problem {shape:?}",
                bias.values.len(),
                bias.shape
            )));
        }
    }
    match params.sinks {
        Some(s) if s.len() != shape.num_heads_q => {
            Err(Error::Sinks(format!("{} sinks for {} query heads", s.len(), shape.num_heads_q)))
        }
        _ => Ok(()),
    }
}

fn check_inputs(shape: &AttentionShape, q: &[f32], k: &[f32], v: &[f32], d_o: Option<&[f32]>) -> Result<()> {
    let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
    AttentionShape::from_qkv_allowing_empty(&q_shape, &kv_shape, &kv_shape)?;
    let (q_len, kv_len) = (q_shape.iter().product::<usize>(), kv_shape.iter().product::<usize>());
    for (got, expected) in
        [(q.len(), q_len), (k.len(), kv_len), (v.len(), kv_len), (d_o.map_or(q_len, <[f32]>::len), q_len)]
    {
        if got != expected {
            return Err(Error::Length { expected, got });
        }
    }
    Ok(())
}

/// Attention outputs in `f64`: O `[batch, num_heads_q, seqlen_q, head_dim]` and the natural-log
/// logsumexp `[batch, num_heads_q, seqlen_q]`.
#[derive(Clone, Debug)]
pub struct Reference {
    /// O, row-major, the shape of Q.
    pub o: Vec<f64>,
    /// ln Σ_j exp(scale · q·k_j) over the visible keys, per query row; −∞ if it sees none.
    pub lse: Vec<f64>,
}

/// Gradients in `f64`, in the shapes of Q, K and V.
#[derive(Clone, Debug)]
pub struct GradientReference {
    /// ∂loss/∂Q.
    pub dq: Vec<f64>,
    /// ∂loss/∂K, summed over the query heads of each group.
    pub dk: Vec<f64>,
    /// ∂loss/∂V, summed over the query heads of each group.
    pub dv: Vec<f64>,
    /// ∂loss/∂sinks, `[num_heads_q]`, with attention sinks ([`Params::sinks`]); empty without.
    pub d_sinks: Vec<f64>,
    /// ∂loss/∂bias, the bias's shape, with a bias ([`Params::bias`]); empty without.
    pub d_bias: Vec<f64>,
}

/// An additive bias's values on the host, as the references take it ([`crate::Bias`] is the
/// device tensor's): `values` row-major of `shape = [batch or 1, num_heads_q or 1, seqlen_q,
/// seqlen_k]`, a dimension of 1 broadcast.
#[derive(Clone, Copy, Debug)]
pub struct BiasValues<'a> {
    /// The entries, natural-log units.
    pub values: &'a [f32],
    /// `[batch or 1, num_heads_q or 1, seqlen_q, seqlen_k]`.
    pub shape: [usize; 4],
}

impl BiasValues<'_> {
    /// The index of entry `[b][h][i][j]` in the bias (and dBias): broadcast dimensions have one.
    pub fn index(&self, b: usize, h: usize, i: usize, j: usize) -> usize {
        let (batch_stride, head_stride) = crate::problem::bias_strides(&self.shape);
        b * batch_stride + h * head_stride + i * self.shape[3] + j
    }
}

/// The scale, mask, score modification and attention sinks of a problem, as the reference
/// functions take them.
#[derive(Clone, Copy, Debug)]
pub struct Params<'a> {
    /// Multiplies Q Kᵀ before the softmax.
    pub scale: f64,
    /// Causal mask.
    pub causal: Causal,
    /// Sliding window, intersected with the causal mask.
    pub window: Option<SlidingWindow>,
    /// Softcapping or ALiBi ([`ScoreMod::logit`]).
    pub score: ScoreMod,
    /// Attention sinks, one natural-log logit per query head ([`crate::Sinks`]), on the host.
    pub sinks: Option<&'a [f32]>,
    /// A mask given per token ([`crate::MaskTable`]), intersected with the causal mask and the
    /// window (its host copy is what the references read).
    pub mask_table: Option<MaskTableRef<'a>>,
    /// An additive bias on the logits ([`crate::Bias`]), on the host.
    pub bias: Option<BiasValues<'a>>,
}

impl<'a> Params<'a> {
    /// The scale, mask (its table included) and score modification of `options` for
    /// `head_dim`, without sinks or a bias (those of `options` live on a device: give their
    /// values as [`Params::sinks`] and [`Params::bias`]).
    pub fn of(options: &AttentionOptions<'a>, head_dim: usize) -> Self {
        Self {
            scale: options.scale_for(head_dim) as f64,
            causal: options.causal,
            window: options.window,
            score: options.score,
            sinks: None,
            mask_table: options.mask_table,
            bias: None,
        }
    }

    /// The sink of query head `h`, if the problem has sinks.
    fn sink(&self, h: usize) -> Option<f64> {
        self.sinks.map(|s| s[h] as f64)
    }

    /// The logit of query `i` and key `j` of query head `h` of batch entry `b` whose product is
    /// `dot`: `scale · dot`, modified ([`ScoreMod::logit`]), plus the bias.
    fn logit(&self, dot: f64, (b, h): (usize, usize), i: usize, j: usize, shape: &AttentionShape) -> f64 {
        let bias = self.bias.map_or(0.0, |bias| bias.values[bias.index(b, h, i, j)] as f64);
        self.score.logit(self.scale * dot, h, i, j, shape) + bias
    }

    /// Whether query `i` of batch entry `b` sees key `j` ([`AttentionOptions::visible`]).
    pub fn visible(&self, b: usize, i: usize, j: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        AttentionOptions { causal: self.causal, window: self.window, mask_table: self.mask_table, ..Default::default() }
            .visible(b, i, j, seqlen_q, seqlen_k)
    }
}

/// One head's view of the inputs: its Q rows and its (shared, under GQA) K and V rows; `h` is
/// the query head (ALiBi's slope depends on it), `b` its batch entry (a mask table's rows do).
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    h: usize,
    b: usize,
}

fn head<'a>(q: &'a [f32], k: &'a [f32], v: &'a [f32], shape: &AttentionShape, b: usize, h: usize) -> Head<'a> {
    let (q_start, kv_start) = (shape.q_head_offset(b, h), shape.kv_head_offset(b, h));
    let (q_len, kv_len) = (shape.seqlen_q * shape.head_dim, shape.seqlen_k * shape.head_dim);
    Head {
        q: &q[q_start..q_start + q_len],
        k: &k[kv_start..kv_start + kv_len],
        v: &v[kv_start..kv_start + kv_len],
        h,
        b,
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Softmax probabilities of query row `i` over all keys (0 for hidden ones) and its LSE; the
/// head's sink, if any, joins the sum: `LSE = ln(e^sink + Σ_j e^(ℓ_j))`, `p_j = e^(ℓ_j − LSE)`.
fn probabilities(q_row: &[f32], i: usize, head: &Head, shape: &AttentionShape, params: Params) -> (Vec<f64>, f64) {
    let d = shape.head_dim;
    let scores: Vec<Option<f64>> = head
        .k
        .chunks_exact(d)
        .enumerate()
        .map(|(j, k_row)| {
            params
                .visible(head.b, i, j, shape.seqlen_q, shape.seqlen_k)
                .then(|| params.logit(dot(q_row, k_row), (head.b, head.h), i, j, shape))
        })
        .collect();
    let terms = || scores.iter().flatten().copied().chain(params.sink(head.h));
    let max = terms().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return (vec![0.0; scores.len()], f64::NEG_INFINITY);
    }
    // ln Σ e^s = +∞ where a term is +∞; then e^(s − LSE) is 0 for the finite scores and
    // ∞ − ∞ = NaN for an infinite one.
    let lse = if max == f64::INFINITY { max } else { max + terms().map(|s| (s - max).exp()).sum::<f64>().ln() };
    (scores.iter().map(|s| s.map_or(0.0, |s| (s - lse).exp())).collect(), lse)
}

/// The plain formula for query row `i`: o = Σ_j p_j v_j; returns the LSE.
fn plain_row(q_row: &[f32], i: usize, head: &Head, shape: &AttentionShape, params: Params, o_row: &mut [f64]) -> f64 {
    let (p, lse) = probabilities(q_row, i, head, shape, params);
    o_row.fill(0.0);
    for (p_j, v_row) in p.iter().zip(head.v.chunks_exact(shape.head_dim)) {
        // Keys the row does not see (p = 0) take no part at all: not even as 0 · ∞ = NaN.
        if *p_j == 0.0 {
            continue;
        }
        for (o, &x) in o_row.iter_mut().zip(v_row) {
            *o += p_j * x as f64;
        }
    }
    lse
}

/// Attention by the plain formula, O = softmax(mask(Q Kᵀ · scale)) V, every head (rows in
/// parallel).
///
/// # Errors
/// [`Error::Shape`] or [`Error::Length`] when the inputs do not match `shape`.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], shape: &AttentionShape, params: Params) -> Result<Reference> {
    check_inputs(shape, q, k, v, None)?;
    check_sinks(shape, &params)?;
    let d = shape.head_dim;
    let mut o = vec![0.0; shape.query_rows() * d];
    let mut lse = vec![0.0; shape.query_rows()];
    o.par_chunks_mut(d).zip(lse.par_iter_mut()).enumerate().for_each(|(row, (o_row, lse_row))| {
        let head_index = row / shape.seqlen_q;
        let (b, h) = (head_index / shape.num_heads_q, head_index % shape.num_heads_q);
        let head = head(q, k, v, shape, b, h);
        let i = row % shape.seqlen_q;
        *lse_row = plain_row(&head.q[i * d..(i + 1) * d], i, &head, shape, params, o_row);
    });
    Ok(Reference { o, lse })
}

/// The plain formula for a single head `(b, h)`: O `[seqlen_q, head_dim]` and LSE `[seqlen_q]`
/// of that head only. For checking a large problem on a few heads.
///
/// # Errors
/// As [`attention`], and [`Error::Shape`] if `(b, h)` is not a head of `shape`.
pub fn attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    params: Params,
    b: usize,
    h: usize,
) -> Result<Reference> {
    check_inputs(shape, q, k, v, None)?;
    check_sinks(shape, &params)?;
    if b >= shape.batch || h >= shape.num_heads_q {
        return Err(Error::Shape(format!(
            "head ({b}, {h}) is outside batch {} × {} heads",
            shape.batch, shape.num_heads_q
        )));
    }
    let d = shape.head_dim;
    let head = head(q, k, v, shape, b, h);
    let mut o = vec![0.0; shape.seqlen_q * d];
    let mut lse = vec![0.0; shape.seqlen_q];
    o.par_chunks_mut(d).zip(lse.par_iter_mut()).zip(head.q.par_chunks(d)).enumerate().for_each(
        |(i, ((o_row, lse_row), q_row))| {
            *lse_row = plain_row(q_row, i, &head, shape, params, o_row);
        },
    );
    Ok(Reference { o, lse })
}

/// The gradients of `loss = Σ O ∘ dO` by the plain formula (FlashAttention paper, Algorithm 3):
/// with P the masked softmax,
///
/// ```text
/// dV = Pᵀ dO    dP = dO Vᵀ    D_i = Σ_j P_ij dP_ij    dS = P ∘ (dP − D)
/// dQ = scale · dS K           dK = scale · dSᵀ Q
/// ```
///
/// summed over the query heads of each group for dK and dV. Key/value heads in parallel.
///
/// # Errors
/// [`Error::Shape`] or [`Error::Length`] when the inputs do not match `shape`.
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
    shape: &AttentionShape,
    params: Params,
) -> Result<GradientReference> {
    backward(q, k, v, None, d_o, shape, params)
}

/// [`attention_backward`] for a given forward output `o` (Q's shape): D_i = Σ_c dO_ic · O_ic, as
/// FlashAttention's backward defines it (Dao 2023, Algorithm 2: D = rowsum(dO ∘ O)) and as the
/// kernels compute it from the O they are handed, instead of Σ_j P_ij dP_ij from the exact P.
/// The two agree for the exact O; for an O rounded to 16 bits they differ by
/// rowsum(dO ∘ (O₁₆ − O)), which is the whole of dS where a row's softmax is nearly one-hot (dS
/// = P ∘ (dP − D) then cancels to almost nothing): there a kernel's dQ is only comparable with
/// this reference, the exact gradient of the O it was given.
///
/// # Errors
/// As [`attention_backward`], and [`Error::Length`] when `o` is not Q's length.
pub fn attention_backward_given_o(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_o: &[f32],
    shape: &AttentionShape,
    params: Params,
) -> Result<GradientReference> {
    if o.len() != q.len() {
        return Err(Error::Length { expected: q.len(), got: o.len() });
    }
    backward(q, k, v, Some(o), d_o, shape, params)
}

/// [`attention_backward`], with D from `o` where it is given ([`attention_backward_given_o`]).
fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: Option<&[f32]>,
    d_o: &[f32],
    shape: &AttentionShape,
    params: Params,
) -> Result<GradientReference> {
    check_inputs(shape, q, k, v, Some(d_o))?;
    check_sinks(shape, &params)?;
    let d = shape.head_dim;
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let mut d_sinks = vec![0.0; if params.sinks.is_some() { shape.num_heads_q } else { 0 }];
    let mut d_bias = vec![0.0; params.bias.map_or(0, |b| b.values.len())];
    if shape.is_empty() {
        // No query sees a key: every gradient is 0 (O = 0, so D = 0 for the sinks too).
        return Ok(GradientReference { dq, dk, dv, d_sinks, d_bias });
    }
    let group = shape.group_size();
    // Chunks: dQ of the `group` query heads of one key/value head, and that head's dK and dV;
    // each returns its query heads' sink gradients and dS (with a bias), added up below in a
    // fixed order.
    let parts: Vec<Vec<HeadGradients>> = dq
        .par_chunks_mut(group * shape.seqlen_q * d)
        .zip(dk.par_chunks_mut(shape.seqlen_k * d))
        .zip(dv.par_chunks_mut(shape.seqlen_k * d))
        .enumerate()
        .map(|(kv_index, ((dq_group, dk_head), dv_head))| {
            let (b, kv_head) = (kv_index / shape.num_heads_kv, kv_index % shape.num_heads_kv);
            let mut parts = Vec::with_capacity(group);
            for (g, dq_head) in dq_group.chunks_mut(shape.seqlen_q * d).enumerate() {
                let h = kv_head * group + g;
                let head = head(q, k, v, shape, b, h);
                let do_head = &d_o[shape.q_head_offset(b, h)..][..shape.seqlen_q * d];
                let o_head = o.map(|o| &o[shape.q_head_offset(b, h)..][..shape.seqlen_q * d]);
                parts.push(backward_head(&head, (o_head, do_head), shape, params, dq_head, dk_head, dv_head));
            }
            parts
        })
        .collect();
    for (kv_index, parts) in parts.iter().enumerate() {
        let (b, kv_head) = (kv_index / shape.num_heads_kv, kv_index % shape.num_heads_kv);
        for (g, part) in parts.iter().enumerate() {
            let h = kv_head * group + g;
            if !d_sinks.is_empty() {
                d_sinks[h] += part.d_sink;
            }
            if let Some(bias) = params.bias {
                for (ij, ds) in part.ds.iter().enumerate() {
                    d_bias[bias.index(b, h, ij / shape.seqlen_k, ij % shape.seqlen_k)] += ds;
                }
            }
        }
    }
    Ok(GradientReference { dq, dk, dv, d_sinks, d_bias })
}

/// What one query head's backward returns besides its dQ, dK and dV: its sink's gradient over
/// its rows, `−Σ_i e^(sink − LSE_i) · D_i` (0 without sinks), and with a bias its dS,
/// `[seqlen_q × seqlen_k]` (empty without), which is its dBias.
struct HeadGradients {
    d_sink: f64,
    ds: Vec<f64>,
}

/// One query head's contribution: writes its dQ, adds to its key/value head's dK and dV, and
/// returns its sink's and bias's gradients ([`HeadGradients`]). D comes from `o_head` where it
/// is given ([`attention_backward_given_o`]).
fn backward_head(
    head: &Head,
    (o_head, do_head): (Option<&[f32]>, &[f32]),
    shape: &AttentionShape,
    params: Params,
    dq: &mut [f64],
    dk: &mut [f64],
    dv: &mut [f64],
) -> HeadGradients {
    let d = shape.head_dim;
    let mut d_sink = 0.0;
    let mut ds_all = vec![0.0; if params.bias.is_some() { shape.seqlen_q * shape.seqlen_k } else { 0 }];
    for (i, (q_row, do_row)) in head.q.chunks_exact(d).zip(do_head.chunks_exact(d)).enumerate() {
        let (p, lse) = probabilities(q_row, i, head, shape, params);
        // ∂ℓ/∂(q·k) = scale · ScoreMod::derivative.
        let x = |j: usize| params.scale * dot(q_row, &head.k[j * d..(j + 1) * d]);
        let dp: Vec<f64> = head.v.chunks_exact(d).map(|v_row| dot(do_row, v_row)).collect();
        let delta: f64 = match o_head {
            Some(o) => dot(do_row, &o[i * d..(i + 1) * d]),
            None => p.iter().zip(&dp).map(|(p, dp)| p * dp).sum(),
        };
        if let Some(sink) = params.sink(head.h) {
            // The sink is a "key" with dP = 0: its dS is p_sink · (0 − D).
            d_sink -= (sink - lse).exp() * delta;
        }
        let dq_row = &mut dq[i * d..(i + 1) * d];
        for j in 0..shape.seqlen_k {
            if p[j] == 0.0 {
                continue;
            }
            let ds = p[j] * (dp[j] - delta) * params.score.derivative(x(j));
            if !ds_all.is_empty() {
                ds_all[i * shape.seqlen_k + j] = ds;
            }
            let (k_row, dk_row, dv_row) =
                (&head.k[j * d..(j + 1) * d], &mut dk[j * d..(j + 1) * d], &mut dv[j * d..(j + 1) * d]);
            for c in 0..d {
                dq_row[c] += params.scale * ds * k_row[c] as f64;
                dk_row[c] += params.scale * ds * q_row[c] as f64;
                dv_row[c] += p[j] * do_row[c] as f64;
            }
        }
    }
    HeadGradients { d_sink, ds: ds_all }
}

/// FlashAttention-2's forward algorithm (Dao 2023, Algorithm 1) on the CPU, in `f64`: the same
/// tiling and online softmax as the GPU kernel, none of the thread bookkeeping.
///
/// For each block of `tile.block_m` query rows, key/value tiles of `tile.block_n` rows are
/// visited in order; per row the running maximum `m`, the running sum `l` of exp(s − m) and
/// the unnormalised output `acc` are updated over the visible keys:
///
/// ```text
/// m_new = max(m, max_j s_j)
/// acc   = acc · exp(m − m_new) + Σ_j exp(s_j − m_new) · v_j
/// l     = l   · exp(m − m_new) + Σ_j exp(s_j − m_new)
/// ```
///
/// and at the end O = acc / l, LSE = m + ln l (O = 0, LSE = −∞ for a row that saw no key). The
/// result equals [`attention`] up to rounding. Any tile sizes ≥ 1 work here.
///
/// # Errors
/// As [`attention`], and [`Error::Shape`] for a tile size of 0.
pub fn flash_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    params: Params,
    tile: TileConfig,
) -> Result<Reference> {
    check_inputs(shape, q, k, v, None)?;
    if tile.block_m == 0 || tile.block_n == 0 {
        return Err(Error::Shape(format!("tile sizes must be at least 1; got {tile:?}")));
    }
    if params.bias.is_some() {
        return Err(Error::Bias("the CPU walk-through of FlashAttention takes no bias; `attention` does".into()));
    }
    if params.sinks.is_some() {
        return Err(Error::Sinks("the CPU walk-through of FlashAttention takes no sinks; `attention` does".into()));
    }
    let d = shape.head_dim;
    let mut o = vec![0.0; shape.query_rows() * d];
    let mut lse = vec![0.0; shape.query_rows()];
    if shape.is_empty() {
        // Rows of no keys (if any): O = 0, LSE = −∞.
        return Ok(Reference { o, lse: vec![f64::NEG_INFINITY; shape.query_rows()] });
    }
    // Work items: one query block of one head. A head's rows are contiguous in O and LSE, but
    // blocks at the end of a head may be short, so chunk per head first.
    o.par_chunks_mut(shape.seqlen_q * d).zip(lse.par_chunks_mut(shape.seqlen_q)).enumerate().for_each(
        |(head_index, (o_head, lse_head))| {
            let (b, h) = (head_index / shape.num_heads_q, head_index % shape.num_heads_q);
            let head = head(q, k, v, shape, b, h);
            o_head.par_chunks_mut(tile.block_m * d).zip(lse_head.par_chunks_mut(tile.block_m)).enumerate().for_each(
                |(block, (o_block, lse_block))| {
                    let first_row = block * tile.block_m;
                    let q_block = &head.q[first_row * d..][..o_block.len()];
                    flash_block(q_block, first_row, &head, shape, params, tile.block_n, o_block, lse_block);
                },
            );
        },
    );
    Ok(Reference { o, lse })
}

// ANCHOR: flash_block
/// One block of query rows (the first is query `first_row`) against all key/value tiles; see
/// [`flash_attention`].
#[allow(clippy::too_many_arguments)]
fn flash_block(
    q_block: &[f32],
    first_row: usize,
    head: &Head,
    shape: &AttentionShape,
    params: Params,
    block_n: usize,
    o_block: &mut [f64],
    lse_block: &mut [f64],
) {
    let d = shape.head_dim;
    let rows = lse_block.len();
    let mut m = vec![f64::NEG_INFINITY; rows];
    let mut l = vec![0.0f64; rows];
    let acc = o_block; // unnormalised output until the end
    acc.fill(0.0);
    for (tile_index, (k_tile, v_tile)) in head.k.chunks(block_n * d).zip(head.v.chunks(block_n * d)).enumerate() {
        for i in 0..rows {
            let q_row = &q_block[i * d..(i + 1) * d];
            let visible = |j: usize| {
                params.visible(head.b, first_row + i, tile_index * block_n + j, shape.seqlen_q, shape.seqlen_k)
            };
            let s: Vec<Option<f64>> = k_tile
                .chunks_exact(d)
                .enumerate()
                .map(|(j, k_row)| {
                    let (query, key) = (first_row + i, tile_index * block_n + j);
                    visible(j).then(|| params.logit(dot(q_row, k_row), (head.b, head.h), query, key, shape))
                })
                .collect();
            let m_new = s.iter().flatten().copied().fold(m[i], f64::max);
            if m_new == f64::NEG_INFINITY {
                continue; // nothing visible yet: no maximum to measure from
            }
            let alpha = (m[i] - m_new).exp();
            let acc_row = &mut acc[i * d..(i + 1) * d];
            acc_row.iter_mut().for_each(|x| *x *= alpha);
            l[i] *= alpha;
            for (s_j, v_row) in s.iter().zip(v_tile.chunks_exact(d)) {
                let Some(s_j) = s_j else { continue };
                let p = (s_j - m_new).exp();
                l[i] += p;
                for (a, &x) in acc_row.iter_mut().zip(v_row) {
                    *a += p * x as f64;
                }
            }
            m[i] = m_new;
        }
    }
    for i in 0..rows {
        if m[i] == f64::INFINITY {
            // A +∞ score: ln Σ e^s = +∞, O = ∞/∞ = NaN.
            acc[i * d..(i + 1) * d].fill(f64::NAN);
            lse_block[i] = f64::INFINITY;
        } else if l[i] > 0.0 {
            acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x /= l[i]);
            lse_block[i] = m[i] + l[i].ln();
        } else {
            lse_block[i] = f64::NEG_INFINITY;
        }
    }
}
// ANCHOR_END: flash_block

/// The keys and values one sequence attends to in a decoding step, `[num_heads_kv, len, head_dim]`
/// each (head-major, `len` may be 0): what [`decode`] takes per sequence.
#[derive(Clone, Debug)]
pub struct SequenceKv {
    /// K, `num_heads_kv · len · head_dim` values.
    pub k: Vec<f32>,
    /// V, K's shape.
    pub v: Vec<f32>,
    /// Keys of the sequence.
    pub len: usize,
}

/// The decoding reference ([`crate::Context::attention_with_kv_cache`]): for each sequence `b`,
/// attention of its queries (`q`, `[batch, num_heads_q, seqlen_q, head_dim]`, head-major) over
/// its own keys `seqs[b]` by the plain formula, the mask in the sequence's coordinates
/// (bottom-right aligns to its own length, and so does a window, which decoding aligns to the
/// sequence's end), with `params`' score modification and sinks. O `[batch, num_heads_q,
/// seqlen_q, head_dim]` and LSE; a sequence without keys gives O = 0 and LSE = −∞ (or the
/// head's sink).
///
/// # Errors
/// [`Error::Shape`] or [`Error::Length`] when the lengths do not match.
pub fn decode(
    q: &[f32],
    seqs: &[SequenceKv],
    (num_heads_q, num_heads_kv, seqlen_q, head_dim): (usize, usize, usize, usize),
    params: Params,
) -> Result<Reference> {
    if params.bias.is_some() {
        return Err(Error::Bias("the decoder takes no bias, nor does its reference".into()));
    }
    let batch = seqs.len();
    let per_batch = num_heads_q * seqlen_q * head_dim;
    if q.len() != batch * per_batch {
        return Err(Error::Length { expected: batch * per_batch, got: q.len() });
    }
    let mut o = Vec::with_capacity(q.len());
    let mut lse = Vec::with_capacity(batch * num_heads_q * seqlen_q);
    for (b, seq) in seqs.iter().enumerate() {
        let q_b = &q[b * per_batch..(b + 1) * per_batch];
        if seq.len == 0 {
            o.extend(std::iter::repeat_n(0.0, per_batch));
            for h in 0..num_heads_q {
                let sink = params.sinks.map_or(f64::NEG_INFINITY, |sinks| sinks[h] as f64);
                lse.extend(std::iter::repeat_n(sink, seqlen_q));
            }
            continue;
        }
        let shape = AttentionShape { batch: 1, num_heads_q, num_heads_kv, seqlen_q, seqlen_k: seq.len, head_dim };
        let r = attention(q_b, &seq.k, &seq.v, &shape, params)?;
        o.extend(r.o);
        lse.extend(r.lse);
    }
    Ok(Reference { o, lse })
}

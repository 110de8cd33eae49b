//! CPU references (rayon, `f64` accumulation): the ground truth the GPU kernels are tested
//! against, and, in [`flash_attention`], the FlashAttention algorithm without any GPU detail.
//!
//! Inputs are `f32` tensors in the layouts of [`AttentionShape`]; outputs are `f64`.

use rayon::prelude::*;

use crate::problem::{AttentionShape, TileConfig};

/// C = A + B elementwise. Panics if the lengths differ (a caller bug in test code).
pub fn vector_add(a: &[f32], b: &[f32]) -> Vec<f64> {
    assert_eq!(a.len(), b.len(), "vector_add: lengths differ");
    a.par_iter().zip(b).map(|(&x, &y)| x as f64 + y as f64).collect()
}

/// Attention outputs in `f64`: O `[batch, num_heads_q, seqlen_q, head_dim]` and the natural-log
/// logsumexp `[batch, num_heads_q, seqlen_q]`.
#[derive(Clone, Debug)]
pub struct Reference {
    /// O, row-major, the shape of Q.
    pub o: Vec<f64>,
    /// ln Σ_j exp(scale · q·k_j) per query row.
    pub lse: Vec<f64>,
}

/// One head's view of the inputs: its Q rows and its (shared, under GQA) K and V rows.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

fn head<'a>(q: &'a [f32], k: &'a [f32], v: &'a [f32], shape: &AttentionShape, b: usize, h: usize) -> Head<'a> {
    let (q_start, kv_start) = (shape.q_head_offset(b, h), shape.kv_head_offset(b, h));
    let (q_len, kv_len) = (shape.seqlen_q * shape.head_dim, shape.seqlen_k * shape.head_dim);
    Head { q: &q[q_start..q_start + q_len], k: &k[kv_start..kv_start + kv_len], v: &v[kv_start..kv_start + kv_len] }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// The plain formula for one query row: s_j = scale · q·k_j, p = softmax(s), o = Σ_j p_j v_j.
/// Writes o into `o_row` and returns the logsumexp ln Σ_j exp(s_j).
fn plain_row(q_row: &[f32], head: &Head, shape: &AttentionShape, scale: f64, o_row: &mut [f64]) -> f64 {
    let d = shape.head_dim;
    let scores: Vec<f64> = head.k.chunks_exact(d).map(|k_row| scale * dot(q_row, k_row)).collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    o_row.fill(0.0);
    for (w, v_row) in weights.iter().zip(head.v.chunks_exact(d)) {
        for (o, &x) in o_row.iter_mut().zip(v_row) {
            *o += w / sum * x as f64;
        }
    }
    max + sum.ln()
}

/// Attention by the plain formula, O = softmax(Q Kᵀ · scale) V, every head (rows in parallel).
pub fn attention(q: &[f32], k: &[f32], v: &[f32], shape: &AttentionShape, scale: f64) -> Reference {
    let d = shape.head_dim;
    let mut o = vec![0.0; shape.query_rows() * d];
    let mut lse = vec![0.0; shape.query_rows()];
    o.par_chunks_mut(d).zip(lse.par_iter_mut()).enumerate().for_each(|(row, (o_row, lse_row))| {
        let head_index = row / shape.seqlen_q;
        let (b, h) = (head_index / shape.num_heads_q, head_index % shape.num_heads_q);
        let head = head(q, k, v, shape, b, h);
        let i = row % shape.seqlen_q;
        *lse_row = plain_row(&head.q[i * d..(i + 1) * d], &head, shape, scale, o_row);
    });
    Reference { o, lse }
}

/// The plain formula for a single head `(b, h)`: O `[seqlen_q, head_dim]` and LSE `[seqlen_q]`
/// of that head only. For checking a large problem on a few heads.
pub fn attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    scale: f64,
    b: usize,
    h: usize,
) -> Reference {
    let d = shape.head_dim;
    let head = head(q, k, v, shape, b, h);
    let mut o = vec![0.0; shape.seqlen_q * d];
    let mut lse = vec![0.0; shape.seqlen_q];
    o.par_chunks_mut(d).zip(lse.par_iter_mut()).zip(head.q.par_chunks(d)).for_each(|((o_row, lse_row), q_row)| {
        *lse_row = plain_row(q_row, &head, shape, scale, o_row);
    });
    Reference { o, lse }
}

/// FlashAttention-2's forward algorithm (Dao 2023, Algorithm 1) on the CPU, in `f64`: the same
/// tiling and online softmax as the GPU kernel, none of the thread bookkeeping.
///
/// For each block of `tile.block_m` query rows, key/value tiles of `tile.block_n` rows are
/// visited in order; per row the running maximum `m`, the running sum `l` of exp(s − m) and
/// the unnormalised output `acc` are updated:
///
/// ```text
/// m_new = max(m, max_j s_j)
/// acc   = acc · exp(m − m_new) + Σ_j exp(s_j − m_new) · v_j
/// l     = l   · exp(m − m_new) + Σ_j exp(s_j − m_new)
/// ```
///
/// and at the end O = acc / l, LSE = m + ln l. The result equals [`attention`] up to rounding.
pub fn flash_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    scale: f64,
    tile: TileConfig,
) -> Reference {
    let d = shape.head_dim;
    let mut o = vec![0.0; shape.query_rows() * d];
    let mut lse = vec![0.0; shape.query_rows()];
    // Work items: one query block of one head. A head's rows are contiguous in O and LSE, but
    // blocks at the end of a head may be short, so chunk per head first.
    o.par_chunks_mut(shape.seqlen_q * d).zip(lse.par_chunks_mut(shape.seqlen_q)).enumerate().for_each(
        |(head_index, (o_head, lse_head))| {
            let (b, h) = (head_index / shape.num_heads_q, head_index % shape.num_heads_q);
            let head = head(q, k, v, shape, b, h);
            o_head.par_chunks_mut(tile.block_m * d).zip(lse_head.par_chunks_mut(tile.block_m)).enumerate().for_each(
                |(block, (o_block, lse_block))| {
                    let q_block = &head.q[block * tile.block_m * d..][..o_block.len()];
                    flash_block(q_block, &head, shape, scale, tile.block_n, o_block, lse_block);
                },
            );
        },
    );
    Reference { o, lse }
}

/// One block of query rows against all key/value tiles; see [`flash_attention`].
fn flash_block(
    q_block: &[f32],
    head: &Head,
    shape: &AttentionShape,
    scale: f64,
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
    for (k_tile, v_tile) in head.k.chunks(block_n * d).zip(head.v.chunks(block_n * d)) {
        for i in 0..rows {
            let q_row = &q_block[i * d..(i + 1) * d];
            let s: Vec<f64> = k_tile.chunks_exact(d).map(|k_row| scale * dot(q_row, k_row)).collect();
            let m_new = s.iter().copied().fold(m[i], f64::max);
            let alpha = (m[i] - m_new).exp();
            let acc_row = &mut acc[i * d..(i + 1) * d];
            acc_row.iter_mut().for_each(|x| *x *= alpha);
            l[i] *= alpha;
            for (s_j, v_row) in s.iter().zip(v_tile.chunks_exact(d)) {
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
        acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x /= l[i]);
        lse_block[i] = m[i] + l[i].ln();
    }
}

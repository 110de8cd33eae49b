//! The online softmax (Milakov & Gimelshein 2018; FlashAttention-2, section 3.1), written once
//! per thread layout: per query row a running maximum `m` and a running sum `l` of
//! exponentials under it. Folding in a tile of scores `s` raises the maximum to
//! `m_new = max(m, max_j s_j)`, rescales what was accumulated by `alpha = 2^(m − m_new)` and adds
//! the tile's `Σ_j 2^(s_j − m_new)`; at the end O = acc / l and LSE = (m + log₂ l) · ln 2. Scores
//! are in base-2 units (multiplied by `scale · log₂e`), so the hardware's `exp2` does the work.
//!
//! * [`OnlineSoftmax`]: the `f32` kernels' 16 × 8 thread grid (levels 3): a thread holds `ROWS`
//!   rows and every 8th column of them; a row's maximum is combined over its 8 lanes.
//! * [`RowSoftmax`]: the m16n8 fragment layout (levels 5 and 8): a lane holds two rows (`g`,
//!   `g + 8`) and two of every 8 columns; a row's maximum is combined over 4 lanes.
//!
//! A row that has seen only masked (−∞) scores keeps `m = −∞`; measuring from 0 instead keeps
//! `2^(−∞ − (−∞)) = NaN` out, and such a row ends with O = 0 and LSE = −∞.
//!
//! Both end in [`finish_row`], where a head's attention sink (if the problem has sinks) joins
//! the sum.

use crate::hw::{self, FragC, LN_2};
use crate::layout::FLASH_THREAD_COLS as LANES;

// ANCHOR: online_softmax
/// Per-row state of the online softmax for the `ROWS` query rows of one thread.
pub struct OnlineSoftmax<const ROWS: usize> {
    /// Largest score seen so far (base-2 units), the same in every lane of the row group.
    max: [f32; ROWS],
    /// This lane's share of Σ 2^(s − max) over the columns it has seen.
    partial_sum: [f32; ROWS],
}

impl<const ROWS: usize> OnlineSoftmax<ROWS> {
    pub fn new() -> Self {
        Self { max: [f32::NEG_INFINITY; ROWS], partial_sum: [0.0; ROWS] }
    }

    /// Folds one tile of scores in: replaces each score by its unnormalised probability
    /// 2^(s − m_new) and returns, per row, the factor by which everything accumulated under the
    /// old maximum must be rescaled. Called by all lanes of the warp together (it shuffles).
    #[inline(always)]
    pub fn update<const COLS: usize>(&mut self, s: &mut [[f32; COLS]; ROWS]) -> [f32; ROWS] {
        let mut alpha = [0.0; ROWS];
        for i in 0..ROWS {
            let tile_max = hw::group_max::<LANES>(s[i].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
            let new_max = self.max[i].max(tile_max);
            // A row that has only seen masked (−∞) scores has no maximum yet; measuring from 0
            // instead keeps 2^(−∞ − (−∞)) = NaN out: its probabilities and alpha are all 0.
            let base = if new_max == f32::NEG_INFINITY { 0.0 } else { new_max };
            alpha[i] = hw::exp2(self.max[i] - base);
            let mut tile_sum = 0.0;
            for x in s[i].iter_mut() {
                *x = hw::exp2(*x - base);
                tile_sum += *x;
            }
            self.partial_sum[i] = self.partial_sum[i] * alpha[i] + tile_sum;
            self.max[i] = new_max;
        }
        alpha
    }

    /// Ends the pass: per row, the factor that normalises the output (1 / l) and the natural
    /// logsumexp LSE = ln Σ_j e^(scale·s_j) = (m + log₂ l) · ln 2, with the head's attention
    /// sink `sink` (base-2 units, −∞ for none) joining the sum ([`finish_row`]). A row that saw
    /// no key gets O = 0 and LSE = −∞ (or the sink's). Called by all lanes of the warp together
    /// (it shuffles).
    #[inline(always)]
    pub fn finish(&self, sink: f32) -> ([f32; ROWS], [f32; ROWS]) {
        let (mut inv_sum, mut lse) = ([0.0; ROWS], [0.0; ROWS]);
        for i in 0..ROWS {
            let sum = hw::group_sum::<LANES>(self.partial_sum[i]);
            (inv_sum[i], lse[i]) = finish_row(self.max[i], sum, sink);
        }
        (inv_sum, lse)
    }
}
// ANCHOR_END: online_softmax

/// Online-softmax state of the two rows a lane holds (rows `g` and `g + 8` of its warp).
pub struct RowSoftmax {
    /// Largest score seen so far (base-2 units), the same in the 4 lanes of a row.
    max: [f32; 2],
    /// This lane's share of Σ 2^(s − max) (its 2 columns of every 8).
    partial_sum: [f32; 2],
}

impl RowSoftmax {
    #[inline(always)]
    pub fn new() -> Self {
        Self { max: [f32::NEG_INFINITY; 2], partial_sum: [0.0; 2] }
    }

    /// Replaces the raw scores `s` of one tile by their unnormalised probabilities
    /// 2^(s·c − m_new), with `c` = scale·log₂e > 0, and returns, per row, the factor
    /// `alpha = 2^(m_old − m_new)` that rescales what was accumulated before. Fragment entries
    /// `0, 1` are row `g`, entries `2, 3` row `g + 8`. All lanes of the warp call it together (it
    /// shuffles).
    ///
    /// Because `c > 0`, the largest scaled score is `c` times the largest raw one, so the scale
    /// is applied once per row to the maximum and folded into one fused multiply-add per element
    /// (`s·c − m`), instead of a multiplication per element before the maximum.
    #[inline(always)]
    pub fn update<const N_TILES: usize>(&mut self, s: &mut [FragC; N_TILES], c: f32) -> [f32; 2] {
        let mut alpha = [0.0; 2];
        for r in 0..2 {
            // Four running maxima and sums instead of one: a single running value would chain
            // 2 · N_TILES dependent instructions, each waiting for the latency of the one before.
            let mut maxima = [f32::NEG_INFINITY; 4];
            for (i, frag) in s.iter().enumerate() {
                maxima[i % 4] = maxima[i % 4].max(frag[2 * r].max(frag[2 * r + 1]));
            }
            let tile_max = maxima[0].max(maxima[1]).max(maxima[2].max(maxima[3]));
            let new_max = self.max[r].max(hw::group_max::<4>(tile_max) * c);
            // A row that has seen only masked (−∞) scores measures from 0 instead, which keeps
            // 2^(−∞ − (−∞)) = NaN out: its probabilities and alpha are all 0.
            let base = if new_max == f32::NEG_INFINITY { 0.0 } else { new_max };
            alpha[r] = hw::exp2(self.max[r] - base);
            let mut sums = [0.0; 4];
            for (i, frag) in s.iter_mut().enumerate() {
                for x in &mut frag[2 * r..2 * r + 2] {
                    *x = hw::exp2(hw::fma(*x, c, -base));
                    sums[i % 4] += *x;
                }
            }
            let tile_sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
            self.partial_sum[r] = self.partial_sum[r] * alpha[r] + tile_sum;
            self.max[r] = new_max;
        }
        alpha
    }

    /// Per row: the factor that normalises O (1/l) and LSE = (m + log₂ l)·ln 2 (natural log),
    /// with the head's attention sink `sink` (base-2 units, −∞ for none) joining the sum
    /// ([`finish_row`]). A row that saw no key gets O = 0 and LSE = −∞ (or the sink's). All lanes
    /// of the warp call it together.
    #[inline(always)]
    pub fn finish(&self, sink: f32) -> ([f32; 2], [f32; 2]) {
        let (mut inv_sum, mut lse) = ([0.0; 2], [0.0; 2]);
        for r in 0..2 {
            let sum = hw::group_sum::<4>(self.partial_sum[r]);
            (inv_sum[r], lse[r]) = finish_row(self.max[r], sum, sink);
        }
        (inv_sum, lse)
    }
}

// ANCHOR: finish_row
/// The end of one row's softmax: from its maximum `max` and its sum `sum` = Σ_j 2^(y_j − max)
/// (base-2 scores `y`), the factor that turns the accumulated Σ_j 2^(y_j − max) v_j into O, and
/// the natural LSE.
///
/// `sink` is the head's *attention sink* in base-2 units (−∞: none): a logit with no value
/// vector that joins every row's softmax (Xiao et al. 2024, "Efficient Streaming Language
/// Models with Attention Sinks"; learned per head in GPT-OSS). It takes probability mass
/// without adding to O: over the keys and the sink, with `M = max(max, sink)`,
///
/// l = sum · 2^(max − M) + 2^(sink − M),   O = 2^(max − M) / l · Σ_j 2^(y_j − max) v_j,
/// LSE = (M + log₂ l) · ln 2.
///
/// Without a sink that is 1/sum and (max + log₂ sum)·ln 2. A row that saw no key (`max` = −∞,
/// `sum` = 0) gets O = 0 and LSE = −∞, or the sink's own logit. A row with a +∞ score has
/// LSE = +∞ ([`infinite_max_lse`]), and so has a +∞ sink (whose row gets O = 0).
#[inline(always)]
pub fn finish_row(max: f32, sum: f32, sink: f32) -> (f32, f32) {
    if sink == f32::NEG_INFINITY {
        return if sum > 0.0 {
            (1.0 / sum, infinite_max_lse(max, (max + hw::log2(sum)) * LN_2))
        } else {
            (0.0, infinite_max_lse(max, f32::NEG_INFINITY))
        };
    }
    let top = max.max(sink);
    // 2^(x − top), with x = top giving 1 even where both are +∞.
    let weight = |x: f32| if x == top { 1.0 } else { hw::exp2(x - top) };
    let keys = weight(max);
    let total = hw::fma(sum, keys, weight(sink));
    // total ≥ 1 here (the larger of max and sink contributes 1), or NaN.
    (keys / total, infinite_max_lse(top, (top + hw::log2(total)) * LN_2))
}
// ANCHOR_END: finish_row

/// A row with a +∞ score has LSE = ln Σ e^s = +∞, which the sum cannot say (its exponentials
/// measured from an infinite maximum are 2^(∞ − ∞) = NaN): `lse`, or +∞ where the row's maximum
/// is +∞. (O is NaN there, ∞/∞, as in the plain formula.)
#[inline(always)]
pub fn infinite_max_lse(max: f32, lse: f32) -> f32 {
    if max == f32::INFINITY { f32::INFINITY } else { lse }
}

impl<const ROWS: usize> Default for OnlineSoftmax<ROWS> {
    fn default() -> Self {
        Self::new()
    }
}

impl Default for RowSoftmax {
    fn default() -> Self {
        Self::new()
    }
}

/// The online softmax wants a positive factor c = scale·log₂e (see [`RowSoftmax::update`]): a
/// negative scale is applied as −Q with |c| (flipping the sign bits of the 16-bit Q values with
/// [`q_sign_mask`]), and a zero scale as the smallest normal float, which gives every finite
/// score the same weight, 2^(s·c) = 1 in f32, as a zero scale does. Returns c.
#[inline(always)]
pub fn positive_factor(scale_log2: f32) -> f32 {
    scale_log2.abs().max(f32::MIN_POSITIVE)
}

/// The mask to XOR into every pair of 16-bit Q values ([`crate::hw::Half2`]) so that Q becomes
/// −Q when the scale is negative (see [`positive_factor`]); 0 otherwise.
#[inline(always)]
pub fn q_sign_mask(scale_log2: f32) -> u32 {
    if scale_log2 < 0.0 { NEGATED_HALF2 } else { 0 }
}

/// The sign bits of both halves of a [`crate::hw::Half2`]: XOR-ing it negates both values.
pub const NEGATED_HALF2: u32 = 0x8000_8000;

// ANCHOR: lse_merge
/// Merging partial results by their logsumexp: the step that lets attention over one set of keys
/// be computed in parts (split-KV decoding, "Flash-Decoding", Dao et al. 2023; the warps of one
/// decoding block; later the GPUs of a ring). If part `i` saw keys `K_i` (disjoint sets) and
/// produced the normalised `O_i` and `LSE_i`, then over all the keys
///
/// LSE = ln Σ_i e^(LSE_i)   and   O = Σ_i e^(LSE_i − LSE) · O_i,
///
/// computed from `M = max_i LSE_i` as LSE = M + ln Σ_i e^(LSE_i − M), so that no exponential
/// overflows. A part that saw no key has LSE_i = −∞ and weight 0; if every part has, the merged
/// row has LSE = −∞ and O = 0, the empty-row convention.
///
/// `e^(LSE_i − reference)`: with `reference = M` a term of the sum, with `reference = LSE` the
/// weight of part `i`; 0 when `reference` is −∞ (no part saw a key), and 1 for the part that is
/// the reference itself even where both are +∞ (a row with a +∞ score, or a +∞ sink: its LSE
/// is then +∞, not the NaN of ∞ − ∞, as [`finish_row`] says).
#[inline(always)]
pub fn lse_weight(lse_part: f32, reference: f32) -> f32 {
    if reference == f32::NEG_INFINITY {
        0.0
    } else if lse_part == reference {
        1.0
    } else {
        hw::exp2((lse_part - reference) * hw::LOG2_E)
    }
}

/// The merged LSE from `max` = M and `sum` = Σ_i e^(LSE_i − M) (see [`lse_weight`]): M + ln sum,
/// or −∞ when no part saw a key (`sum` = 0).
#[inline(always)]
pub fn merged_lse(max: f32, sum: f32) -> f32 {
    if sum > 0.0 { max + hw::log2(sum) * LN_2 } else { f32::NEG_INFINITY }
}
// ANCHOR_END: lse_merge

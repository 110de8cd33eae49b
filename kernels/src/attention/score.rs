//! Score modifications: what happens to a score between the product Q·Kᵀ and the softmax, the
//! `score_mod` of FlexAttention (Dong et al. 2024), written once for every tier. The mask
//! ([`crate::attention::mask`]) says *which* scores count; a modification changes *what* they
//! are. Two are built in:
//!
//! | modification | logit of query `i`, key `j` (natural units) | models | backward |
//! |---|---|---|---|
//! | none | `ℓ = scale · q·k` | most | `∂ℓ/∂(q·k) = scale` |
//! | softcap (Gemma 2, Grok) | `ℓ = cap · tanh(scale · q·k / cap)` | Gemma 2 (cap 50), Grok (30) | `scale · (1 − tanh²)` |
//! | ALiBi (Press et al. 2022) | `ℓ = scale · q·k − slope_h · \|i + seqlen_k − seqlen_q − j\|` | BLOOM, MPT | `scale` (the bias is a constant) |
//!
//! ALiBi's distance is measured from the bottom-right diagonal, as FlashAttention-2 does, so
//! that a causal row's most recent key has bias 0 whatever the lengths; its slopes are the
//! paper's geometric sequence (section 3: for `n` heads, a power of two, `2^(−8/n · (h + 1))`;
//! otherwise BLOOM's interleaving of the next power of two's odd terms), with `8` the
//! configurable `max_bias` (MPT's `alibi_bias_max`).
//!
//! ## How the kernels use it
//!
//! Kernels compute the scores in base-2 units, `y = ℓ · log₂e`, because the softmax runs on
//! `exp2`. Without a modification they never form `y`: the scale is folded into the softmax's
//! fused multiply-add (`s·c − m`, [`crate::attention::softmax::RowSoftmax::update`]). With one,
//! the tile's raw products become `y` first ([`ScoreMod::apply_fragments`], [`ScoreMod::logit`]),
//! and the softmax runs with factor 1 ([`ScoreArgs::softmax_factor`]).
//!
//! The modifications are kernel arguments ([`ScoreArgs`]), not compiled instances of their own:
//! one entry per tile serves every modification. Inside it, the tensor-core kernels (levels
//! 5, 6, 8, 9) are written once, generic over `const MODS: bool`, and their entry calls one of two
//! copies according to [`ScoreArgs::is_active`]: the plain copy is the code the kernel had before
//! modifications existed (a test per tile, even one that is never taken, cost the sm_80
//! backward 8–10 %, PERFORMANCE.md, issue 24), the other is the same source with the
//! modification's lines in. The Hopper backward (level 9) goes one step further: its modified
//! copy is an entry of its own (`_mods`, which the host picks), because two copies in one kernel
//! share one register allocation, and the modified copy's spills cost the plain one 5–10 %
//! there. The `f32` kernels (levels 3, 4) and the naive scores test per tile and are not
//! duplicated. Band tables ([`crate::attention::mask::Mask::table`]) take the entry route on
//! the whole sm_80 path (levels 3–6): each kernel has a `_table` twin (`attention_kernel!`), and
//! the plain entry's copies never see a table.
//!
//! The backward recomputes `y` the same way. Softcapping changes the derivative: dS (the
//! gradient of the logits, `P ∘ (dP − D)`) is multiplied by `1 − tanh²`, which the kernels fold
//! into dP before dS is formed ([`ScoreMod::chain_rule`]) so that the dS code stays as it is.
//! The factor is computed from the capped logit itself (`tanh = y / (cap · log₂e)`), so nothing
//! extra stays in registers. Softcapping and ALiBi together would need the bias removed again
//! there; no model combines them and the host refuses it.

use crate::attention::fragment::FragmentLane;
use crate::hw::{self, FragC, LOG2_E};

/// The modifications as every attention kernel receives them (three of `attention_kernel!`'s
/// arguments): `softcap`, the cap (0: none), `alibi_max_bias`, the `max_bias` of ALiBi's
/// slopes (0: no ALiBi), and the attention sinks. The host checks them (finite, not negative,
/// not softcap and ALiBi at once; sinks of `[num_heads_q]`).
///
/// Kernels keep only these two across their loops and derive a head's [`ScoreMod`] inside the
/// branch that uses it, tile by tile ([`ScoreArgs::for_head`]): kernel arguments cost no
/// registers (the hardware reads them from a constant bank), derived values would, and the
/// Hopper kernels had none to spare (a `ScoreMod` held across the loop spilled).
#[derive(Clone, Copy)]
pub struct ScoreArgs {
    pub softcap: f32,
    pub alibi_max_bias: f32,
    /// The attention sinks, one natural-log logit per query head (`f32`, `[num_heads_q]`), or
    /// null. Not a change of the scores: a sink joins the softmax's sum at the end of a row
    /// ([`crate::attention::softmax::finish_row`]), so it takes no part in [`Self::is_active`].
    pub sinks: *const f32,
    /// An additive bias in natural units (`f32`, each (batch entry, head) a row-major
    /// `seqlen_q × seqlen_k` plane), or null: see [`BiasPlane`].
    pub bias: *const f32,
    /// Its gradient dBias, the same layout, which the backward's K/V-outer kernels add dS to
    /// (zeroed by the host first), or null (forward passes, or no bias).
    pub bias_grad: *mut f32,
    /// Elements from one batch entry's bias plane to the next: 0 for a bias shared by the batch.
    pub bias_batch_stride: usize,
    /// Elements from one query head's bias plane to the next: 0 for a bias shared by the heads.
    pub bias_head_stride: usize,
}

impl ScoreArgs {
    /// A softcap, ALiBi and sinks without a bias: the decoder's (level 10), which takes no bias.
    #[inline(always)]
    pub fn without_bias(softcap: f32, alibi_max_bias: f32, sinks: *const f32) -> Self {
        Self {
            softcap,
            alibi_max_bias,
            sinks,
            bias: core::ptr::null(),
            bias_grad: core::ptr::null_mut(),
            bias_batch_stride: 0,
            bias_head_stride: 0,
        }
    }

    /// Whether the scores are modified at all. The same for every thread of a launch: kernels
    /// branch on it once per tile.
    #[inline(always)]
    pub fn is_active(self) -> bool {
        self.softcap != 0.0 || self.alibi_max_bias != 0.0 || self.has_bias()
    }

    /// Whether the problem has an additive bias ([`BiasPlane`]). Only the sm_80 modules' flash
    /// kernels (levels 3–6) read it; the host sends a problem with a bias there.
    #[inline(always)]
    pub fn has_bias(self) -> bool {
        !self.bias.is_null()
    }

    /// The bias plane of batch entry `batch` and query head `head` (and its gradient's, in a
    /// backward pass), for sequences of `seqlen_q` queries and `seqlen_k` keys: null pointers
    /// when the problem has no bias.
    #[inline(always)]
    pub fn bias_plane(self, batch: usize, head: usize, seqlen_q: usize, seqlen_k: usize) -> BiasPlane {
        let offset = batch * self.bias_batch_stride + head * self.bias_head_stride;
        let at = |base: *mut f32| if base.is_null() { base } else { base.wrapping_add(offset) };
        BiasPlane { values: at(self.bias.cast_mut()).cast_const(), grads: at(self.bias_grad), seqlen_q, seqlen_k }
    }

    /// Whether the problem has attention sinks. The tensor-core forwards keep a copy of their
    /// body for sinks alone (`SINKS` without `MODS`), so that neither the plain copy nor the
    /// sinks' pays for the other (a sink read in the plain copy made the Hopper forward spill).
    #[inline(always)]
    pub fn has_sinks(self) -> bool {
        !self.sinks.is_null()
    }

    /// Whether the logits are softcapped (the backward's chain rule then has a factor).
    #[inline(always)]
    pub fn is_softcapped(self) -> bool {
        self.softcap != 0.0
    }

    /// The factor the softmax multiplies scores by: `c` (= scale · log₂e) for raw products, 1
    /// for scores that [`ScoreMod::apply_fragments`] or [`ScoreMod::logit`] already turned into
    /// base-2 logits.
    #[inline(always)]
    pub fn softmax_factor(self, c: f32) -> f32 {
        if self.is_active() { 1.0 } else { c }
    }

    /// The attention sink of query head `head` in base-2 units (`sink · log₂e`), or −∞ when the
    /// problem has none: the `sink` of [`crate::attention::softmax::finish_row`].
    ///
    /// # Safety
    /// `sinks` is null or holds `head + 1` floats (the host checks `[num_heads_q]`).
    #[inline(always)]
    pub unsafe fn sink(self, head: usize) -> f32 {
        if self.sinks.is_null() { f32::NEG_INFINITY } else { unsafe { *self.sinks.add(head) * LOG2_E } }
    }

    /// The attention sink of query head `head` in natural units, or −∞ without sinks: where a
    /// sink joins a merge of partial results by their LSE as one more part, an LSE with no O
    /// ([`crate::attention::softmax::lse_weight`]; the KV-cache decoder's).
    ///
    /// # Safety
    /// As [`Self::sink`].
    #[inline(always)]
    pub unsafe fn natural_sink(self, head: usize) -> f32 {
        if self.sinks.is_null() { f32::NEG_INFINITY } else { unsafe { *self.sinks.add(head) } }
    }

    /// The modification of query head `head` of `num_heads` (ALiBi's slope depends on the
    /// head) for sequences of `seqlen_q` queries and `seqlen_k` keys. Recomputed at every call:
    /// the arguments pass through [`hw::opaque`], so that the compiler cannot hoist the
    /// derived values out of a kernel's loop into registers held across it.
    #[inline(always)]
    pub fn for_head(self, head: usize, num_heads: usize, seqlen_q: usize, seqlen_k: usize) -> ScoreMod {
        let softcap = f32::from_bits(hw::opaque(self.softcap.to_bits()));
        let max_bias = f32::from_bits(hw::opaque(self.alibi_max_bias.to_bits()));
        let cap = softcap * LOG2_E;
        ScoreMod {
            cap,
            inv_cap: if cap > 0.0 { hw::reciprocal(cap) } else { 0.0 },
            slope: if max_bias > 0.0 { alibi_slope(max_bias, head, num_heads) * LOG2_E } else { 0.0 },
            offset: seqlen_k as isize - seqlen_q as isize,
        }
    }
}

/// ALiBi's slope of head `head` of `num_heads` (Press et al. 2022, section 3; BLOOM's
/// completion for head counts that are not powers of two): with `n` the largest power of two
/// at most `num_heads`, heads `h < n` get `2^(−max_bias · (h + 1) / n)` and the others the odd
/// terms of the sequence for `2n`, `2^(−max_bias · (2(h − n) + 1) / (2n))`.
#[inline(always)]
pub fn alibi_slope(max_bias: f32, head: usize, num_heads: usize) -> f32 {
    let n = 1usize << (usize::BITS - 1 - num_heads.max(1).leading_zeros());
    let exponent = if head < n { (head + 1) as f32 / n as f32 } else { (2 * (head - n) + 1) as f32 / (2 * n) as f32 };
    hw::exp2(-max_bias * exponent)
}

// ANCHOR: score_mod
/// One head's score modification, in base-2 units (see the module docs).
#[derive(Clone, Copy)]
pub struct ScoreMod {
    /// `cap · log₂e`; 0 without softcapping.
    cap: f32,
    /// `1 / (cap · log₂e)`; 0 without softcapping.
    inv_cap: f32,
    /// `slope · log₂e` of this head; 0 without ALiBi.
    slope: f32,
    /// `seqlen_k − seqlen_q`: query `i`'s diagonal key is `i + offset`.
    offset: isize,
}

impl ScoreMod {
    /// Whether the logits are softcapped.
    #[inline(always)]
    pub fn is_softcapped(&self) -> bool {
        self.cap != 0.0
    }

    /// The base-2 logit of query `query` and key `key` from `y = scale · q·k · log₂e`:
    /// `cap · tanh(y / cap)` with softcapping, `y − slope · |query + offset − key|` with ALiBi.
    #[inline(always)]
    pub fn logit(&self, y: f32, query: usize, key: usize) -> f32 {
        if self.is_softcapped() {
            self.cap * hw::tanh(y * self.inv_cap)
        } else {
            hw::fma(-self.slope, self.distance(query, key), y)
        }
    }

    /// `|query + offset − key|`, ALiBi's distance, as a float.
    #[inline(always)]
    fn distance(&self, query: usize, key: usize) -> f32 {
        (query as isize + self.offset - key as isize).unsigned_abs() as f32
    }

    /// Turns the raw products in `frags` into base-2 logits ([`Self::logit`] of `frag · c`).
    /// Entries map to (row, column) as in [`crate::attention::fragment::mask_fragments`]: rows
    /// from `first_row`, columns from `first_col`, a query and a key, or with `TRANSPOSED` (Sᵀ =
    /// K·Qᵀ) a key and a query.
    ///
    /// Written for few instructions: the softcap's constants are folded so that an entry costs
    /// one special-function instruction (`exp2`, the unit the softmax's own exponentials keep
    /// busy) and about ten on the FMA units; ALiBi's distance is the lane's per-row base, in `f32`
    /// (exact below 2²⁴), plus the entry's column in the tile, a constant once unrolled.
    #[inline(always)]
    pub fn apply_fragments<const N: usize, const TRANSPOSED: bool>(
        &self,
        frags: &mut [FragC; N],
        lane: FragmentLane,
        (first_row, first_col): (usize, usize),
        c: f32,
    ) {
        if self.is_softcapped() {
            // cap · tanh(x·c / cap) = cap − 2·cap / (2^(x · 2c·log₂e / cap) + 1), as `hw::tanh`
            // computes it (the exponent capped at 64, the reciprocal on the FMA units).
            let to_exponent = c * self.inv_cap * (2.0 * LOG2_E);
            let twice_cap = 2.0 * self.cap;
            for frag in frags.iter_mut() {
                for x in frag.iter_mut() {
                    let exponent = *x * to_exponent;
                    let exponent = if exponent > 64.0 { 64.0 } else { exponent };
                    let r = hw::reciprocal_of_at_least_one(hw::exp2(exponent) + 1.0);
                    *x = hw::fma(-twice_cap, r, self.cap);
                }
            }
            return;
        }
        // The distance query + offset − key of entry (nt, e) is `base[h] ± (8nt + e % 2)`, `h`
        // its row half: non-transposed, row `h` is a query and the column a key (minus); with
        // `TRANSPOSED`, row `h` is a key and the column a query (plus).
        let lane_col = (first_col + lane.pair_col()) as isize;
        let base: [f32; 2] = core::array::from_fn(|h| {
            let row = (first_row + lane.half_row(h)) as isize;
            (if TRANSPOSED { lane_col + self.offset - row } else { row + self.offset - lane_col }) as f32
        });
        for nt in 0..N {
            for e in 0..4 {
                let column = (8 * nt + e % 2) as f32;
                let distance = if TRANSPOSED { base[e / 2] + column } else { base[e / 2] - column };
                frags[nt][e] = hw::fma(-self.slope, distance.abs(), frags[nt][e] * c);
            }
        }
    }

    /// [`Self::logit`] of every entry of `frags` (raw products `x`, the logit of `x · c`), for a
    /// kernel whose lanes' two rows belong to heads and queries of their own (the decoder's
    /// packed rows, the query heads of a GQA group side by side): row half `h` of the lane is
    /// query `query[h]` of the head whose modification is `mods[h]`; the columns are keys
    /// `first_col + 8nt + 0..8`. Entry by entry: the decoder is bound by memory, not by these.
    #[inline(always)]
    pub fn apply_fragments_by_row<const N: usize>(
        mods: &[ScoreMod; 2],
        frags: &mut [FragC; N],
        lane: FragmentLane,
        query: [usize; 2],
        first_col: usize,
        c: f32,
    ) {
        for (nt, frag) in frags.iter_mut().enumerate() {
            for (e, x) in frag.iter_mut().enumerate() {
                *x = mods[e / 2].logit(*x * c, query[e / 2], first_col + 8 * nt + lane.col(e));
            }
        }
    }

    /// `∂ℓ/∂(scale · q·k)` at the base-2 logit `logit`: `1 − tanh²` with softcapping
    /// (`tanh = logit / (cap · log₂e)`), else 1.
    #[inline(always)]
    pub fn derivative(&self, logit: f32) -> f32 {
        let t = logit * self.inv_cap;
        hw::fma(-t, t, 1.0)
    }

    /// dP for the softcap's chain rule: `(dP − D) · (1 − tanh²) + D`, so that the unchanged
    /// `dS = P ∘ (dP − D)` that follows is the gradient of the capped scores' inputs (see the
    /// module docs). Only called when the logits are softcapped.
    #[inline(always)]
    pub fn chain_rule(&self, logit: f32, dp: f32, delta: f32) -> f32 {
        hw::fma(dp - delta, self.derivative(logit), delta)
    }

    /// [`Self::chain_rule`] on fragments: `dp` entry by entry from `logits`, with `delta(nt,
    /// e)` the D of the entry's query.
    #[inline(always)]
    pub fn chain_rule_fragments<const N: usize>(
        &self,
        logits: &[FragC; N],
        dp: &mut [FragC; N],
        delta: impl Fn(usize, usize) -> f32,
    ) {
        for nt in 0..N {
            for e in 0..4 {
                dp[nt][e] = self.chain_rule(logits[nt][e], dp[nt][e], delta(nt, e));
            }
        }
    }
}
// ANCHOR_END: score_mod

// ANCHOR: bias_plane
/// One (batch entry, query head)'s plane of an additive bias, `bias[query][key]` in natural
/// units, added to the logit before the softmax: `ℓ = scale · q·k + bias` (ALiBi's term, if
/// any, too). It is how Swin's relative position bias and T5's bucketed bias reach the
/// kernels, and PyTorch's float `attn_mask`. Because the bias enters the logit with factor 1,
/// its gradient is the logit's: dBias = dS = P ∘ (dP − D), which the backward's K/V-outer
/// kernels add into `grads` entry by entry (an atomic add: a bias shared by batch entries or
/// heads sums their dS). A −∞ entry hides its key from that query, as a mask would.
///
/// The kernels read it from global memory in their modified copies ([`ScoreArgs::is_active`]);
/// a tile's entries past the sequences write nothing and read a clamped entry that counts as 0
/// ([`BiasPlane::add_to_fragments`]).
#[derive(Clone, Copy)]
pub struct BiasPlane {
    values: *const f32,
    grads: *mut f32,
    seqlen_q: usize,
    seqlen_k: usize,
}

impl BiasPlane {
    /// The entry's place in the plane, or `None` outside the sequences or without a bias.
    #[inline(always)]
    fn index(&self, query: usize, key: usize) -> Option<usize> {
        (!self.values.is_null() && query < self.seqlen_q && key < self.seqlen_k).then(|| query * self.seqlen_k + key)
    }

    /// The (query, key) of entry `e` of n-tile `nt` in fragments that start at `first`
    /// ([`FragmentLane::place`]): rows are queries and columns keys, or with `TRANSPOSED` rows
    /// are keys and columns queries (the backward's Sᵀ).
    #[inline(always)]
    fn query_key<const TRANSPOSED: bool>(
        lane: FragmentLane,
        first: (usize, usize),
        nt: usize,
        e: usize,
    ) -> (usize, usize) {
        let (row, col) = lane.place(first, nt, e);
        if TRANSPOSED { (col, row) } else { (row, col) }
    }

    /// `bias[query][key] · log₂e`, the bias in the kernels' base-2 units; 0 outside the
    /// sequences or without a bias.
    ///
    /// # Safety
    /// The plane holds `seqlen_q × seqlen_k` floats (the host checks the bias's shape).
    #[inline(always)]
    pub unsafe fn logit(&self, query: usize, key: usize) -> f32 {
        match self.index(query, key) {
            // SAFETY: the caller's contract; the index is inside the plane.
            Some(i) => unsafe { *self.values.add(i) * LOG2_E },
            None => 0.0,
        }
    }

    /// Adds the bias of the entries of `N` fragments, in base-2 units ([`Self::logit`]), to the
    /// logits `frags`. Entries map to (row, column) as in [`ScoreMod::apply_fragments`]: a
    /// query and a key, or with `TRANSPOSED` a key and a query. Entries outside the sequences
    /// (a tile's padding) get 0, and nothing is added without a bias.
    ///
    /// No read is behind a branch: an entry outside the sequences reads the nearest entry
    /// inside (its row and column clamped) and adds 0. So the reads are independent and can all
    /// be in flight at once; with a branch per entry, each waited for the one before it, and the
    /// forward ran 14 times slower with a bias than without at [4, 16, 4096, 64]
    /// (PERFORMANCE.md, "a bias read without branches"). Kernels call it where they add the
    /// values: values read earlier hold registers across the products, which the kernels spilled.
    ///
    /// # Safety
    /// As [`Self::logit`].
    #[inline(always)]
    pub unsafe fn add_to_fragments<const N: usize, const TRANSPOSED: bool>(
        &self,
        frags: &mut [FragC; N],
        lane: FragmentLane,
        first: (usize, usize),
    ) {
        if self.values.is_null() {
            return;
        }
        let (last_query, last_key) = (self.seqlen_q.max(1) - 1, self.seqlen_k.max(1) - 1);
        for nt in 0..N {
            for e in 0..4 {
                let (query, key) = Self::query_key::<TRANSPOSED>(lane, first, nt, e);
                let i = query.min(last_query) * self.seqlen_k + key.min(last_key);
                // SAFETY: the caller's contract; the clamped index is inside the plane.
                let value = unsafe { *self.values.add(i) } * LOG2_E;
                // `&`, not `&&`, and the product taken before the choice: with a short-circuit
                // test LLVM may keep an `if` here and sink the read into it, which puts every
                // read behind a branch again (the host test `bias_reads_are_not_behind_a_branch_each`).
                let inside = (query < self.seqlen_q) & (key < self.seqlen_k);
                frags[nt][e] += if inside { value } else { 0.0 };
            }
        }
    }

    /// Adds `ds`, the gradient of query `query`'s logit of key `key`, to dBias. Zeros are
    /// skipped (hidden entries, whose dBias stays the host's zero).
    ///
    /// # Safety
    /// The gradient plane, if any, holds `seqlen_q × seqlen_k` floats.
    #[inline(always)]
    pub unsafe fn accumulate(&self, query: usize, key: usize, ds: f32) {
        if let Some(i) = self.index(query, key)
            && !self.grads.is_null()
            && ds != 0.0
        {
            // SAFETY: the caller's contract; the index is inside the plane.
            unsafe { hw::atomic_add(self.grads.add(i), ds) };
        }
    }

    /// [`Self::accumulate`] for every entry of the dS fragments `ds`, mapped as in
    /// [`Self::add_to_fragments`].
    ///
    /// # Safety
    /// As [`Self::accumulate`].
    #[inline(always)]
    pub unsafe fn accumulate_fragments<const N: usize, const TRANSPOSED: bool>(
        &self,
        ds: &[FragC; N],
        lane: FragmentLane,
        first: (usize, usize),
    ) {
        for nt in 0..N {
            for e in 0..4 {
                let (query, key) = Self::query_key::<TRANSPOSED>(lane, first, nt, e);
                // SAFETY: the caller's contract.
                unsafe { self.accumulate(query, key, ds[nt][e]) };
            }
        }
    }
}

/// Sets to 0 the probabilities `p` of entries whose logit `s` is −∞ (a bias's hidden
/// entries). The backward recomputes P as `2^(s − LSE)`, which for a row whose every logit is
/// −∞ (LSE = −∞) would be `2^NaN`; masks zero their hidden entries after the exponential in
/// the same way.
#[inline(always)]
pub fn zero_hidden<const R: usize, const C: usize>(p: &mut [[f32; C]; R], s: &[[f32; C]; R]) {
    for i in 0..R {
        for j in 0..C {
            if s[i][j] == f32::NEG_INFINITY {
                p[i][j] = 0.0;
            }
        }
    }
}
// ANCHOR_END: bias_plane

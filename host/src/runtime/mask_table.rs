//! **Runtime layer.** Masks given per token — document masks, prefix-LM — as band tables on a
//! device ([`MaskTable`]), made by the [`Context`]'s constructors from what a data loader has:
//! per-token document ids, `cu_seqlens`, prefix lengths.
//!
//! Each of these masks lets query `i` see one contiguous band of keys, `start(i) ≤ j <
//! limit(i)`, whose ends never decrease along the sequence — the shape of mask the kernels
//! skip tiles for (`attention::mask` in the device crate). The table holds, per batch entry,
//! that band for every query and, derived from the same bands, the band of queries that see
//! each key (what the backward's key blocks need); the kernels intersect both with the causal
//! mask and the window of the call.

use super::context::Context;
use super::tensor::{DeviceTensor, Storage};
use crate::error::{Error, Result};
use crate::problem::{Causal, MaskTableKind, MaskTableRef, SlidingWindow, table_gap, table_words, varlen_bands};

/// A mask given per token, on the device of the [`Context`] that made it: a document mask
/// ([`Context::document_mask`], [`Context::document_mask_from_cu_seqlens`]), prefix-LM
/// ([`Context::prefix_lm_mask`]) or a packed batch of sequences whose queries and keys differ in
/// length ([`Context::varlen_mask`]). Given to [`AttentionOptions::with_mask_table`], which
/// borrows it, for problems of the `[batch, seqlen_q, seqlen_k]` it was made for ([`MaskTable::dims`]);
/// one table serves every layer and both passes.
///
/// [`AttentionOptions::with_mask_table`]: crate::AttentionOptions::with_mask_table
pub struct MaskTable {
    /// `[batch, seqlen_q + seqlen_k, 2]` `(start, end)` pairs (`Mask::table`'s layout).
    device: DeviceTensor<i32>,
    /// The same words on the host, for the CPU references and the flop counts.
    words: Vec<u32>,
    dims: [usize; 3],
    kind: MaskTableKind,
    /// [`MaskTableRef`]'s `gapped`.
    gapped: bool,
}

impl std::fmt::Debug for MaskTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MaskTable({}, [batch, seqlen_q, seqlen_k] = {:?})", self.kind, self.dims)
    }
}

impl MaskTable {
    /// Whether query `query` of batch entry `batch` may see key `key` by the table alone.
    pub fn visible(&self, batch: usize, query: usize, key: usize) -> bool {
        MaskTableRef::from(self).visible(batch, query, key)
    }

    /// `[batch, seqlen_q, seqlen_k]` of the problems the table masks.
    pub fn dims(&self) -> [usize; 3] {
        self.dims
    }

    /// What the table masks.
    pub fn kind(&self) -> MaskTableKind {
        self.kind
    }
}

/// Checks `cu_seqlens` (named `name` in messages): not empty, starting at 0, never decreasing.
fn check_cu_seqlens(name: &str, cu_seqlens: &[i32]) -> Result<()> {
    if cu_seqlens.first() != Some(&0) {
        return Err(Error::MaskTable(format!("{name} must start at 0; got {:?}", cu_seqlens.first())));
    }
    if let Some(d) = cu_seqlens.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::MaskTable(format!(
            "{name} must not decrease; entry {} is {} after {}",
            d + 1,
            cu_seqlens[d + 1],
            cu_seqlens[d]
        )));
    }
    Ok(())
}

/// Refuses a row longer than a table's `i32` entries hold, before any band is built.
fn check_seqlen(seqlen: usize) -> Result<()> {
    if seqlen > i32::MAX as usize {
        return Err(Error::MaskTable(format!("seqlen = {seqlen} is more than a table holds (i32::MAX)")));
    }
    Ok(())
}

/// The table as the options borrow it.
impl<'a> From<&'a MaskTable> for MaskTableRef<'a> {
    fn from(table: &'a MaskTable) -> Self {
        let address = match table.device.storage() {
            Storage::Cuda(slice) => cudarc::driver::DevicePtr::device_ptr(slice, slice.stream()).0,
            Storage::Host(buffer) => buffer.as_ptr() as u64,
        };
        let (owner, dims, words, kind, gapped) =
            (table.device.owner(), table.dims, &table.words, table.kind, table.gapped);
        Self { address, owner, dims, words, kind, gapped }
    }
}

impl Context {
    /// A document mask (packed sequences: several documents end to end in one row, each token
    /// seeing only the tokens of its own document), from per-token document ids: `document_ids`
    /// is `[batch, seqlen]`, row-major, and a document is a run of consecutive tokens with the
    /// same id. Combine it with [`Causal::TopLeft`](crate::Causal::TopLeft) for causal language
    /// models: each document is then causal on its own.
    ///
    /// # Errors
    /// [`Error::MaskTable`] when `document_ids` does not hold `batch · seqlen` ids, when an id
    /// comes back in a row after another document (documents must be contiguous), or when
    /// `seqlen` exceeds `i32::MAX`; errors of the upload.
    pub fn document_mask(&self, document_ids: &[i32], [batch, seqlen]: [usize; 2]) -> Result<MaskTable> {
        check_seqlen(seqlen)?;
        if Some(document_ids.len()) != batch.checked_mul(seqlen) {
            return Err(Error::MaskTable(format!(
                "{} document ids for [batch, seqlen] = [{batch}, {seqlen}]",
                document_ids.len()
            )));
        }
        let mut bands = Vec::with_capacity(document_ids.len());
        for (b, row) in document_ids.chunks(seqlen.max(1)).enumerate().take(batch) {
            let mut finished = std::collections::HashSet::new();
            let mut start = 0;
            while start < row.len() {
                let id = row[start];
                let end = start + row[start..].iter().take_while(|&&x| x == id).count();
                if !finished.insert(id) {
                    return Err(Error::MaskTable(format!(
                        "document id {id} comes back at token {start} of batch entry {b} after another document; \
                         a document's tokens must be consecutive"
                    )));
                }
                bands.extend(std::iter::repeat_n((start, end), end - start));
                start = end;
            }
        }
        self.mask_table(bands, [batch, seqlen, seqlen], MaskTableKind::Documents)
    }

    /// A document mask for one packed row (`batch` = 1) from `cu_seqlens`, FlashAttention's
    /// variable-length convention: document `d` holds tokens `cu_seqlens[d] .. cu_seqlens[d +
    /// 1]`, and the row exactly `cu_seqlens.last()` tokens (a row padded past its last document
    /// needs one more entry, the padding as a document of its own). See
    /// [`Context::document_mask`].
    ///
    /// # Errors
    /// [`Error::MaskTable`] when `cu_seqlens` is empty, does not start at 0 or decreases;
    /// errors of the upload.
    pub fn document_mask_from_cu_seqlens(&self, cu_seqlens: &[i32]) -> Result<MaskTable> {
        check_cu_seqlens("cu_seqlens", cu_seqlens)?;
        let bands = cu_seqlens
            .windows(2)
            .flat_map(|w| {
                let (start, end) = (w[0] as usize, w[1] as usize);
                std::iter::repeat_n((start, end), end - start)
            })
            .collect::<Vec<_>>();
        let seqlen = bands.len();
        self.mask_table(bands, [1, seqlen, seqlen], MaskTableKind::Documents)
    }

    /// A packed batch of sequences whose queries and keys differ in length (FlashAttention's
    /// `flash_attn_varlen_func` with its `cu_seqlens_q` and `cu_seqlens_k`): sequence `s` holds
    /// queries `cu_seqlens_q[s] .. cu_seqlens_q[s + 1]` and keys `cu_seqlens_k[s] ..
    /// cu_seqlens_k[s + 1]` of one packed row, its queries see only its keys, and `causal` and
    /// `window` apply to each sequence on its own lengths, as [`Causal`] and [`SlidingWindow`]
    /// define them for a problem of those lengths (`Causal::BottomRight`, FlashAttention's
    /// alignment, lets a sequence's last query see all of its keys). For chunked prefill (each
    /// sequence's new queries against its cached keys and themselves) and cross-attention over
    /// ragged batches; with equal lengths it is [`Context::document_mask_from_cu_seqlens`] with
    /// the mask applied per document.
    ///
    /// The table is `[1, total_q, total_k]` (`total_q = cu_seqlens_q.last()`): give it, through
    /// [`AttentionOptions::with_mask_table`](crate::AttentionOptions::with_mask_table), to a
    /// problem of batch 1 with Q `[1, Hq, total_q, D]` and K, V `[1, Hkv, total_k, D]`, with no
    /// causal mask, window or ALiBi of the call's own (those would be aligned to the packed row,
    /// not to each sequence; the calls refuse them). A query that sees no key follows the
    /// empty-row convention.
    ///
    /// Keys that no query sees (a window's older keys, a sequence with keys but no queries) and
    /// queries that see no key are correct everywhere, but where they lie between two sequences
    /// (a *gap*) they are not free: a block of queries takes its keys as one range, from its
    /// first row's start to its last row's limit, so a query tile that straddles the gap masks
    /// every key tile inside it rather than skipping it. And a deterministic backward with a
    /// varlen table runs the sm_80 kernels: the Hopper kernel's key blocks take turns on each
    /// query tile, a block that reaches none of a tile (a gap) would never take its turn, and
    /// where there is no gap the turns of a sequence with more key blocks than query tiles
    /// queue (1.2–2.2× slower on the H200: PERFORMANCE.md, 2026-12-03, "deterministic varlen").
    ///
    /// # Errors
    /// [`Error::MaskTable`] when the two lists differ in length, one is empty, does not start at
    /// 0 or decreases; errors of the upload.
    pub fn varlen_mask(
        &self,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        causal: Causal,
        window: Option<SlidingWindow>,
    ) -> Result<MaskTable> {
        self.varlen_mask_repeated(cu_seqlens_q, cu_seqlens_k, causal, window, 1)
    }

    /// [`Context::varlen_mask`] repeated for `batch` batch entries (`[batch, total_q, total_k]`):
    /// the command line's `--documents-k`, which cuts every batch entry's row alike.
    pub(crate) fn varlen_mask_repeated(
        &self,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        causal: Causal,
        window: Option<SlidingWindow>,
        batch: usize,
    ) -> Result<MaskTable> {
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)?;
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)?;
        if cu_seqlens_q.len() != cu_seqlens_k.len() {
            return Err(Error::MaskTable(format!(
                "cu_seqlens_q has {} entries and cu_seqlens_k {}; both are the batch + 1 offsets of the same sequences",
                cu_seqlens_q.len(),
                cu_seqlens_k.len()
            )));
        }
        let to_usize = |cu: &[i32]| cu.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let (cu_q, cu_k) = (to_usize(cu_seqlens_q), to_usize(cu_seqlens_k));
        let (total_q, total_k) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
        // Every batch entry's table is the same words: build one and repeat it.
        let bands = varlen_bands(&cu_q, &cu_k, causal, window);
        let words = table_words(&bands, 1, total_q, total_k).repeat(batch);
        self.upload_table(words, [batch, total_q, total_k], MaskTableKind::Varlen)
    }

    /// Prefix-LM (Raffel et al. 2020, T5's "prefix LM"; Wang et al. 2022): the first
    /// `prefix_lengths[b]` tokens of batch entry `b` see each other in both directions, every
    /// later token sees the prefix and the tokens before it (causal). `batch` is
    /// `prefix_lengths.len()`. It is a causal mask of its own: give it without [`Causal`], or
    /// the causal mask hides the prefix's keys from the prefix's earlier queries again.
    ///
    /// [`Causal`]: crate::Causal
    ///
    /// # Errors
    /// [`Error::MaskTable`] when a prefix is longer than `seqlen`, or `seqlen` exceeds
    /// `i32::MAX`; errors of the upload.
    pub fn prefix_lm_mask(&self, prefix_lengths: &[usize], seqlen: usize) -> Result<MaskTable> {
        check_seqlen(seqlen)?;
        if let Some((b, &p)) = prefix_lengths.iter().enumerate().find(|&(_, &p)| p > seqlen) {
            return Err(Error::MaskTable(format!(
                "the prefix of batch entry {b} has {p} tokens, more than seqlen = {seqlen}"
            )));
        }
        let bands =
            prefix_lengths.iter().flat_map(|&p| (0..seqlen).map(move |i| (0, (i + 1).max(p)))).collect::<Vec<_>>();
        self.mask_table(bands, [prefix_lengths.len(), seqlen, seqlen], MaskTableKind::PrefixLm)
    }

    /// The table of per-query key bands `bands` (`[batch, seqlen_q]`, each `(start, limit)`, both
    /// non-decreasing along a row), uploaded.
    fn mask_table(
        &self,
        bands: Vec<(usize, usize)>,
        [batch, seqlen_q, seqlen_k]: [usize; 3],
        kind: MaskTableKind,
    ) -> Result<MaskTable> {
        check_seqlen(seqlen_q.max(seqlen_k))?;
        self.upload_table(table_words(&bands, batch, seqlen_q, seqlen_k), [batch, seqlen_q, seqlen_k], kind)
    }

    /// A table's words ([`table_words`]), uploaded.
    fn upload_table(&self, words: Vec<u32>, dims: [usize; 3], kind: MaskTableKind) -> Result<MaskTable> {
        let [batch, seqlen_q, seqlen_k] = dims;
        let signed: Vec<i32> = words.iter().map(|&w| w as i32).collect();
        let device = self.upload(&signed, &[batch, seqlen_q + seqlen_k, 2])?;
        let gapped = table_gap(&words, seqlen_q, seqlen_k).is_some();
        Ok(MaskTable { device, words, dims, kind, gapped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key pairs describe the same visible pairs as the query pairs, for documents (with an
    /// empty one) and prefix-LM.
    #[test]
    fn key_bands_are_the_query_bands_transposed() {
        let docs = [(0, 3), (0, 3), (0, 3), (3, 4), (4, 9), (4, 9), (4, 9), (4, 9), (4, 9)];
        let prefix: Vec<_> = (0..9).map(|i| (0, (i + 1).max(4))).collect();
        for bands in [&docs[..], &prefix] {
            let words = table_words(bands, 1, 9, 9);
            for q in 0..9 {
                for k in 0..9 {
                    let by_query = words[2 * q] as usize <= k && k < words[2 * q + 1] as usize;
                    let by_key = words[18 + 2 * k] as usize <= q && q < words[18 + 2 * k + 1] as usize;
                    assert_eq!(by_query, by_key, "query {q}, key {k}: {bands:?}");
                }
            }
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let ctx = Context::cpu_emulated();
        let err = |r: Result<MaskTable>| matches!(r, Err(Error::MaskTable(_)));
        assert!(err(ctx.document_mask(&[1, 1, 2], [2, 2])));
        assert!(err(ctx.document_mask(&[1, 2, 1, 3], [1, 4])));
        assert!(err(ctx.document_mask_from_cu_seqlens(&[])));
        assert!(err(ctx.document_mask_from_cu_seqlens(&[1, 4])));
        assert!(err(ctx.document_mask_from_cu_seqlens(&[0, 4, 3])));
        assert!(err(ctx.prefix_lm_mask(&[2, 9], 8)));
        let table = ctx.document_mask(&[5, 5, 7, 7, 1, 2, 2, 2], [2, 4]).unwrap();
        assert!(table.visible(0, 1, 0) && !table.visible(0, 2, 1) && !table.visible(1, 1, 0) && table.visible(1, 3, 1));
        let from_cu = ctx.document_mask_from_cu_seqlens(&[0, 2, 2, 4]).unwrap();
        assert_eq!(from_cu.dims(), [1, 4, 4]);
        assert!(from_cu.visible(0, 3, 2) && !from_cu.visible(0, 2, 1));
        // Varlen: lists of different lengths are refused; a sequence with keys but no queries
        // between two others, or top-left causal over more keys than queries, leaves keys
        // between the neighbours' bands (a gap) that no query sees.
        assert!(err(ctx.varlen_mask(&[0, 2], &[0, 2, 4], Causal::None, None)));
        assert!(err(ctx.varlen_mask(&[0, -2], &[0, 2], Causal::None, None)));
        assert!(ctx.varlen_mask(&[0, 2, 2, 4], &[0, 2, 5, 7], Causal::None, None).unwrap().gapped);
        assert!(ctx.varlen_mask(&[0, 3, 4], &[0, 5, 9], Causal::TopLeft, None).unwrap().gapped);
        assert!(!ctx.varlen_mask(&[0, 3, 4], &[0, 5, 9], Causal::BottomRight, None).unwrap().gapped);
        // Chunked prefill: 2 and 3 new queries against 6 and 3 keys, bottom-right causal.
        let prefill = ctx.varlen_mask(&[0, 2, 5], &[0, 6, 9], Causal::BottomRight, None).unwrap();
        assert_eq!(prefill.dims(), [1, 5, 9]);
        assert!(prefill.visible(0, 0, 4) && !prefill.visible(0, 0, 5) && prefill.visible(0, 1, 5));
        assert!(!prefill.visible(0, 1, 6) && prefill.visible(0, 2, 6) && !prefill.visible(0, 2, 7));
        assert!(prefill.visible(0, 4, 8) && !prefill.visible(0, 4, 5));
        // Outside the table: not visible (not the key half or the next entry read as queries).
        assert!(!table.visible(0, 4, 0) && !table.visible(2, 0, 0) && !table.visible(0, 0, 4));
    }
}

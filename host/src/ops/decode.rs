//! **Ops layer.** Decoding from a KV cache (level 10, `kernels/src/sm80/decode.rs`): attention of
//! a few new queries per sequence over its cached keys, in the shape of FlashAttention's
//! `flash_attn_with_kvcache` — per-sequence cache lengths, an optional append of new K/V rows,
//! a paged cache, token-major or head-major tensors — on the split-KV decoder, which runs on
//! both kernel paths (it is bound by memory, where `mma.sync` and `cp.async` suffice).

use super::AttentionOutput;
use super::args::{flash_config, one_dim};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::kernels::{DECODE_INSTANCES, DecodeInstance, entry};
use crate::layout::{
    AttentionShape, DECODE_MERGE_COLUMNS, DECODE_MERGE_THREADS, DECODE_THREADS, DecodeShape, decode_partial_stride,
};
use crate::problem::{Causal, ScoreMod, Sinks, SlidingWindow};
use crate::runtime::{Context, DeviceTensor, KernelArg, NullPointer};
use crate::select::decode_splits;

/// The order of a 4-D attention tensor's middle dimensions: what its shape means.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[batch, heads, seqlen, head_dim]`: PyTorch's `scaled_dot_product_attention` layout, the
    /// one of [`Context::flash_attention_forward`].
    #[default]
    Bhsd,
    /// `[batch, seqlen, heads, head_dim]`: token-major, FlashAttention's and most inference
    /// engines' layout (a token's heads side by side, as a linear layer writes them).
    Bshd,
}

impl Layout {
    /// `(batch, seqlen, heads, head_dim)` of a tensor of `shape` in this layout.
    fn dims(self, shape: &[usize]) -> Option<(usize, usize, usize, usize)> {
        match (self, shape) {
            (Self::Bhsd, &[b, h, s, d]) => Some((b, s, h, d)),
            (Self::Bshd, &[b, s, h, d]) => Some((b, s, h, d)),
            _ => None,
        }
    }

    /// The strides (elements) of batch, token and head of a contiguous tensor with `seqlen`
    /// tokens of `heads` heads of `head_dim`.
    fn strides(self, seqlen: usize, heads: usize, head_dim: usize) -> (usize, usize, usize) {
        match self {
            Self::Bhsd => (heads * seqlen * head_dim, head_dim, seqlen * head_dim),
            Self::Bshd => (seqlen * heads * head_dim, heads * head_dim, head_dim),
        }
    }

    /// The shape of a tensor of these dimensions in this layout.
    pub fn shape(self, batch: usize, seqlen: usize, heads: usize, head_dim: usize) -> [usize; 4] {
        match self {
            Self::Bhsd => [batch, heads, seqlen, head_dim],
            Self::Bshd => [batch, seqlen, heads, head_dim],
        }
    }

    /// The offset (elements) of element `(b, t, h, c)` — batch, token, head, column — of a
    /// contiguous tensor of `seqlen` tokens of `heads` heads of `head_dim` in this layout.
    pub fn offset(
        self,
        (seqlen, heads, head_dim): (usize, usize, usize),
        (b, t, h, c): (usize, usize, usize, usize),
    ) -> usize {
        let (batch, token, head) = self.strides(seqlen, heads, head_dim);
        b * batch + t * token + h * head + c
    }

    fn name(self) -> &'static str {
        match self {
            Self::Bhsd => "[batch, heads, seqlen, head_dim]",
            Self::Bshd => "[batch, seqlen, heads, head_dim]",
        }
    }
}

/// A KV cache, as [`Context::attention_with_kv_cache`] reads (and appends to) it. K and V have
/// the same shape, in the call's [`Layout`]:
///
/// * **contiguous** (no `block_table`): `[batch, capacity, num_heads_kv, head_dim]` (`Bshd`) or
///   `[batch, num_heads_kv, capacity, head_dim]` (`Bhsd`): up to `capacity` keys per sequence;
/// * **paged** (`block_table` given): `[num_pages, page_size, num_heads_kv, head_dim]` (`Bshd`)
///   or `[num_pages, num_heads_kv, page_size, head_dim]` (`Bhsd`), with `block_table` `[batch,
///   pages_per_seq]` (`i32`): token `t` of sequence `b` is row `t % page_size` of page
///   `block_table[b][t / page_size]`. `page_size` is a multiple of 16 (vLLM's 16 and up). Up to
///   `pages_per_seq · page_size` keys per sequence.
///
/// `seqlens` (`[batch]`, `i32`, FlashAttention's `cache_seqlens`) gives each sequence's number of
/// cached keys; without it every sequence has the full capacity. Lengths are read on the device:
/// a length past the capacity counts as the capacity, and a page number past the cache as its
/// last page, so that a bad table or length reads wrong keys but never outside the cache.
pub struct KvCache<'a, T: Element> {
    /// K, `f16` or `bf16`.
    pub k: &'a mut DeviceTensor<T>,
    /// V, K's shape.
    pub v: &'a mut DeviceTensor<T>,
    /// Cached keys per sequence, `[batch]`.
    pub seqlens: Option<&'a DeviceTensor<i32>>,
    /// Pages of each sequence, `[batch, pages_per_seq]`; `None` for a contiguous cache.
    pub block_table: Option<&'a DeviceTensor<i32>>,
}

/// Options of [`Context::attention_with_kv_cache`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeOptions<'a> {
    /// Multiplies Q Kᵀ before the softmax; `None` means 1/√head_dim.
    pub scale: Option<f32>,
    /// Causal mask, in each sequence's own coordinates: with [`Causal::BottomRight`] (what
    /// decoding needs when seqlen_q > 1, e.g. speculative decoding) query `i` of a sequence
    /// with `L` keys sees keys `j ≤ i + L − seqlen_q`.
    pub causal: Causal,
    /// The layout of Q, O, the cache and the new K/V rows; the default is [`Layout::Bhsd`], the
    /// rest of the library's (token-major caches, FlashAttention's, need [`Layout::Bshd`]).
    pub layout: Layout,
    /// Blocks that share each sequence's keys; `None` lets the heuristic choose
    /// (`decode_splits` in `host/src/select.rs`). Clamped to 1..=256.
    pub num_splits: Option<usize>,
    /// Sliding window (local attention), intersected with the causal mask, aligned to each
    /// sequence's end ([`SlidingWindow::new`]; a top-left window is an [`Error::Argument`]):
    /// query `i` of a sequence with `L` keys sees keys `i + L − seqlen_q − left ..= i + L −
    /// seqlen_q + right`. Only the key tiles inside some row's window are read.
    pub window: Option<SlidingWindow>,
    /// Softcapping or ALiBi, as in [`crate::AttentionOptions::score`] (ALiBi's distances in
    /// each sequence's own coordinates).
    pub score: ScoreMod,
    /// Attention sinks, one logit per query head ([`Sinks`], `[num_heads_q]` `f32`), joining
    /// every row's softmax as in [`crate::AttentionOptions::sinks`].
    pub sinks: Option<Sinks<'a>>,
}

/// What one decoding call runs: the problem as the kernels take it, and the decoder's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// The problem, strides and splits included.
    pub shape: DecodeShape,
    /// The decoder kernel.
    pub entry: &'static str,
    /// Its dynamic shared memory, bytes.
    pub shared_memory_bytes: usize,
    /// Its compiled head_dim (the problem's, rounded up to a compiled one, 64, 128, 160 or 256,
    /// whose decoder fits the device).
    pub head_dim: usize,
    /// Its K/V ring's depth per warp.
    pub stages: usize,
}

impl DecodePlan {
    /// A short label for tables: `decode d128 s3 splits 4`.
    pub fn label(&self) -> String {
        format!("decode d{} s{} splits {}", self.head_dim, self.stages, self.shape.num_splits)
    }
}

/// The decoders compiled for `dtype` (the registry's [`DECODE_INSTANCES`], generated from the
/// PTX), ascending by head_dim and in the order of preference per
/// head_dim, the deeper ring first (the first that fits the device runs;
/// [`decode_stages_override`] picks another).
fn decoders(dtype: DType) -> impl Iterator<Item = &'static DecodeInstance> + Clone {
    DECODE_INSTANCES.iter().filter(move |d| d.dtype == dtype)
}

/// `RUST_ATTENTION_DECODE_STAGES=N`: run the decoder whose ring has `N` stages where one is
/// compiled for the problem's head_dim (for measurements; read once).
fn decode_stages_override() -> Option<usize> {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *OVERRIDE.get_or_init(|| std::env::var("RUST_ATTENTION_DECODE_STAGES").ok()?.parse().ok())
}

fn shape_error(what: String) -> Error {
    Error::Shape(what)
}

impl Context {
    /// Attention of new queries over a KV cache (FlashAttention's `flash_attn_with_kvcache`):
    /// O = softmax(Q Kᵀ · scale) V per sequence, over the sequence's cached keys — after
    /// appending `new_kv` to the cache when given — with the options' mask, sliding window,
    /// softcap or ALiBi, and attention sinks. `f16` or `bf16`.
    ///
    /// Shapes, in `options.layout` (see [`Layout`], [`KvCache`]): Q `[batch, seqlen_q,
    /// num_heads_q, head_dim]` (`Bshd`) or `[batch, num_heads_q, seqlen_q, head_dim]` (`Bhsd`),
    /// `num_heads_kv` dividing `num_heads_q` (grouped-query attention), head_dim 1 to 256; the
    /// new rows `(k_new, v_new)`, each `[batch, seqlen_new, num_heads_kv, head_dim]` (`Bshd`),
    /// are written at tokens `seqlens[b] ..` of each sequence (which needs `cache.seqlens`;
    /// rows past a sequence's capacity are dropped) and attended to, so a sequence then has
    /// `seqlens[b] + seqlen_new` keys. `cache.seqlens` itself is not updated. The result: O in
    /// Q's shape and layout, LSE `[batch, num_heads_q, seqlen_q]` (`f32`, natural log; −∞ and O
    /// = 0 for a row that sees no key, e.g. an empty sequence).
    ///
    /// The split-KV decoder (`kernels/src/sm80/decode.rs`) packs the query heads of each K/V
    /// head into one block's rows and splits each sequence's keys over `num_splits` blocks
    /// ([`DecodeOptions::num_splits`]), merged by their LSE; [`Context::decode_plan`] says what
    /// a call runs.
    ///
    /// # Errors
    /// [`Error::Argument`] for `f32` (the decoder is 16-bit; [`Context::flash_attention_forward`]
    /// takes `f32`), new rows without `seqlens` or a top-left window; [`Error::Shape`] for
    /// tensors whose shapes do not agree, a head_dim above 256, a page size that is not a
    /// multiple of 16; [`Error::ScoreMod`], [`Error::Sinks`] (not `[num_heads_q]`, or another
    /// context's); [`Error::ForeignTensor`], [`Error::SharedMemory`], [`Error::Driver`].
    pub fn attention_with_kv_cache<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        cache: &mut KvCache<'_, T>,
        new_kv: Option<(&DeviceTensor<T>, &DeviceTensor<T>)>,
        options: &DecodeOptions,
    ) -> Result<AttentionOutput<T>> {
        let plan = self.decode_plan(q, cache, new_kv, options)?;
        let s = plan.shape;
        let o_shape = options.layout.shape(s.batch, s.seqlen_q, s.num_heads_q, s.head_dim);
        let out = AttentionOutput {
            o: self.alloc_output::<T>(&o_shape)?,
            lse: self.alloc_output::<f32>(&[s.batch, s.num_heads_q, s.seqlen_q])?,
        };
        let seqlens: &dyn KernelArg = match cache.seqlens {
            Some(t) => t,
            None => &NullPointer("i32"),
        };
        let table: &dyn KernelArg = match cache.block_table {
            Some(t) => t,
            None => &NullPointer("i32"),
        };
        let shape_args = s.args();
        let shape_tail: Vec<&dyn KernelArg> = shape_args.iter().map(|a| a as &dyn KernelArg).collect();
        if let Some((k_new, v_new)) = new_kv
            && s.new_keys > 0
        {
            let (nb, nt, nh) = options.layout.strides(s.new_keys, s.num_heads_kv, s.head_dim);
            let mut args: Vec<&dyn KernelArg> = vec![k_new, v_new, &*cache.k, &*cache.v, seqlens, table, &nb, &nt, &nh];
            args.extend_from_slice(&shape_tail);
            let elements = s.batch * s.new_keys * s.num_heads_kv * s.head_dim;
            let blocks = elements.div_ceil(256).min(self.device().sm_count * 8).max(1);
            self.launch(entry::DECODE_APPEND_KV, one_dim(blocks as u32, 256), &args)?;
        }
        let scale_log2 = options.scale.unwrap_or(1.0 / (s.head_dim as f32).sqrt()) * std::f32::consts::LOG2_E;
        let (softcap, alibi_max_bias) = options.score.kernel_args();
        let sinks: &dyn KernelArg = match &options.sinks {
            Some(sinks) => sinks,
            None => &NullPointer("f32"),
        };
        let config = flash_config((s.blocks(), 1, 1), DECODE_THREADS, plan.shared_memory_bytes);
        if s.num_splits == 1 {
            let mut args: Vec<&dyn KernelArg> = vec![
                q,
                &*cache.k,
                &*cache.v,
                &out.o,
                &out.lse,
                &NullPointer("f32"),
                &NullPointer("f32"),
                seqlens,
                table,
                &scale_log2,
                &softcap,
                &alibi_max_bias,
                sinks,
            ];
            args.extend_from_slice(&shape_tail);
            return self.launch(plan.entry, config, &args).map(|()| out);
        }
        let o_partial = self.alloc_output::<f32>(&[s.num_splits, s.query_rows(), decode_partial_stride(s.head_dim)])?;
        let lse_partial = self.alloc_output::<f32>(&[s.num_splits, s.query_rows()])?;
        let mut args: Vec<&dyn KernelArg> = vec![
            q,
            &*cache.k,
            &*cache.v,
            &NullPointer("u16"),
            &NullPointer("f32"),
            &o_partial,
            &lse_partial,
            seqlens,
            table,
            &scale_log2,
            &softcap,
            &alibi_max_bias,
            sinks,
        ];
        args.extend_from_slice(&shape_tail);
        self.launch(plan.entry, config, &args)?;
        let merge = match T::DTYPE {
            DType::F16 => entry::DECODE_MERGE_F16,
            _ => entry::DECODE_MERGE_BF16,
        };
        let mut args: Vec<&dyn KernelArg> = vec![&o_partial, &lse_partial, &out.o, &out.lse, sinks];
        args.extend_from_slice(&shape_tail);
        let threads = s.query_rows() * s.head_dim.div_ceil(DECODE_MERGE_COLUMNS);
        let blocks = threads.div_ceil(DECODE_MERGE_THREADS);
        self.launch(merge, flash_config((blocks, 1, 1), DECODE_MERGE_THREADS, 0), &args)?;
        Ok(out)
    }

    /// What [`Context::attention_with_kv_cache`] runs for these tensors and options: the
    /// checked problem, the decoder kernel and the number of splits.
    ///
    /// # Errors
    /// As [`Context::attention_with_kv_cache`].
    pub fn decode_plan<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        cache: &KvCache<'_, T>,
        new_kv: Option<(&DeviceTensor<T>, &DeviceTensor<T>)>,
        options: &DecodeOptions,
    ) -> Result<DecodePlan> {
        if T::DTYPE == DType::F32 {
            return Err(Error::Argument(
                "the KV-cache decoder takes f16 or bf16 tensors; f32 attention runs through flash_attention_forward"
                    .into(),
            ));
        }
        self.require_dtype(T::DTYPE)?;
        for (name, tensor) in [("q", q), ("k_cache", &*cache.k), ("v_cache", &*cache.v)] {
            self.check_owner(name, tensor)?;
        }
        let layout = options.layout;
        let (batch, seqlen_q, num_heads_q, head_dim) = layout
            .dims(q.shape())
            .ok_or_else(|| shape_error(format!("q has shape {:?}; expected {}", q.shape(), layout.name())))?;
        if batch == 0 || seqlen_q == 0 || num_heads_q == 0 {
            return Err(shape_error(format!(
                "q has shape {:?}: batch, seqlen_q and heads must be at least 1",
                q.shape()
            )));
        }
        if cache.k.shape() != cache.v.shape() {
            return Err(shape_error(format!("k_cache {:?} and v_cache {:?} differ", cache.k.shape(), cache.v.shape())));
        }
        let (outer, rows, num_heads_kv, kv_dim) = layout.dims(cache.k.shape()).ok_or_else(|| {
            shape_error(format!("k_cache has shape {:?}; expected {}", cache.k.shape(), layout.name()))
        })?;
        if kv_dim != head_dim {
            return Err(shape_error(format!("q has head_dim {head_dim}, the cache {kv_dim}")));
        }
        if head_dim == 0 || head_dim > 256 {
            return Err(shape_error(format!("head_dim {head_dim}: the decoder takes 1 to 256")));
        }
        if num_heads_kv == 0 {
            return Err(shape_error(format!("k_cache has shape {:?}: heads must be at least 1", cache.k.shape())));
        }
        if num_heads_q % num_heads_kv != 0 {
            return Err(shape_error(format!(
                "{num_heads_q} query heads are not a multiple of the cache's {num_heads_kv} heads (q {:?} and \
                 k_cache {:?} read as {:?} {}; DecodeOptions::layout says which)",
                q.shape(),
                cache.k.shape(),
                layout,
                layout.name()
            )));
        }
        let (k_batch, k_token, k_head) = layout.strides(rows, num_heads_kv, head_dim);
        let (q_batch, q_token, q_head) = layout.strides(seqlen_q, num_heads_q, head_dim);
        let (page_size, pages_per_seq, num_pages, capacity) = match cache.block_table {
            None => {
                if outer != batch {
                    return Err(shape_error(format!("q has batch {batch}, the contiguous cache {outer}")));
                }
                (0, 0, 0, rows)
            }
            Some(table) => {
                self.check_owner("block_table", table)?;
                let &[table_batch, pages_per_seq] = table.shape() else {
                    return Err(shape_error(format!(
                        "block_table has shape {:?}; expected [batch, pages]",
                        table.shape()
                    )));
                };
                if table_batch != batch {
                    return Err(shape_error(format!("q has batch {batch}, block_table {table_batch}")));
                }
                if rows == 0 || rows % 16 != 0 {
                    return Err(shape_error(format!("page size {rows}: pages hold a multiple of 16 tokens")));
                }
                if outer == 0 && batch * pages_per_seq > 0 {
                    return Err(shape_error("a paged cache with no pages".into()));
                }
                (rows, pages_per_seq, outer, pages_per_seq * rows)
            }
        };
        if let Some(seqlens) = cache.seqlens {
            self.check_owner("seqlens", seqlens)?;
            if seqlens.shape() != [batch] {
                return Err(shape_error(format!("seqlens has shape {:?}; expected [{batch}]", seqlens.shape())));
            }
        }
        let new_keys = match new_kv {
            None => 0,
            Some((k_new, v_new)) => {
                self.check_owner("k_new", k_new)?;
                self.check_owner("v_new", v_new)?;
                if cache.seqlens.is_none() {
                    return Err(Error::Argument(
                        "appending K/V rows needs the cache's seqlens (where each sequence's rows go)".into(),
                    ));
                }
                if k_new.shape() != v_new.shape() {
                    return Err(shape_error(format!("k_new {:?} and v_new {:?} differ", k_new.shape(), v_new.shape())));
                }
                match layout.dims(k_new.shape()) {
                    Some((b, s, h, d)) if b == batch && h == num_heads_kv && d == head_dim => s,
                    _ => {
                        return Err(shape_error(format!(
                            "k_new has shape {:?}; expected {} with batch {batch}, {num_heads_kv} heads, head_dim {head_dim}",
                            k_new.shape(),
                            layout.name()
                        )));
                    }
                }
            }
        };
        if let Some(scale) = options.scale
            && !scale.is_finite()
        {
            return Err(Error::InvalidScale { scale });
        }
        options.score.check()?;
        let open = attn_kernels::attention::mask::Mask::OPEN;
        let (window_left, window_right) = match options.window {
            None => (open, open),
            Some(w) if w.bottom_right => (w.left.unwrap_or(open), w.right.unwrap_or(open)),
            Some(_) => {
                return Err(Error::Argument(
                    "the decoder aligns a sliding window to each sequence's end (SlidingWindow::new); a top-left \
                     window is not taken"
                        .into(),
                ));
            }
        };
        if let Some(sinks) = options.sinks {
            let heads = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k: capacity, head_dim };
            sinks.check(&heads, self.id())?;
        }
        let (causal, bottom_right) = match options.causal {
            Causal::None => (0, 0),
            Causal::TopLeft => (1, 0),
            Causal::BottomRight => (1, 1),
        };
        // The smallest compiled head_dim at least the problem's whose decoder fits the device's
        // shared memory (a deeper ring first; a smaller GPU may need the next head_dim's
        // shallower one), or the forced ring depth where that head_dim has it.
        let candidates = || decoders(T::DTYPE).filter(move |d| d.head_dim >= head_dim);
        let forced = decode_stages_override().filter(|&f| {
            let smallest = candidates().map(|d| d.head_dim).next();
            candidates().any(|d| Some(d.head_dim) == smallest && d.stages == f)
        });
        let (decoder, smem) = candidates()
            .filter(|d| forced.is_none_or(|f| f == d.stages))
            .map(|d| (d, d.shared_memory_bytes()))
            .find(|&(_, smem)| smem <= self.device().max_shared_memory_per_block)
            .ok_or_else(|| Error::SharedMemory {
                kernel: "decoder".into(),
                block_m: 16,
                block_n: 16,
                head_dim,
                needed: candidates().map(DecodeInstance::shared_memory_bytes).min().unwrap_or(0),
                available: self.device().max_shared_memory_per_block,
                device: self.device().name.clone(),
                fitting: "none".into(),
            })?;
        let (compiled, stages, entry) = (decoder.head_dim, decoder.stages, decoder.entry);
        let mut shape = DecodeShape {
            batch,
            num_heads_q,
            num_heads_kv,
            seqlen_q,
            head_dim,
            capacity,
            has_seqlens: cache.seqlens.is_some() as usize,
            new_keys,
            causal,
            bottom_right,
            num_splits: 1,
            q_batch,
            q_token,
            q_head,
            o_batch: q_batch,
            o_token: q_token,
            o_head: q_head,
            k_batch,
            k_token,
            k_head,
            v_batch: k_batch,
            v_token: k_token,
            v_head: k_head,
            page_size,
            pages_per_seq,
            num_pages,
            window_left,
            window_right,
        };
        shape.num_splits = match options.num_splits {
            Some(n) => n.clamp(1, 256),
            None => {
                let blocks_per_sm =
                    if self.is_emulated() { 1 } else { self.kernel_blocks_per_sm(entry, DECODE_THREADS, smem)?.max(1) };
                decode_splits(&shape, self.device().sm_count, blocks_per_sm)
            }
        };
        Ok(DecodePlan { shape, entry, shared_memory_bytes: smem, head_dim: compiled, stages })
    }
}

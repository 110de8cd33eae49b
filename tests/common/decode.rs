//! Checks of the KV-cache decoder (`Context::attention_with_kv_cache`), shared by the GPU tests
//! and the emulated tests: a logical problem (each sequence's keys, head-major) drawn at random
//! and rounded to the 16-bit type, laid out as the case asks (token- or head-major, contiguous
//! or paged over shuffled pages, part of the keys appended as new rows), the cache's unused rows
//! filled with large values that would show if they were read; compared with `cpu::decode`.

use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::{
    Causal, Context, DecodeOptions, DeviceTensor, Element, KvCache, Layout, ScoreMod, Sinks, SlidingWindow, cpu,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::tensor_cores::{LSE_TOLERANCE, tolerances};

/// One decoding problem.
#[derive(Clone, Debug)]
pub struct DecodeCase {
    pub num_heads_q: usize,
    pub num_heads_kv: usize,
    pub seqlen_q: usize,
    pub head_dim: usize,
    /// Cached keys of each sequence (the batch is its length).
    pub cached: Vec<usize>,
    /// New K/V rows appended to every sequence before attending (0: no append).
    pub new_keys: usize,
    /// Keys the cache holds per sequence (contiguous), or pages × page size (paged).
    pub capacity: usize,
    /// `Some(page_size)` for a paged cache.
    pub page_size: Option<usize>,
    pub layout: Layout,
    pub causal: Causal,
    pub num_splits: Option<usize>,
    /// Pass the lengths (`seqlens`); without them every sequence has `capacity` keys (then
    /// `cached` must all be `capacity` and `new_keys` 0).
    pub with_seqlens: bool,
    /// A sliding window (aligned to each sequence's end).
    pub window: Option<SlidingWindow>,
    /// Softcapping or ALiBi.
    pub score: ScoreMod,
    /// Attention sinks, drawn per query head (normal, times 2), or all `sink_value` when given.
    pub sinks: bool,
    pub sink_value: Option<f32>,
}

impl DecodeCase {
    /// A contiguous token-major cache, every sequence `cached` keys, no append.
    pub fn simple(batch: usize, heads: (usize, usize), seqlen_q: usize, head_dim: usize, cached: usize) -> Self {
        Self {
            num_heads_q: heads.0,
            num_heads_kv: heads.1,
            seqlen_q,
            head_dim,
            cached: vec![cached; batch],
            new_keys: 0,
            capacity: cached.max(1),
            page_size: None,
            layout: Layout::Bshd,
            causal: Causal::None,
            num_splits: None,
            with_seqlens: true,
            window: None,
            score: ScoreMod::default(),
            sinks: false,
            sink_value: None,
        }
    }
}

/// Runs `case` on `ctx` and checks O, LSE and (with an append) the cache's new rows; returns
/// the errors of O and LSE.
/// (Nothing is checked, and the errors are 0, for a type the device lacks: [`super::runs`].)
pub fn check_decode<T: Element>(ctx: &Context, case: &DecodeCase, seed: u64) -> (f64, f64) {
    if !super::runs(ctx, T::DTYPE) {
        return (0.0, 0.0);
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let (hq, hkv, sq, d) = (case.num_heads_q, case.num_heads_kv, case.seqlen_q, case.head_dim);
    let batch = case.cached.len();
    let round = |values: Vec<f32>| to_f32_vec(&from_f32_slice::<T>(&values));
    // The logical problem: Q head-major, each sequence's keys (cached, then new) head-major.
    let q_logical = round(random_normal(batch * hq * sq * d, seed));
    let total: Vec<usize> = case.cached.iter().map(|&c| c + case.new_keys).collect();
    let seqs: Vec<cpu::SequenceKv> = total
        .iter()
        .enumerate()
        .map(|(b, &len)| cpu::SequenceKv {
            k: round(random_normal(hkv * len * d, seed ^ (2 * b as u64 + 1) << 32)),
            v: round(random_normal(hkv * len * d, seed ^ (2 * b as u64 + 2) << 32)),
            len,
        })
        .collect();
    // Q in the case's layout.
    let mut q_host = vec![0.0f32; q_logical.len()];
    for b in 0..batch {
        for h in 0..hq {
            for s in 0..sq {
                for c in 0..d {
                    q_host[case.layout.offset((sq, hq, d), (b, s, h, c))] = q_logical[((b * hq + h) * sq + s) * d + c];
                }
            }
        }
    }
    // The cache: a row's place is (outer, token) — (b, t) contiguous, (page, t % page) paged.
    // A paged cache holds whole pages: its capacity is rounded up to them.
    let capacity = case.page_size.map_or(case.capacity, |p| case.capacity.div_ceil(p) * p);
    let (outer, rows, pages_per_seq) = match case.page_size {
        None => (batch, case.capacity, 0),
        Some(page) => {
            let pages = case.capacity.div_ceil(page);
            (batch * pages + 1, page, pages)
        }
    };
    let mut pages: Vec<usize> = (0..outer).collect();
    pages.shuffle(&mut rng);
    let place = |b: usize, t: usize| -> (usize, usize) {
        match case.page_size {
            None => (b, t),
            Some(page) => (pages[b * pages_per_seq + t / page], t % page),
        }
    };
    // Unused rows hold 1000: a kernel that read one would be far off.
    let cache_len = outer * rows * hkv * d;
    let (mut k_host, mut v_host) = (vec![1000.0f32; cache_len], vec![1000.0f32; cache_len]);
    for (b, seq) in seqs.iter().enumerate() {
        for t in 0..case.cached[b].min(capacity) {
            let (o, r) = place(b, t);
            for h in 0..hkv {
                for c in 0..d {
                    let at = case.layout.offset((rows, hkv, d), (o, r, h, c));
                    k_host[at] = seq.k[(h * seq.len + t) * d + c];
                    v_host[at] = seq.v[(h * seq.len + t) * d + c];
                }
            }
        }
    }
    let shape4 = |b: usize, s: usize, h: usize| case.layout.shape(b, s, h, d);
    let q = ctx.upload(&from_f32_slice::<T>(&q_host), &shape4(batch, sq, hq)).unwrap();
    let mut k_cache = ctx.upload(&from_f32_slice::<T>(&k_host), &shape4(outer, rows, hkv)).unwrap();
    let mut v_cache = ctx.upload(&from_f32_slice::<T>(&v_host), &shape4(outer, rows, hkv)).unwrap();
    let seqlens: Vec<i32> = case.cached.iter().map(|&c| c as i32).collect();
    let seqlens = ctx.upload(&seqlens, &[batch]).unwrap();
    let table: Option<DeviceTensor<i32>> = case.page_size.map(|_| {
        let entries: Vec<i32> = (0..batch * pages_per_seq).map(|i| pages[i] as i32).collect();
        ctx.upload(&entries, &[batch, pages_per_seq]).unwrap()
    });
    // The new rows, in the layout.
    let new = (case.new_keys > 0).then(|| {
        let n = case.new_keys;
        let (mut k_new, mut v_new) = (vec![0.0f32; batch * n * hkv * d], vec![0.0f32; batch * n * hkv * d]);
        for (b, seq) in seqs.iter().enumerate() {
            for t in 0..n {
                for h in 0..hkv {
                    for c in 0..d {
                        let at = case.layout.offset((n, hkv, d), (b, t, h, c));
                        let from = (h * seq.len + case.cached[b] + t) * d + c;
                        k_new[at] = seq.k[from];
                        v_new[at] = seq.v[from];
                    }
                }
            }
        }
        let up = |x: &[f32]| ctx.upload(&from_f32_slice::<T>(x), &shape4(batch, n, hkv)).unwrap();
        (up(&k_new), up(&v_new))
    });
    let sink_values: Option<Vec<f32>> = case.sinks.then(|| match case.sink_value {
        Some(value) => vec![value; hq],
        None => random_normal(hq, seed ^ 0x51_4e_4b).iter().map(|x| 2.0 * x).collect(),
    });
    let sinks_tensor = sink_values.as_ref().map(|v| ctx.upload(v, &[hq]).unwrap());
    let options = DecodeOptions {
        scale: None,
        causal: case.causal,
        layout: case.layout,
        num_splits: case.num_splits,
        window: case.window,
        score: case.score,
        sinks: sinks_tensor.as_ref().map(Sinks::from),
    };
    let mut cache = KvCache {
        k: &mut k_cache,
        v: &mut v_cache,
        seqlens: case.with_seqlens.then_some(&seqlens),
        block_table: table.as_ref(),
    };
    let out = match ctx.attention_with_kv_cache(&q, &mut cache, new.as_ref().map(|(k, v)| (k, v)), &options) {
        Ok(out) => out,
        // A smaller GPU's profile (`RUST_ATTENTION_GPU_PROFILE`): no decoder fits above its head
        // dims (99 KiB a block: up to 160), which the error says; nothing to check then.
        Err(e @ attn_host::Error::SharedMemory { .. }) if ctx.device().max_shared_memory_per_block < 200 * 1024 => {
            let line = format!("{} {case:?}: skipped on {}: {e}\n", T::DTYPE, ctx.device().name);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            return (0.0, 0.0);
        }
        Err(e) => panic!("{case:?}: {e}"),
    };
    let o_host = to_f32_vec(&out.o.to_host().unwrap());
    let mut o = vec![0.0f32; o_host.len()];
    for b in 0..batch {
        for h in 0..hq {
            for s in 0..sq {
                for c in 0..d {
                    o[((b * hq + h) * sq + s) * d + c] = o_host[case.layout.offset((sq, hq, d), (b, s, h, c))];
                }
            }
        }
    }
    // The reference sees each sequence's keys up to the capacity.
    let clipped: Vec<cpu::SequenceKv> = seqs
        .iter()
        .map(|s| {
            let len = s.len.min(capacity);
            let keep = |x: &[f32]| (0..hkv).flat_map(|h| x[h * s.len * d..(h * s.len + len) * d].to_vec()).collect();
            cpu::SequenceKv { k: keep(&s.k), v: keep(&s.v), len }
        })
        .collect();
    let params = cpu::Params {
        scale: 1.0 / (d as f64).sqrt(),
        causal: case.causal,
        window: case.window,
        score: case.score,
        sinks: sink_values.as_deref(),
        mask_table: None,
        bias: None,
    };
    let reference = cpu::decode(&q_logical, &clipped, (hq, hkv, sq, d), params).unwrap();
    let lse = out.lse.to_host().unwrap();
    let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), lse_error(&lse, &reference.lse));
    let (o_tolerance, _) = tolerances(T::DTYPE);
    assert!(
        err_o <= o_tolerance && err_lse <= LSE_TOLERANCE,
        "{} {case:?}: relative L2 error O {err_o:.3e} (≤ {o_tolerance:.0e}), LSE {err_lse:.3e}",
        T::DTYPE
    );
    // The appended rows are in the cache, where the sequence's tokens go.
    if let Some((_, _)) = &new {
        let k_after = to_f32_vec(&k_cache.to_host().unwrap());
        for (b, seq) in seqs.iter().enumerate() {
            for t in case.cached[b]..(case.cached[b] + case.new_keys).min(capacity) {
                let (o, r) = place(b, t);
                for h in 0..hkv {
                    let at = case.layout.offset((rows, hkv, d), (o, r, h, 0));
                    assert_eq!(
                        &k_after[at..at + d],
                        &seq.k[(h * seq.len + t) * d..(h * seq.len + t + 1) * d],
                        "{case:?}: appended row {t} of sequence {b}"
                    );
                }
            }
        }
    }
    (err_o, err_lse)
}

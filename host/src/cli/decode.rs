//! `rust-attention decode`: one decoding step over a KV cache of random values
//! ([`Context::attention_with_kv_cache`]), timed (CUDA events, warm-up, median) and reported as
//! the bandwidth of the K and V it reads; `--check` compares it with the `f64` reference.
//!
//! ```text
//! rust-attention decode --batch 8 --heads 32 --kv-heads 8 --cache-len 8192 --head-dim 128 --dtype bf16
//! rust-attention decode --batch 1 --heads 32 --cache-len 32768 --page-size 64
//! ```

use clap::ValueEnum;

use super::CausalArg;
use crate::check::{Tolerance, lse_error, random_normal, relative_l2_error};
use crate::dtype::{from_f32_slice, to_f32_vec};
use crate::{
    Context, DType, DecodeOptions, Device, DeviceTensor, Element, Error, KvCache, Layout, Result, bf16, cpu, f16,
    timing,
};

/// The layout of Q, O and the cache.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutArg {
    /// `[batch, seqlen, heads, head_dim]` (FlashAttention's KV cache).
    Bshd,
    /// `[batch, heads, seqlen, head_dim]`.
    Bhsd,
}

/// Flags of `rust-attention decode`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequences decoded together.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// K/V heads (divides --heads; default: --heads).
    #[arg(long, visible_alias = "heads-kv")]
    pub kv_heads: Option<usize>,
    /// New queries per sequence (1 for plain decoding, more for speculative decoding).
    #[arg(long, default_value_t = 1)]
    pub seqlen_q: usize,
    /// Cached keys per sequence.
    #[arg(long, default_value_t = 8192)]
    pub cache_len: usize,
    /// Features per head, 1 to 256 (default: 128, or the largest compiled decoder head_dim that
    /// the GPU's shared memory holds: 64 on a T4 or under the `t4` profile).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// f16 or bf16 (default: bf16, or f16 on a GPU without bf16 kernels: Turing, the `t4` profile).
    #[arg(long)]
    pub dtype: Option<String>,
    /// A paged cache with pages of this many tokens (a multiple of 16), in shuffled order.
    #[arg(long, value_parser = clap::value_parser!(u32).range(16..))]
    pub page_size: Option<u32>,
    /// Layout of Q, O and the cache.
    #[arg(long, value_enum, default_value_t = LayoutArg::Bshd)]
    pub layout: LayoutArg,
    /// Causal mask (bottom-right is the one decoding with seqlen_q > 1 needs).
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    pub causal: CausalArg,
    /// The window, score modification and sinks (`super::ModelArgs`).
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Blocks that share each sequence's keys, 1 to 256 (default: the heuristic).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub splits: Option<u16>,
    /// Untimed runs first.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Timed runs (the median is reported; at least 1).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Compare O and LSE with the f64 CPU reference.
    #[arg(long)]
    pub check: bool,
    /// A GPU ordinal or `cpu-emulated`.
    #[arg(long, default_value = "0")]
    pub device: Device,
}

/// Runs the job.
///
/// # Errors
/// Bad flags ([`Error::Argument`]), the decoder's errors, a failed `--check`
/// ([`Error::CheckFailed`]).
pub fn run(args: &Args) -> Result<()> {
    // A bad --dtype is an argument error before any GPU is looked for; the default needs the GPU.
    let asked: Option<DType> = args.dtype.as_deref().map(str::parse).transpose().map_err(Error::Argument)?;
    let ctx = Context::open(args.device).inspect_err(|e| {
        if matches!(e, Error::NoDriver | Error::NoDevice { .. }) {
            eprintln!("(no GPU: `--device cpu-emulated` runs the decoder's own source on the CPU; keep sizes small)");
        }
    })?;
    let dtype = match asked {
        Some(dtype) => dtype,
        None if ctx.device().supports(DType::Bf16) => DType::Bf16,
        None => {
            println!("(this GPU has no bf16 kernels: decoding in f16; pass --dtype to choose)");
            DType::F16
        }
    };
    if dtype == DType::F32 {
        return Err(Error::Argument("decode runs f16 or bf16".into()));
    }
    let head_dim = match args.head_dim {
        Some(head_dim) => head_dim,
        None => {
            let fitting = largest_fitting_head_dim(dtype, 128, ctx.device().max_shared_memory_per_block);
            if fitting < 128 {
                println!(
                    "(this GPU's shared memory holds the decoder up to head_dim {fitting}: decoding at {fitting}; pass --head-dim to choose)"
                );
            }
            fitting
        }
    };
    match dtype {
        DType::Bf16 => run_typed::<bf16>(&ctx, args, head_dim),
        _ => run_typed::<f16>(&ctx, args, head_dim),
    }
}

/// The largest compiled decoder head_dim, at most `limit`, whose decoder (any ring depth) fits in
/// `shared_memory` bytes a block; `limit` itself where none does (the decoder's own error then
/// says why).
fn largest_fitting_head_dim(dtype: DType, limit: usize, shared_memory: usize) -> usize {
    crate::kernels::DECODE_INSTANCES
        .iter()
        .filter(|d| d.dtype == dtype && d.head_dim <= limit)
        .filter(|d| d.shared_memory_bytes() <= shared_memory)
        .map(|d| d.head_dim)
        .max()
        .unwrap_or(limit)
}

fn run_typed<T: Element>(ctx: &Context, args: &Args, d: usize) -> Result<()> {
    let (b, hq, sq, len) = (args.batch, args.heads, args.seqlen_q, args.cache_len);
    let hkv = args.kv_heads.unwrap_or(hq);
    let page_size = args.page_size.map(|p| p as usize);
    let layout = match args.layout {
        LayoutArg::Bshd => Layout::Bshd,
        LayoutArg::Bhsd => Layout::Bhsd,
    };
    let shape4 = |outer: usize, s: usize, h: usize| layout.shape(outer, s, h, d);
    // A contiguous cache of exactly the length, or pages in shuffled order (a fixed
    // permutation: page i of sequence b is page (i · 7919 + b) mod pages, 7919 being prime).
    let (outer, rows, table) = match page_size {
        None => (b, len.max(1), None),
        Some(page) => {
            let per_seq = len.div_ceil(page).max(1);
            let pages = b * per_seq;
            let mut order: Vec<usize> = (0..pages).collect();
            order.sort_by_key(|&i| (i * 7919) % pages);
            let entries: Vec<i32> = order.iter().map(|&p| p as i32).collect();
            (pages, page, Some(ctx.upload(&entries, &[b, per_seq])?))
        }
    };
    let q_host = random_normal(b * hq * sq * d, 1);
    let k_host = random_normal(outer * rows * hkv * d, 2);
    let v_host = random_normal(outer * rows * hkv * d, 3);
    let q = ctx.upload(&from_f32_slice::<T>(&q_host), &shape4(b, sq, hq))?;
    let mut k = ctx.upload(&from_f32_slice::<T>(&k_host), &shape4(outer, rows, hkv))?;
    let mut v = ctx.upload(&from_f32_slice::<T>(&v_host), &shape4(outer, rows, hkv))?;
    let seqlens: DeviceTensor<i32> = ctx.upload(&vec![len as i32; b], &[b])?;
    let sinks = args.model.sinks.map(|sink| ctx.upload(&vec![sink; hq], &[hq])).transpose()?;
    let options = DecodeOptions {
        scale: None,
        causal: args.causal.into(),
        layout,
        num_splits: args.splits.map(usize::from),
        window: args.model.window(),
        score: args.model.score(),
        sinks: sinks.as_ref().map(crate::Sinks::from),
    };
    let mut cache = KvCache { k: &mut k, v: &mut v, seqlens: Some(&seqlens), block_table: table.as_ref() };
    let plan = ctx.decode_plan(&q, &cache, None, &options)?;
    let time = timing::time_gpu(ctx, args.warmup, args.repeats as usize, || {
        ctx.attention_with_kv_cache(&q, &mut cache, None, &options).map(drop)
    })?;
    // The keys a sequence's rows see: all of them, or a window's (its left edge and the queries).
    let keys_read = options.window.and_then(|w| w.left).map_or(len, |left| (left + sq).min(len));
    let bytes = 2.0 * (b * keys_read * hkv * d * T::DTYPE.size()) as f64;
    let gbps = bytes / (time.median_ms * 1e-3) / 1e9;
    let paging = page_size.map_or("contiguous".to_string(), |p| format!("pages of {p}"));
    println!(
        "decode [batch {b}, heads {hq}, kv-heads {hkv}, seqlen-q {sq}, cache-len {len}, head-dim {d}] {} {} {paging}, causal {}{}: {} — {:.1} µs median, {gbps:.0} GB/s of K and V ({:.1} MB)",
        T::DTYPE,
        match layout {
            Layout::Bshd => "bshd",
            Layout::Bhsd => "bhsd",
        },
        args.causal.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string()),
        args.model.describe(),
        plan.label(),
        time.median_ms * 1e3,
        bytes / 1e6
    );
    println!("RESULT decode us={:.2} gbps={gbps:.1} label={}", time.median_ms * 1e3, plan.label().replace(' ', "_"));
    if args.check {
        check(ctx, args, d, &q, &mut cache, &options, (&q_host, &k_host, &v_host), (outer, rows), layout)?;
    }
    Ok(())
}

/// `--check`: the f64 reference on the values the device holds, every sequence.
#[allow(clippy::too_many_arguments)]
fn check<T: Element>(
    ctx: &Context,
    args: &Args,
    d: usize,
    q: &DeviceTensor<T>,
    cache: &mut KvCache<'_, T>,
    options: &DecodeOptions,
    (q_host, k_host, v_host): (&[f32], &[f32], &[f32]),
    (_outer, rows): (usize, usize),
    layout: Layout,
) -> Result<()> {
    let (b, hq, sq, len) = (args.batch, args.heads, args.seqlen_q, args.cache_len);
    let hkv = args.kv_heads.unwrap_or(hq);
    let round = |x: &[f32]| to_f32_vec(&from_f32_slice::<T>(x));
    let (q_r, k_r, v_r) = (round(q_host), round(k_host), round(v_host));
    let at = |s: usize, h: usize, element| layout.offset((s, h, d), element);
    let table = match cache.block_table {
        Some(t) => Some(t.to_host()?),
        None => None,
    };
    let per_seq = len.div_ceil(rows).max(1);
    let place = |bb: usize, t: usize| match (&table, args.page_size.map(|p| p as usize)) {
        (Some(tab), Some(page)) => (tab[bb * per_seq + t / page] as usize, t % page),
        _ => (bb, t),
    };
    let mut q_logical = vec![0.0; b * hq * sq * d];
    for bb in 0..b {
        for h in 0..hq {
            for t in 0..sq {
                for c in 0..d {
                    q_logical[((bb * hq + h) * sq + t) * d + c] = q_r[at(sq, hq, (bb, t, h, c))];
                }
            }
        }
    }
    let seqs: Vec<cpu::SequenceKv> = (0..b)
        .map(|bb| {
            let mut kv = cpu::SequenceKv { k: Vec::new(), v: Vec::new(), len };
            for h in 0..hkv {
                for t in 0..len {
                    let (o, r) = place(bb, t);
                    let i = at(rows, hkv, (o, r, h, 0));
                    kv.k.extend_from_slice(&k_r[i..i + d]);
                    kv.v.extend_from_slice(&v_r[i..i + d]);
                }
            }
            kv
        })
        .collect();
    let sinks = args.model.sinks.map(|sink| vec![sink; hq]);
    let params = cpu::Params {
        scale: 1.0 / (d as f64).sqrt(),
        causal: options.causal,
        window: options.window,
        score: options.score,
        sinks: sinks.as_deref(),
        mask_table: None,
        bias: None,
    };
    let reference = cpu::decode(&q_logical, &seqs, (hq, hkv, sq, d), params)?;
    let out = ctx.attention_with_kv_cache(q, cache, None, options)?;
    let o_host = to_f32_vec(&out.o.to_host()?);
    let mut o = vec![0.0; o_host.len()];
    for bb in 0..b {
        for h in 0..hq {
            for t in 0..sq {
                for c in 0..d {
                    o[((bb * hq + h) * sq + t) * d + c] = o_host[at(sq, hq, (bb, t, h, c))];
                }
            }
        }
    }
    let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), lse_error(&out.lse.to_host()?, &reference.lse));
    let tolerance = Tolerance::of(T::DTYPE);
    let pass = err_o <= tolerance.o && err_lse <= tolerance.lse;
    println!(
        "check: relative L2 error O {err_o:.2e} (≤ {:.0e}), LSE {err_lse:.2e} (≤ {:.0e}): {}",
        tolerance.o,
        tolerance.lse,
        if pass { "PASS" } else { "FAIL" }
    );
    if pass { Ok(()) } else { Err(Error::CheckFailed { failed: 1, rows: 1, what: "decode against the f64 reference" }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default head_dim: 128 wherever its decoder fits (an H200, the 99 KiB RTX cards), the
    /// T4's 64 where it does not, and 128 again where nothing fits (the decoder's error says why).
    #[test]
    fn default_head_dim_follows_the_shared_memory() {
        for dtype in [DType::F16, DType::Bf16] {
            assert_eq!(largest_fitting_head_dim(dtype, 128, 227 * 1024), 128);
            assert_eq!(largest_fitting_head_dim(dtype, 128, 99 * 1024), 128);
            assert_eq!(largest_fitting_head_dim(dtype, 128, 64 * 1024), 64);
            assert_eq!(largest_fitting_head_dim(dtype, 128, 1024), 128);
        }
    }
}

//! Launches every kernel of the PTX modules, at small shapes chosen to be awkward (ragged tails in
//! both sequence lengths, a causal mask with seqlen_q ≠ seqlen_k or a sliding window, a GQA group;
//! each sm_80 flash case again with a document mask, which runs the kernels' `_table` twins), and
//! checks every result against the CPU reference. It is the workload of `scripts/sanitize`
//! (compute-sanitizer's memcheck, racecheck, synccheck and initcheck), and a quick smoke test for
//! a new GPU. It fails unless it has launched every kernel the registry lists that this device
//! can run: a Turing GPU has no `bf16` kernels, and a tile whose shared memory is above the
//! device's limit per block (a T4's 64 KiB, a 99 KiB RTX card's; or a profile's cap,
//! `RUST_ATTENTION_GPU_PROFILE`) is left out, with a count in the last line.
//!
//! `every-kernel [cpu-emulated]`: the GPU (device 0) on its sm_80 path (`KernelPath::Sm80`, even
//! on an H200), or the CPU emulator.

use std::collections::BTreeSet;
use std::process::ExitCode;

use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::kernels::{DECODE_INSTANCES, DecodeInstance, FLASH_INSTANCES, entry};
use attn_host::{
    AttentionOptions, AttentionShape, Causal, Context, DType, DecodeOptions, DeviceTensor, DqAccumulation, Element,
    Error, FlashKernel as Family, KernelPath, KvCache, Layout, MaskTable, Result, TileConfig, cpu,
};

/// The query length of the flash cases without a table (those with the document mask, which is
/// square, run `KEYS` queries).
const QUERIES: usize = 37;
/// The key length of every flash case.
const KEYS: usize = 45;

/// The documents of the table cases, as `cu_seqlens` over the `KEYS` tokens: boundaries that cut
/// every tile of the compiled sizes off its start.
const DOCUMENTS: [i32; 4] = [0, 13, 30, KEYS as i32];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("every-kernel: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Fails with a message when `err` exceeds `tolerance` (or is NaN).
fn within(what: &str, err: f64, tolerance: f64) -> Result<()> {
    if err <= tolerance {
        Ok(())
    } else {
        Err(Error::Shape(format!("{what}: relative error {err:.2e} above {tolerance:.0e}")))
    }
}

fn run() -> Result<()> {
    let ctx = match std::env::args().nth(1).as_deref() {
        Some("cpu-emulated") => Context::cpu_emulated(),
        // The sm_80 path: on an H200 the sm_90a path would run its Hopper kernels in place of
        // the sm_80 ones at the built-in default tiles, and those would go unchecked.
        _ => Context::new(0)?.with_kernel_path(KernelPath::Sm80)?,
    };
    println!("every-kernel on {}", ctx.device().name);
    let mut launched: BTreeSet<&'static str> = BTreeSet::new();
    let mut beyond = beyond_device(&ctx);
    let documents = ctx.document_mask_from_cu_seqlens(&DOCUMENTS)?;

    // The KV-cache decoders first: a handful of launches.
    let mut decoders = BTreeSet::new();
    decoder_kernels::<attn_host::f16>(&ctx, &mut launched, &mut decoders)?;
    if ctx.device().supports(DType::Bf16) {
        decoder_kernels::<attn_host::bf16>(&ctx, &mut launched, &mut decoders)?;
    }
    println!("every-kernel: the decoders match the CPU reference ({} of them)", decoders.len());

    // Vector add, with a ragged tail.
    let n = 1003;
    let (a, b) = (random_normal(n, 1), random_normal(n, 2));
    let c = ctx.vector_add(&ctx.upload(&a, &[n])?, &ctx.upload(&b, &[n])?)?.to_host()?;
    within("vector_add", relative_l2_error(&c, &cpu::vector_add(&a, &b)?), 1e-7)?;
    launched.insert(entry::VECTOR_ADD_F32);

    let f32_cases = TileConfig::compiled_head_dims_for(DType::F32).into_iter().enumerate();
    for ((i, head_dim), table) in f32_cases.flat_map(|case| [(case, None), (case, Some(&documents))]) {
        let (options, seqlen_q) = mask(i, table);
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k: KEYS, head_dim };
        let host = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()]
            .iter()
            .enumerate()
            .map(|(i, s)| random_normal(s.iter().product(), 10 * head_dim as u64 + i as u64))
            .collect::<Vec<_>>();
        let [q, k, v, d_o] = [&host[0], &host[1], &host[2], &host[3]];
        let (dq, dk, dv, ddo) = (
            ctx.upload(q, &shape.q_shape())?,
            ctx.upload(k, &shape.kv_shape())?,
            ctx.upload(v, &shape.kv_shape())?,
            ctx.upload(d_o, &shape.q_shape())?,
        );
        let params = cpu::Params::of(&options, head_dim);
        let forward = cpu::attention(q, k, v, &shape, params)?;
        let backward = cpu::attention_backward(q, k, v, d_o, &shape, params)?;
        let check_forward = |what: &str, out: &attn_host::AttentionOutput| -> Result<()> {
            within(&format!("{what} O"), relative_l2_error(&out.o.to_host()?, &forward.o), 1e-5)?;
            within(&format!("{what} LSE"), lse_error(&out.lse.to_host()?, &forward.lse), 1e-5)
        };
        let check_backward = |what: &str, g: &attn_host::Gradients| -> Result<()> {
            within(&format!("{what} dQ"), relative_l2_error(&g.dq.to_host()?, &backward.dq), 1e-4)?;
            within(&format!("{what} dK"), relative_l2_error(&g.dk.to_host()?, &backward.dk), 1e-4)?;
            within(&format!("{what} dV"), relative_l2_error(&g.dv.to_host()?, &backward.dv), 1e-4)
        };

        if head_dim == TileConfig::compiled_head_dims_for(DType::F32)[0] && table.is_none() {
            let out = ctx.attention_naive(&dq, &dk, &dv, &options)?;
            check_forward("naive forward", &out)?;
            check_backward("naive backward", &ctx.attention_naive_backward(&dq, &dk, &dv, &out.o, &ddo, &options)?)?;
            launched.extend([
                entry::NAIVE_SCORES_F32,
                entry::NAIVE_SOFTMAX_F32,
                entry::NAIVE_PV_F32,
                entry::FLASH_BWD_PREPROCESS_F32,
                entry::NAIVE_PT_X_F32,
                entry::NAIVE_DS_F32,
            ]);
        }

        if head_dim == TileConfig::compiled_head_dims_for(DType::F32)[0] && table.is_none() {
            // Attention sinks: the forward's extra term and their gradient's own kernel.
            let sinks: Vec<f32> = random_normal(shape.num_heads_q, 7).iter().map(|x| 1.0 + x).collect();
            let device_sinks = ctx.upload(&sinks, &[shape.num_heads_q])?;
            let with_sinks = options.with_sinks(&device_sinks);
            let params = cpu::Params { sinks: Some(&sinks), ..params };
            let (forward, backward) =
                (cpu::attention(q, k, v, &shape, params)?, cpu::attention_backward(q, k, v, d_o, &shape, params)?);
            let tile = ctx.default_tile(DType::F32, head_dim);
            let out = ctx.flash_attention_forward(&dq, &dk, &dv, &with_sinks, tile)?;
            within("sinks forward O", relative_l2_error(&out.o.to_host()?, &forward.o), 1e-5)?;
            let grads = ctx.flash_attention_backward(
                &dq,
                &dk,
                &dv,
                &out.o,
                &out.lse,
                &ddo,
                &with_sinks,
                ctx.default_backward_tile(DType::F32, head_dim, DqAccumulation::Deterministic),
                DqAccumulation::Deterministic,
            )?;
            let d_sinks = grads.d_sinks.as_ref().expect("a problem with sinks has their gradient").to_host()?;
            within("sinks backward dQ", relative_l2_error(&grads.dq.to_host()?, &backward.dq), 1e-4)?;
            within("sinks backward dSinks", relative_l2_error(&d_sinks, &backward.d_sinks), 1e-4)?;
            launched.insert(entry::FLASH_BWD_SINK_GRADIENT);
        }

        // The backward's O and LSE come from the tile the context picks (one that fits the device).
        let default_tile = ctx.default_tile(DType::F32, head_dim);
        if runnable(&mut beyond, table, default_tile, &[Family::Forward], DType::F32, head_dim)?.is_none() {
            continue;
        }
        let base = ctx.flash_attention_forward(&dq, &dk, &dv, &options, default_tile)?;
        for tile in TileConfig::compiled(head_dim) {
            let name = format!(
                "d{head_dim} m{} n{}{}",
                tile.block_m,
                tile.block_n,
                if table.is_some() { " table" } else { "" }
            );
            if let Some(entries) = runnable(&mut beyond, table, tile, &[Family::Forward], DType::F32, head_dim)? {
                check_forward(
                    &format!("flash forward {name}"),
                    &ctx.flash_attention_forward(&dq, &dk, &dv, &options, tile)?,
                )?;
                launched.extend(entries);
            }
            for (mode, families) in BACKWARD_MODES {
                if let Some(entries) = runnable(&mut beyond, table, tile, families, DType::F32, head_dim)? {
                    let grads =
                        ctx.flash_attention_backward(&dq, &dk, &dv, &base.o, &base.lse, &ddo, &options, tile, mode)?;
                    check_backward(&format!("flash backward {mode:?} {name}"), &grads)?;
                    launched.extend(entries);
                }
            }
        }
    }

    tensor_core_kernels::<attn_host::f16>(&ctx, &documents, &mut beyond, &mut launched)?;
    if ctx.device().supports(DType::Bf16) {
        tensor_core_kernels::<attn_host::bf16>(&ctx, &documents, &mut beyond, &mut launched)?;
    }

    // Every kernel this device can run, but of the decoders only those a decoding step picks on
    // it (the deepest ring that fits; `RUST_ATTENTION_DECODE_STAGES` runs the others).
    let flash = FLASH_INSTANCES.iter().flat_map(|i| [i.entry, twin(i.entry)]);
    let registry: BTreeSet<&'static str> = entry::ALL.iter().copied().chain(flash).chain(decoders).collect();
    let all: BTreeSet<&'static str> = registry.difference(&beyond).copied().collect();
    let missed: Vec<_> = all.difference(&launched).collect();
    if !missed.is_empty() {
        return Err(Error::Shape(format!("kernels never launched: {missed:?}")));
    }
    let left_out = match registry.len() - all.len() {
        0 => String::new(),
        n => format!(" ({n} more left out: beyond what this device runs, its types and shared memory)"),
    };
    println!(
        "every-kernel: {} of {} kernels launched{left_out}, every result matches the CPU reference",
        launched.len(),
        all.len()
    );
    Ok(())
}

/// The registry's kernels this device cannot run, which the program leaves out: every kernel of
/// a type it lacks (`bf16` on Turing: [`attn_host::DeviceInfo::supports`]; the kernels that are
/// not flash instances by their names, as the module lookup tells them), and every flash tile,
/// with its band-table twin, whose shared memory is above the device's limit per block.
fn beyond_device(ctx: &Context) -> BTreeSet<&'static str> {
    let device = ctx.device();
    let mut beyond = BTreeSet::new();
    for i in FLASH_INSTANCES {
        let bytes = i.kernel.shared_memory_bytes(i.dtype, i.block_m, i.block_n, i.head_dim, i.stages);
        if !device.supports(i.dtype) || bytes > device.max_shared_memory_per_block {
            beyond.extend([i.entry, twin(i.entry)]);
        }
    }
    if !device.supports(DType::Bf16) {
        beyond.extend(entry::ALL.iter().copied().filter(|e| e.contains("_bf16")));
        beyond.extend(DECODE_INSTANCES.iter().filter(|i| i.dtype == DType::Bf16).map(|i| i.entry));
    }
    beyond
}

/// The backward's dQ modes and the kernels each launches.
const BACKWARD_MODES: [(DqAccumulation, &[Family]); 2] = [
    (DqAccumulation::Atomic, &[Family::Backward]),
    (DqAccumulation::Deterministic, &[Family::BackwardDkDv, Family::BackwardDq]),
];

/// The entries that `families` launch together at this tile (with `table`, their twins), or
/// `None` where the device cannot run one of them (`beyond`, from [`beyond_device`]). Then the
/// others are added to `beyond`: they cannot be launched alone (the deterministic backward is
/// its dK/dV kernel and its dQ kernel, and the one that fits is left out with the one that does
/// not).
///
/// # Errors
/// A tile that is not compiled for `dtype` and `head_dim` ([`TileConfig::compiled_entry_for`]).
fn runnable(
    beyond: &mut BTreeSet<&'static str>,
    table: Option<&MaskTable>,
    tile: TileConfig,
    families: &[Family],
    dtype: DType,
    head_dim: usize,
) -> Result<Option<Vec<&'static str>>> {
    let entries: Vec<&'static str> = families
        .iter()
        .map(|&family| tile.compiled_entry_for(family, dtype, head_dim).map(|e| twin_if(table, e)))
        .collect::<Result<_>>()?;
    if entries.iter().all(|e| !beyond.contains(e)) {
        return Ok(Some(entries));
    }
    beyond.extend(entries);
    Ok(None)
}

/// The mask of the `i`-th case and its query length: a bottom-right causal mask, or every other
/// case a sliding window of 7 keys before and 3 after the diagonal (on 37 × 45, narrower than
/// every key tile, so that tiles are skipped at both ends); with `table`, that mask and the
/// document mask together, on `KEYS` × `KEYS`.
fn mask(i: usize, table: Option<&MaskTable>) -> (AttentionOptions<'_>, usize) {
    let options = if i.is_multiple_of(2) {
        AttentionOptions::causal(Causal::BottomRight)
    } else {
        AttentionOptions::default().with_window(attn_host::SlidingWindow::new(Some(7), Some(3)))
    };
    match table {
        Some(table) => (options.with_mask_table(table), KEYS),
        None => (options, QUERIES),
    }
}

/// `entry`, or with a table its band-table twin (the kernel a problem with a table launches).
fn twin_if(table: Option<&MaskTable>, entry: &'static str) -> &'static str {
    match table {
        Some(_) => twin(entry),
        None => entry,
    }
}

/// The band-table twin of flash kernel `entry` ([`attn_host::kernels::table_twin`]).
fn twin(entry: &str) -> &'static str {
    // The names live as long as the program: a few hundred short strings.
    Box::leak(attn_host::kernels::table_twin(entry).into_boxed_str())
}

/// Every tensor-core instance for `T` (forward tiles, backward tiles in both dQ modes), with the
/// preprocessing and dQ-conversion kernels, on the same awkward shape, checked against the CPU
/// reference on the rounded inputs at the tolerances of the tests.
fn tensor_core_kernels<T: Element>(
    ctx: &Context,
    documents: &MaskTable,
    beyond: &mut BTreeSet<&'static str>,
    launched: &mut BTreeSet<&'static str>,
) -> Result<()> {
    let dtype = T::DTYPE;
    let (o_tolerance, grad_tolerance) = if dtype == DType::Bf16 { (1e-2, 2e-2) } else { (3e-3, 1e-2) };
    // Each compiled head_dim runs its exact instances, and 3 less its padded ones (with rows that
    // are not 16-byte aligned, the hardest case of the padded copies).
    let head_dims = TileConfig::compiled_head_dims_for(dtype).into_iter().flat_map(|d| [d, d - 3]);
    for ((i, head_dim), table) in head_dims.enumerate().flat_map(|case| [(case, None), (case, Some(documents))]) {
        let (options, seqlen_q) = mask(i, table);
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k: KEYS, head_dim };
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let host: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| to_f32_vec(&from_f32_slice::<T>(&random_normal(s.iter().product(), 20 + i as u64))))
            .collect();
        let device: Vec<DeviceTensor<T>> =
            (0..4).map(|i| ctx.upload(&from_f32_slice::<T>(&host[i]), &shapes[i])).collect::<Result<_>>()?;
        let (q, k, v, d_o) = (&device[0], &device[1], &device[2], &device[3]);
        let params = cpu::Params::of(&options, head_dim);
        let forward = cpu::attention(&host[0], &host[1], &host[2], &shape, params)?;
        let backward = cpu::attention_backward(&host[0], &host[1], &host[2], &host[3], &shape, params)?;
        let widened = |t: &DeviceTensor<T>| t.to_host().map(|x| to_f32_vec(&x));
        let table_name = if table.is_some() { " table" } else { "" };
        for tile in TileConfig::compiled_for(Family::Forward, dtype, head_dim) {
            let Some(entries) = runnable(beyond, table, tile, &[Family::Forward], dtype, head_dim)? else { continue };
            let what = format!("{dtype} flash forward d{head_dim} {tile}{table_name}");
            let out = ctx.flash_attention_forward(q, k, v, &options, tile)?;
            within(&format!("{what} O"), relative_l2_error(&widened(&out.o)?, &forward.o), o_tolerance)?;
            within(&format!("{what} LSE"), lse_error(&out.lse.to_host()?, &forward.lse), 1e-4)?;
            launched.extend(entries);
        }
        // The backward's O and LSE come from the tile the context picks (one that fits the
        // device, where any does).
        let default_tile = ctx.default_tile(dtype, head_dim);
        if runnable(beyond, table, default_tile, &[Family::Forward], dtype, head_dim)?.is_none() {
            continue;
        }
        let out = ctx.flash_attention_forward(q, k, v, &options, default_tile)?;
        for tile in TileConfig::compiled_for(Family::Backward, dtype, head_dim) {
            for (mode, families) in BACKWARD_MODES {
                let Some(entries) = runnable(beyond, table, tile, families, dtype, head_dim)? else { continue };
                let what = format!("{dtype} flash backward {mode:?} d{head_dim} {tile}{table_name}");
                let g = ctx.flash_attention_backward(q, k, v, &out.o, &out.lse, d_o, &options, tile, mode)?;
                within(&format!("{what} dQ"), relative_l2_error(&widened(&g.dq)?, &backward.dq), grad_tolerance)?;
                within(&format!("{what} dK"), relative_l2_error(&widened(&g.dk)?, &backward.dk), grad_tolerance)?;
                within(&format!("{what} dV"), relative_l2_error(&widened(&g.dv)?, &backward.dv), grad_tolerance)?;
                launched.extend(entries);
            }
        }
    }
    launched.extend(match dtype {
        DType::Bf16 => [entry::FLASH_BWD_PREPROCESS_BF16, entry::FLASH_BWD_CONVERT_DQ_BF16],
        _ => [entry::FLASH_BWD_PREPROCESS_F16, entry::FLASH_BWD_CONVERT_DQ_F16],
    });
    Ok(())
}

/// A decoding step (level 10) at every compiled decoder head_dim and 3 less (padding columns),
/// contiguous token-major cache, GQA, two sequences of different lengths, bottom-right causal
/// over two queries, two new K/V rows appended, unsplit and split in 3 (the merge): O and LSE
/// against `cpu::decode`. Adds the decoders that ran to `decoders`.
fn decoder_kernels<T: Element>(
    ctx: &Context,
    launched: &mut BTreeSet<&'static str>,
    decoders: &mut BTreeSet<&'static str>,
) -> Result<()> {
    let (hq, hkv, sq, new, capacity, layout) = (4, 2, 2, 2, 320, Layout::Bshd);
    let cached = [37usize, 290];
    let batch = cached.len();
    let o_tolerance = if T::DTYPE == DType::Bf16 { 1e-2 } else { 3e-3 };
    let round = |x: Vec<f32>| to_f32_vec(&from_f32_slice::<T>(&x));
    let mut dims: Vec<usize> = DECODE_INSTANCES.iter().filter(|i| i.dtype == T::DTYPE).map(|i| i.head_dim).collect();
    dims.dedup();
    for d in dims.iter().flat_map(|&d| [d, d - 3]) {
        // A head_dim whose decoders all need more shared memory than the device has (a T4
        // holds them up to 64) is left out; anything else that fails, fails the run.
        let candidates = DECODE_INSTANCES.iter().filter(|i| i.dtype == T::DTYPE && i.head_dim >= d);
        let limit = ctx.device().max_shared_memory_per_block;
        if !candidates.clone().any(|i| i.shared_memory_bytes() <= limit) {
            let needed = candidates.map(DecodeInstance::shared_memory_bytes).min().unwrap_or(0);
            println!(
                "every-kernel: {} decoder d{d} left out: it needs {needed} bytes of shared memory, this device has {limit}",
                T::DTYPE
            );
            continue;
        }
        let seed = 1000 * d as u64;
        let q_logical = round(random_normal(batch * hq * sq * d, seed));
        let seqs: Vec<cpu::SequenceKv> = cached
            .iter()
            .enumerate()
            .map(|(b, &c)| {
                let len = c + new;
                let k = round(random_normal(hkv * len * d, seed + 2 * b as u64 + 1));
                cpu::SequenceKv { k, v: round(random_normal(hkv * len * d, seed + 2 * b as u64 + 2)), len }
            })
            .collect();
        // Q, the cache (each sequence's first `cached` keys) and the new rows, token-major.
        let mut q = vec![0.0f32; q_logical.len()];
        let (mut k_cache, mut v_cache) =
            (vec![0.0f32; batch * capacity * hkv * d], vec![0.0; batch * capacity * hkv * d]);
        let (mut k_new, mut v_new) = (vec![0.0f32; batch * new * hkv * d], vec![0.0; batch * new * hkv * d]);
        for b in 0..batch {
            for c in 0..d {
                for h in 0..hq {
                    for t in 0..sq {
                        q[layout.offset((sq, hq, d), (b, t, h, c))] = q_logical[((b * hq + h) * sq + t) * d + c];
                    }
                }
                let seq = &seqs[b];
                for h in 0..hkv {
                    for t in 0..seq.len {
                        let (k, v) = (seq.k[(h * seq.len + t) * d + c], seq.v[(h * seq.len + t) * d + c]);
                        if t < cached[b] {
                            let at = layout.offset((capacity, hkv, d), (b, t, h, c));
                            (k_cache[at], v_cache[at]) = (k, v);
                        } else {
                            let at = layout.offset((new, hkv, d), (b, t - cached[b], h, c));
                            (k_new[at], v_new[at]) = (k, v);
                        }
                    }
                }
            }
        }
        let params = cpu::Params {
            scale: 1.0 / (d as f64).sqrt(),
            causal: Causal::BottomRight,
            window: None,
            score: Default::default(),
            sinks: None,
            mask_table: None,
            bias: None,
        };
        let reference = cpu::decode(&q_logical, &seqs, (hq, hkv, sq, d), params)?;
        let upload = |x: &[f32], s: usize, h: usize| ctx.upload(&from_f32_slice::<T>(x), &layout.shape(batch, s, h, d));
        let (qd, kn, vn) = (upload(&q, sq, hq)?, upload(&k_new, new, hkv)?, upload(&v_new, new, hkv)?);
        let lens: Vec<i32> = cached.iter().map(|&c| c as i32).collect();
        let lens = ctx.upload(&lens, &[batch])?;
        for splits in [1, 3] {
            // A fresh cache for each step: the append writes into it.
            let (mut kc, mut vc) = (upload(&k_cache, capacity, hkv)?, upload(&v_cache, capacity, hkv)?);
            let mut cache = KvCache { k: &mut kc, v: &mut vc, seqlens: Some(&lens), block_table: None };
            let options =
                DecodeOptions { causal: Causal::BottomRight, layout, num_splits: Some(splits), ..Default::default() };
            let plan = ctx.decode_plan(&qd, &cache, Some((&kn, &vn)), &options)?;
            let out = ctx.attention_with_kv_cache(&qd, &mut cache, Some((&kn, &vn)), &options)?;
            // O back in the reference's head-major order.
            let o_host = to_f32_vec(&out.o.to_host()?);
            let mut o = vec![0.0f32; o_host.len()];
            for b in 0..batch {
                for h in 0..hq {
                    for t in 0..sq {
                        for c in 0..d {
                            o[((b * hq + h) * sq + t) * d + c] = o_host[layout.offset((sq, hq, d), (b, t, h, c))];
                        }
                    }
                }
            }
            let what = format!("{} decoder d{d} ({}, splits {splits})", T::DTYPE, plan.entry);
            within(&format!("{what} O"), relative_l2_error(&o, &reference.o), o_tolerance)?;
            within(&format!("{what} LSE"), lse_error(&out.lse.to_host()?, &reference.lse), 1e-4)?;
            launched.insert(plan.entry);
            decoders.insert(plan.entry);
        }
    }
    launched.extend([entry::DECODE_APPEND_KV]);
    launched.extend(match T::DTYPE {
        DType::Bf16 => [entry::DECODE_MERGE_BF16],
        _ => [entry::DECODE_MERGE_F16],
    });
    Ok(())
}

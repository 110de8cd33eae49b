//! Masks given per token ([`attn_host::MaskTable`]: document masks, prefix-LM; the band table
//! of `kernels/src/attention/mask.rs`) on the GPU, forward and backward, against the float64
//! reference: the `f32` flash kernels in both dQ modes, and the 16-bit kernels that the
//! context's kernel path runs with the built-in tiles (`mma.sync` on the sm_80 path, `wgmma` on
//! sm_90a), `f16` and `bf16`, both dQ modes (the deterministic Hopper backward's turns follow
//! the table's tile ranges); packed pretraining rows (documents of 1 to 700 tokens, different
//! in every batch entry, causal and with a sliding window), one row from `cu_seqlens`, GQA,
//! prefix-LM, head dims between the compiled ones, and grids deep enough for the Hopper
//! forward's three consumers; packed batches whose queries and keys differ in length
//! ([`Context::varlen_mask`]: chunked prefill, with a window, and cross-attention).

mod common;

use attn_host::check::random_normal;
use attn_host::{
    AttentionOptions, AttentionShape, Causal, Context, DType, DqAccumulation, MaskTable, SlidingWindow, TileConfig,
    bf16, f16,
};
use common::attention::{Kernel, check};
use common::gpu;
use common::tensor_cores::{Inputs, check16};

fn shape(batch: usize, heads_q: usize, heads_kv: usize, seqlen: usize, d: usize) -> AttentionShape {
    AttentionShape {
        batch,
        num_heads_q: heads_q,
        num_heads_kv: heads_kv,
        seqlen_q: seqlen,
        seqlen_k: seqlen,
        head_dim: d,
    }
}

/// Packed rows: each batch entry cut into documents of random lengths from 1 to `longest`
/// tokens (the seed makes every entry's cuts its own).
fn packed_documents(ctx: &Context, batch: usize, seqlen: usize, longest: usize, seed: u64) -> MaskTable {
    let draws = random_normal(batch * seqlen, seed);
    let mut ids = Vec::with_capacity(batch * seqlen);
    for b in 0..batch {
        let (mut document, mut left) = (0, 0usize);
        for t in 0..seqlen {
            if left == 0 {
                document += 1;
                // 1 ..= longest tokens, from one normal draw.
                left = 1 + ((draws[b * seqlen + t].abs() * longest as f32 / 2.5) as usize).min(longest - 1);
            }
            ids.push(document);
            left -= 1;
        }
    }
    ctx.document_mask(&ids, [batch, seqlen]).unwrap()
}

#[test]
fn f32_kernels_take_mask_tables() {
    let Some(ctx) = gpu("f32_kernels_take_mask_tables") else { return };
    let docs = packed_documents(ctx, 2, 300, 120, 1000);
    let prefix = ctx.prefix_lm_mask(&[0, 77], 300).unwrap();
    let cases = [
        (shape(2, 6, 2, 300, 64), AttentionOptions::causal(Causal::TopLeft).with_mask_table(&docs)),
        (shape(2, 4, 4, 300, 32), AttentionOptions::default().with_mask_table(&docs)),
        (shape(2, 4, 1, 300, 128), AttentionOptions::default().with_mask_table(&prefix)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            let tile = TileConfig::default_for_dtype(DType::F32, shape.head_dim);
            check(ctx, shape, Kernel::Flash(tile, mode), options, 1010 + i as u64, true);
        }
    }
}

#[test]
fn tensor_core_kernels_take_mask_tables() {
    let Some(ctx) = gpu("tensor_core_kernels_take_mask_tables") else { return };
    let window = SlidingWindow::new(Some(255), Some(0));
    let pretraining = packed_documents(ctx, 2, 2048, 700, 1020);
    let deep = packed_documents(ctx, 3, 1100, 300, 1021);
    let short = packed_documents(ctx, 4, 333, 90, 1022);
    let packed = ctx.document_mask_from_cu_seqlens(&[0, 1, 200, 200, 577, 1000]).unwrap();
    let prefix = ctx.prefix_lm_mask(&[0, 64, 500, 700], 700).unwrap();
    let causal = AttentionOptions::causal(Causal::TopLeft);
    let cases = [
        // Packed pretraining: GQA, causal documents, and a sliding window inside them.
        (shape(2, 16, 4, 2048, 64), causal.with_mask_table(&pretraining)),
        (shape(2, 8, 8, 2048, 128), causal.with_window(window).with_mask_table(&pretraining)),
        (shape(4, 4, 2, 333, 96), AttentionOptions::default().with_mask_table(&short)),
        (shape(1, 8, 2, 1000, 128), causal.with_mask_table(&packed)),
        (shape(4, 6, 6, 700, 80), AttentionOptions::default().with_mask_table(&prefix)),
        (shape(4, 4, 2, 700, 256), AttentionOptions::with_scale(0.25).with_softcap(2.0).with_mask_table(&prefix)),
        // Deep enough for the Hopper forward's three consumers at head_dim 64.
        (shape(3, 16, 4, 1100, 64), causal.with_mask_table(&deep)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let fwd = TileConfig::default_for_dtype(DType::F16, shape.head_dim);
        let bwd = TileConfig::default_backward_for_dtype(DType::F16, shape.head_dim);
        let seed = 1030 + 2 * i as u64;
        let atomic = Some((bwd, DqAccumulation::Atomic));
        let deterministic = Some((bwd, DqAccumulation::Deterministic));
        check16::<f16>(ctx, shape, fwd, atomic, options, seed, Inputs::Normal);
        check16::<bf16>(ctx, shape, fwd, deterministic, options, seed + 1, Inputs::Normal);
    }
}

/// `cu_seqlens` of `count` sequences of `min ..= max` tokens (from normal draws of `seed`).
fn offsets(count: usize, (min, max): (usize, usize), seed: u64) -> Vec<i32> {
    let draws = random_normal(count, seed);
    let mut cu = vec![0i32];
    for x in draws {
        let length = min + ((x.abs() * (max - min) as f32 / 2.5) as usize).min(max - min);
        cu.push(cu.last().unwrap() + length as i32);
    }
    cu
}

#[test]
fn varlen_batches_with_their_own_lengths() {
    let Some(ctx) = gpu("varlen_batches_with_their_own_lengths") else { return };
    // Chunked prefill: 1-200 new queries per sequence against a cache of 0-1500 keys and
    // themselves, bottom-right causal; with a window of 256 keys the older ones are seen by no
    // query (gaps: the deterministic backward leaves the Hopper kernel then).
    let new = offsets(8, (1, 200), 1100);
    let cached = offsets(8, (0, 1500), 1101);
    let cu_k: Vec<i32> = new.iter().zip(&cached).map(|(n, c)| n + c).collect();
    let prefill = ctx.varlen_mask(&new, &cu_k, Causal::BottomRight, None).unwrap();
    let window = Some(SlidingWindow::new(Some(255), Some(0)));
    let local = ctx.varlen_mask(&new, &cu_k, Causal::BottomRight, window).unwrap();
    // Cross-attention: 1-300 queries against 1-300 keys, no mask.
    let cross = ctx.varlen_mask(&offsets(6, (1, 300), 1102), &offsets(6, (1, 300), 1103), Causal::None, None).unwrap();
    let varlen = |table: &MaskTable, heads_q, heads_kv, d| {
        let [batch, seqlen_q, seqlen_k] = table.dims();
        AttentionShape { batch, num_heads_q: heads_q, num_heads_kv: heads_kv, seqlen_q, seqlen_k, head_dim: d }
    };
    let options = |table| AttentionOptions::default().with_mask_table(table);
    let cases = [
        (varlen(&prefill, 16, 4, 128), options(&prefill)),
        (varlen(&local, 8, 2, 64), options(&local)),
        (varlen(&cross, 4, 4, 96), options(&cross)),
        (varlen(&prefill, 4, 1, 64), options(&prefill).with_softcap(20.0)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let fwd = TileConfig::default_for_dtype(DType::F16, shape.head_dim);
        let bwd = TileConfig::default_backward_for_dtype(DType::F16, shape.head_dim);
        let seed = 1110 + 4 * i as u64;
        check16::<f16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Atomic)), options, seed, Inputs::Normal);
        check16::<bf16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Deterministic)), options, seed + 1, Inputs::Normal);
        if shape.head_dim <= 128 {
            let tile = TileConfig::default_for_dtype(DType::F32, shape.head_dim);
            check(ctx, shape, Kernel::Flash(tile, DqAccumulation::Deterministic), options, seed + 2, true);
        }
    }
    hopper_deterministic_takes_a_table_without_gaps(ctx, &prefill);
}

/// The selection runs a varlen table's deterministic backward on the sm_80 kernels (faster
/// there; with gaps the only correct choice), so `check16` above never reaches the Hopper
/// deterministic kernel with one. Called by name it takes a table without gaps: its gradients
/// must agree with the sm_80 kernels' to bf16's rounding, and two runs must be bit-identical.
fn hopper_deterministic_takes_a_table_without_gaps(ctx: &Context, table: &MaskTable) {
    use attn_host::dtype::{from_f32_slice, to_f32_vec};
    if ctx.kernel_path() != attn_host::KernelPath::Sm90a {
        return;
    }
    let [batch, seqlen_q, seqlen_k] = table.dims();
    let shape = AttentionShape { batch, num_heads_q: 8, num_heads_kv: 2, seqlen_q, seqlen_k, head_dim: 128 };
    let options = AttentionOptions::default().with_mask_table(table);
    let mode = DqAccumulation::Deterministic;
    let tile = TileConfig::default_backward_for_dtype(DType::Bf16, 128);
    let label = ctx.backward_kernel_label(DType::Bf16, 128, tile, mode, &options);
    assert!(label.starts_with("sm_80"), "a varlen table's deterministic backward: {label}");
    let tensor = |dims: &[usize], seed| {
        let values = random_normal(dims.iter().product(), seed);
        ctx.upload(&from_f32_slice::<bf16>(&values), dims).unwrap()
    };
    let (q, k, v) = (tensor(&shape.q_shape(), 1130), tensor(&shape.kv_shape(), 1131), tensor(&shape.kv_shape(), 1132));
    let d_o = tensor(&shape.q_shape(), 1133);
    let fwd = TileConfig::default_for_dtype(DType::Bf16, 128);
    let out = ctx.flash_attention_forward(&q, &k, &v, &options, fwd).unwrap();
    let sm80 = ctx.flash_attention_backward(&q, &k, &v, &out.o, &out.lse, &d_o, &options, tile, mode).unwrap();
    let hopper = || ctx.flash_attention_backward_hopper(&q, &k, &v, &out.o, &out.lse, &d_o, &options, mode).unwrap();
    let (first, second) = (hopper(), hopper());
    for (name, ours, theirs, again) in [
        ("dQ", &first.dq, &sm80.dq, &second.dq),
        ("dK", &first.dk, &sm80.dk, &second.dk),
        ("dV", &first.dv, &sm80.dv, &second.dv),
    ] {
        let (ours, again) = (ours.to_host().unwrap(), again.to_host().unwrap());
        let bits = |t: &[bf16]| t.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        assert!(bits(&ours) == bits(&again), "{name}: the Hopper deterministic backward differs between two runs");
        let want: Vec<f64> = to_f32_vec(&theirs.to_host().unwrap()).iter().map(|&x| x as f64).collect();
        let error = attn_host::check::relative_l2_error(&to_f32_vec(&ours), &want);
        println!("varlen, Hopper deterministic against sm_80 deterministic, {name}: {error:.2e}");
        assert!(error < 1e-2, "{name}: {error:.3e}");
    }
}

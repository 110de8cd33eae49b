//! Every public entry point, given bad input, returns a typed error that names the argument and
//! leaves the context usable. These run on the CPU emulator, so they need no GPU: the checks
//! happen on the host before any launch, the same on both kinds of context.

use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Context, DqAccumulation, Error, Gradients, TileConfig,
};

fn tensors(ctx: &Context, shapes: &[&[usize]]) -> Vec<attn_host::DeviceTensor> {
    shapes.iter().map(|s| ctx.full(s, 0.25).unwrap()).collect()
}

#[test]
fn every_entry_point_rejects_bad_shapes_with_a_message() {
    let ctx = Context::cpu_emulated();
    let opts = AttentionOptions::default();
    let tile = TileConfig::new(16, 16);
    let (q_shape, kv_shape, lse_shape): (&[usize], &[usize], &[usize]) = (&[1, 2, 8, 32], &[1, 1, 6, 32], &[1, 2, 8]);
    let t = tensors(&ctx, &[q_shape, kv_shape, kv_shape, q_shape, lse_shape, q_shape]);
    let (q, k, v, o, lse, d_o) = (&t[0], &t[1], &t[2], &t[3], &t[4], &t[5]);
    let wrong = tensors(&ctx, &[&[1, 2, 8, 16], &[1, 2, 7], &[2, 1, 6, 32], &[1, 3, 6, 32], &[0, 2, 8, 32]]);
    let (wrong_dim, wrong_lse, wrong_batch, not_divisor, empty) =
        (&wrong[0], &wrong[1], &wrong[2], &wrong[3], &wrong[4]);

    let expect = |result: Result<(), Error>, needle: &str| {
        let err = result.expect_err(needle);
        assert!(err.to_string().contains(needle), "expected {needle:?} in: {err}");
    };
    // Q, K, V shapes.
    expect(ctx.flash_attention_forward(q, wrong_batch, wrong_batch, &opts, tile).map(drop), "batch");
    expect(ctx.flash_attention_forward(q, not_divisor, not_divisor, &opts, tile).map(drop), "not a multiple");
    // Empty problems run (the empty-row convention), but Q and K must still agree on the batch,
    // and K must have heads and every tensor a width.
    expect(ctx.flash_attention_forward(empty, k, v, &opts, tile).map(drop), "agree on batch");
    let no_heads = tensors(&ctx, &[&[1, 0, 6, 32]]);
    expect(
        ctx.flash_attention_forward(q, &no_heads[0], &no_heads[0], &opts, tile).map(drop),
        "num_heads_kv and head_dim",
    );
    expect(ctx.flash_attention_forward(q, k, q, &opts, tile).map(drop), "same shape");
    expect(ctx.attention_naive(wrong_dim, k, v, &opts).map(drop), "head_dim");
    // Outputs and gradients.
    let mut out = AttentionOutput { o: ctx.full(q_shape, 0.0).unwrap(), lse: ctx.full(&[1, 2, 7], 0.0).unwrap() };
    expect(ctx.flash_attention_forward_into(q, k, v, &mut out, &opts, tile), "`lse` must have shape");
    expect(
        ctx.flash_attention_backward(q, k, v, o, wrong_lse, d_o, &opts, tile, DqAccumulation::Atomic).map(drop),
        "`lse`",
    );
    expect(
        ctx.flash_attention_backward(q, k, v, o, lse, wrong_dim, &opts, tile, DqAccumulation::Atomic).map(drop),
        "`d_o`",
    );
    expect(ctx.attention_naive_backward(q, k, v, wrong_dim, d_o, &opts).map(drop), "`o`");
    let mut grads = Gradients {
        dq: ctx.full(q_shape, 0.0).unwrap(),
        dk: ctx.full(q_shape, 0.0).unwrap(), // should be K's shape
        dv: ctx.full(kv_shape, 0.0).unwrap(),
        d_sinks: None,
        d_bias: None,
    };
    let result =
        ctx.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, &opts, tile, DqAccumulation::Deterministic);
    expect(result, "`dk`");
    // Tiles and head dims.
    expect(ctx.flash_attention_forward(q, k, v, &opts, TileConfig::new(48, 16)).map(drop), "block_m ∈ {16, 32, 64}");
    // Above the largest compiled head_dim (256).
    let t300 = tensors(&ctx, &[&[1, 1, 8, 300]]);
    expect(ctx.flash_attention_forward(&t300[0], &t300[0], &t300[0], &opts, tile).map(drop), "head_dim=300");
    // Scales that are not finite.
    for scale in [f32::NAN, f32::INFINITY] {
        let bad = AttentionOptions::with_scale(scale);
        expect(ctx.flash_attention_forward(q, k, v, &bad, tile).map(drop), "scale must be finite");
        expect(ctx.attention_naive(q, k, v, &bad).map(drop), "scale must be finite");
        expect(ctx.attention_naive_backward(q, k, v, o, d_o, &bad).map(drop), "scale must be finite");
        let result = ctx.flash_attention_backward(q, k, v, o, lse, d_o, &bad, tile, DqAccumulation::Atomic);
        expect(result.map(drop), "scale must be finite");
    }
    // 16-bit tensors: head dims and tiles of the tensor-core kernels (stages are part of a tile).
    let h = |shape: &[usize]| ctx.upload(&vec![attn_host::f16::from_f32(0.5); shape.iter().product()], shape).unwrap();
    let (q16, k16) = (h(&[1, 2, 8, 64]), h(&[1, 1, 6, 64]));
    let d16 = TileConfig::default_for_dtype(attn_host::DType::F16, 64);
    expect(ctx.flash_attention_forward(&q16, &k16, &k16, &opts, TileConfig::new(64, 64)).map(drop), "stages=1");
    expect(ctx.flash_attention_forward(&q16, &k16, &k16, &opts, d16.with_stages(5)).map(drop), "stages=5");
    // A head_dim above 256 names the range; one below it on a tile without a padded instance
    // lists the tiles that run it.
    let q16_300 = h(&[1, 1, 8, 300]);
    expect(ctx.flash_attention_forward(&q16_300, &q16_300, &q16_300, &opts, d16).map(drop), "1 to 256");
    let q16_60 = h(&[1, 1, 8, 60]);
    let exact_only = TileConfig::new(64, 32).with_stages(2);
    expect(ctx.flash_attention_forward(&q16_60, &q16_60, &q16_60, &opts, exact_only).map(drop), "(128, 64, 2)");
    // The 16-bit backward above 256 names its range.
    let result = ctx.flash_attention_backward(
        &q16_300,
        &q16_300,
        &q16_300,
        &q16_300,
        &ctx.full(&[1, 1, 8], 0.0).unwrap(),
        &q16_300,
        &opts,
        d16,
        DqAccumulation::Deterministic,
    );
    expect(result.map(drop), "1 to 256");
    // Vector add and host copies.
    expect(ctx.vector_add(q, k).map(drop), "equal shapes");
    let mut copy = ctx.full(&[4], 0.0).unwrap();
    expect(copy.copy_from_host(&[1.0; 5]), "5");
    expect(ctx.upload(&[1.0; 3], &[2, 2]).map(drop), "4 elements");
    // Nothing was corrupted and the context still works.
    assert_eq!(q.to_host().unwrap(), vec![0.25; 2 * 8 * 32]);
    let out = ctx.flash_attention_forward(q, k, v, &opts, tile).unwrap();
    assert!(out.o.to_host().unwrap().iter().all(|&x| (x - 0.25).abs() < 1e-6));
}

#[test]
fn kernel_paths_parse_and_the_emulator_refuses_sm90a() {
    use attn_host::KernelPath;
    for (text, path) in [("sm80", KernelPath::Sm80), ("sm_80", KernelPath::Sm80), ("sm90a", KernelPath::Sm90a)] {
        assert_eq!(text.parse::<KernelPath>().unwrap(), path);
    }
    let err = "sm90".parse::<KernelPath>().unwrap_err();
    assert!(err.to_string().contains("use sm80 or sm90a"), "{err}");
    // The emulator runs the sm_80 kernels' source only: asking for sm_90a is a typed error, and
    // asking for sm_80 keeps the context.
    let ctx = Context::cpu_emulated();
    assert_eq!(ctx.kernel_path(), KernelPath::Sm80);
    let ctx = ctx.with_kernel_path(KernelPath::Sm80).unwrap();
    let err = ctx.with_kernel_path(KernelPath::Sm90a).err().expect("sm_90a on the emulator");
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    // Off sm_90a the forward runs the sm_80 kernel of the tile it is given; on the emulator from
    // its Rust source, which the label says (no sm_80 PTX runs there).
    let ctx = Context::cpu_emulated();
    let tile = TileConfig::default_for_dtype(attn_host::DType::F16, 64);
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q: 64, seqlen_k: 64, head_dim: 64 };
    assert!(
        ctx.forward_kernel_entry(attn_host::DType::F16, &shape, tile, &AttentionOptions::default())
            .unwrap()
            .starts_with("flash_fwd_f16")
    );
    assert!(
        ctx.forward_kernel_label(attn_host::DType::F16, &shape, tile, &AttentionOptions::default())
            == format!("emulated {tile}")
    );
    // A band table runs the entry's `_table` twin, which the entry names.
    let documents = ctx.document_mask(&[1i32; 64], [1, 64]).unwrap();
    let with_table = AttentionOptions::default().with_mask_table(&documents);
    let entry = ctx.forward_kernel_entry(attn_host::DType::F16, &shape, tile, &with_table).unwrap();
    assert!(entry.starts_with("flash_fwd_f16") && entry.ends_with("_table"), "{entry}");
}

/// The KV-cache decoder's checks: every bad argument is a typed error before any launch.
#[test]
fn the_decoder_rejects_bad_caches_with_a_message() {
    use attn_host::{DecodeOptions, KvCache, Layout, f16};
    let ctx = Context::cpu_emulated();
    let h = |shape: &[usize]| ctx.full(shape, f16::from_f32(0.5)).unwrap();
    let q = h(&[2, 1, 8, 64]); // [batch, seqlen_q, heads, head_dim], token-major
    let (mut k, mut v) = (h(&[2, 100, 2, 64]), h(&[2, 100, 2, 64]));
    let seqlens = ctx.upload(&[10i32, 20], &[2]).unwrap();
    let options = DecodeOptions { layout: Layout::Bshd, ..DecodeOptions::default() };
    let expect = |result: Result<attn_host::AttentionOutput<f16>, Error>, needle: &str| {
        let err = result.expect_err(needle);
        assert!(err.to_string().contains(needle), "expected {needle:?} in: {err}");
    };
    // A good call works, then each bad one fails with its reason.
    let mut cache = KvCache { k: &mut k, v: &mut v, seqlens: Some(&seqlens), block_table: None };
    ctx.attention_with_kv_cache(&q, &mut cache, None, &options).unwrap();
    let wrong_heads = h(&[2, 1, 7, 64]);
    expect(ctx.attention_with_kv_cache(&wrong_heads, &mut cache, None, &options), "not a multiple");
    let wrong_dim = h(&[2, 1, 8, 32]);
    expect(ctx.attention_with_kv_cache(&wrong_dim, &mut cache, None, &options), "head_dim");
    let wrong_batch = h(&[3, 1, 8, 64]);
    expect(ctx.attention_with_kv_cache(&wrong_batch, &mut cache, None, &options), "batch");
    let (k_new, v_new) = (h(&[2, 3, 2, 64]), h(&[2, 3, 2, 64]));
    let mut no_lengths = KvCache { k: cache.k, v: cache.v, seqlens: None, block_table: None };
    expect(ctx.attention_with_kv_cache(&q, &mut no_lengths, Some((&k_new, &v_new)), &options), "seqlens");
    // Pages must hold a multiple of 16 tokens; the table must match the batch.
    let (mut pk, mut pv) = (h(&[4, 24, 2, 64]), h(&[4, 24, 2, 64]));
    let table = ctx.upload(&[0i32, 1, 2, 3], &[2, 2]).unwrap();
    let mut paged = KvCache { k: &mut pk, v: &mut pv, seqlens: Some(&seqlens), block_table: Some(&table) };
    expect(ctx.attention_with_kv_cache(&q, &mut paged, None, &options), "multiple of 16");
    let (mut pk, mut pv) = (h(&[4, 32, 2, 64]), h(&[4, 32, 2, 64]));
    let short_table = ctx.upload(&[0i32, 1], &[1, 2]).unwrap();
    let mut paged = KvCache { k: &mut pk, v: &mut pv, seqlens: Some(&seqlens), block_table: Some(&short_table) };
    expect(ctx.attention_with_kv_cache(&q, &mut paged, None, &options), "block_table");
    // f32 is not the decoder's.
    let q32 = ctx.full(&[2, 1, 8, 64], 0.5f32).unwrap();
    let (mut k32, mut v32) = (ctx.full(&[2, 100, 2, 64], 0.5f32).unwrap(), ctx.full(&[2, 100, 2, 64], 0.5f32).unwrap());
    let mut cache32 = KvCache { k: &mut k32, v: &mut v32, seqlens: None, block_table: None };
    let err = ctx.attention_with_kv_cache(&q32, &mut cache32, None, &options).unwrap_err();
    assert!(err.to_string().contains("f16 or bf16"), "{err}");
}

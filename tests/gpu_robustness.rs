//! What the library does on inputs nobody planned for: device memory running out, tensors from
//! another context, offsets past 2³¹, huge logits, NaN and ∞ in the inputs, degenerate sizes.

mod common;

use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::{AttentionOptions, AttentionShape, Causal, Context, DType, DqAccumulation, Error, TileConfig, cpu};
use common::attention::{Kernel, Problem, check, poisoned_rows};
use common::{gpu, mha};
use rayon::prelude::*;
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

/// The out-of-memory test asks the device for far more memory than it has and compares the free
/// memory before and after the failed call. The harness runs tests on threads, so a test beside
/// it could fail an allocation of its own meanwhile (seen on the H200) or change the free memory
/// it measures: it holds this lock for writing, every other test here for reading.
static DEVICE_MEMORY: RwLock<()> = RwLock::new(());

/// A test's share of the device's memory ([`DEVICE_MEMORY`]); held until the test ends.
fn shared_memory() -> RwLockReadGuard<'static, ()> {
    DEVICE_MEMORY.read().unwrap_or_else(PoisonError::into_inner)
}

/// Naive attention at seqlen 65536 with 16 heads needs a 275 GB score matrix: the allocation
/// fails, the call returns an error, the memory it had already taken is given back, and the
/// context goes on working.
#[test]
fn out_of_memory_is_an_error_and_leaks_nothing() {
    let Some(ctx) = gpu("out_of_memory_is_an_error_and_leaks_nothing") else { return };
    let _alone = DEVICE_MEMORY.write().unwrap_or_else(PoisonError::into_inner);
    let shape = mha(1, 16, 65_536, 64);
    let q = ctx.full(&shape.q_shape(), 0.5).unwrap();
    // The free memory is the device's: another process (one that just exited and whose memory
    // the driver is still giving back, seen on the H200) can move it during the call. A leak
    // shows on every attempt; another process's drift does not.
    let mut changes = Vec::new();
    for attempt in 0..4 {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        ctx.synchronize().unwrap();
        let (free_before, _) = ctx.memory_info().unwrap();
        let err = ctx.attention_naive(&q, &q, &q, &AttentionOptions::default()).unwrap_err();
        assert!(matches!(err, Error::Driver { .. }), "expected an allocation error, got {err}");
        assert!(err.to_string().contains("OUT_OF_MEMORY"), "{err}");
        ctx.synchronize().unwrap();
        let (free_after, _) = ctx.memory_info().unwrap();
        if free_before == free_after {
            break;
        }
        changes.push(free_before as i128 - free_after as i128);
        assert!(changes.len() < 4, "device memory in use changed across every failed call: {changes:?} bytes");
    }
    // The context still works.
    check(ctx, mha(1, 2, 33, 64), Kernel::Naive, AttentionOptions::default(), 1, true);
}

#[test]
fn tensors_from_another_context_are_refused() {
    let Some(ctx) = gpu("tensors_from_another_context_are_refused") else { return };
    let _memory = shared_memory();
    let other = Context::new(0).unwrap();
    let mine = ctx.full(&[1, 1, 16, 32], 1.0).unwrap();
    let theirs = other.full(&[1, 1, 16, 32], 1.0).unwrap();
    let err =
        ctx.flash_attention_forward(&mine, &theirs, &mine, &Default::default(), TileConfig::new(16, 16)).unwrap_err();
    assert!(matches!(err, Error::ForeignTensor { tensor: "k", .. }), "{err}");
    let err = ctx.vector_add(&theirs, &mine).unwrap_err();
    assert!(matches!(err, Error::ForeignTensor { tensor: "a", .. }), "{err}");
}

/// A cheap, deterministic stand-in for random data at billions of elements (generating normal
/// draws would take minutes): a hash of the index, in [-2, 2).
fn hashed(i: usize, salt: u64) -> f32 {
    let mut x = (i as u64 ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
}

/// 2³¹ + 17 floats: every index past 2³¹ must be computed with 64-bit arithmetic.
#[test]
fn vector_add_beyond_two_to_the_31_elements() {
    let Some(ctx) = gpu("vector_add_beyond_two_to_the_31_elements") else { return };
    let _memory = shared_memory();
    let n = (1usize << 31) + 17;
    let a: Vec<f32> = (0..n).into_par_iter().map(|i| hashed(i, 1)).collect();
    let b: Vec<f32> = (0..n).into_par_iter().map(|i| hashed(i, 2)).collect();
    let c = {
        let (da, db) = (ctx.upload(&a, &[n]).unwrap(), ctx.upload(&b, &[n]).unwrap());
        ctx.vector_add(&da, &db).unwrap().to_host().unwrap()
    };
    // f32 + f32 rounds the same way on both sides: compare exactly.
    let wrong = (0..n).into_par_iter().filter(|&i| c[i] != a[i] + b[i]).count();
    assert_eq!(wrong, 0, "{wrong} of {n} sums differ");
}

/// Q and O of 2³¹ + 384 elements ([1, 1, 2²⁴ + 3, 128]) with a short K and V: flash and naive
/// forward, checked against the CPU on rows at the start, around element 2³¹ and at the end.
#[test]
fn attention_beyond_two_to_the_31_elements() {
    let Some(ctx) = gpu("attention_beyond_two_to_the_31_elements") else { return };
    let _memory = shared_memory();
    let (seqlen_q, seqlen_k, d) = ((1usize << 24) + 3, 40, 128);
    let shape = AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: d };
    let q: Vec<f32> = (0..seqlen_q * d).into_par_iter().map(|i| hashed(i, 3)).collect();
    let (k, v) = (random_normal(seqlen_k * d, 4), random_normal(seqlen_k * d, 5));
    let (dq, dk, dv) = (
        ctx.upload(&q, &shape.q_shape()).unwrap(),
        ctx.upload(&k, &shape.kv_shape()).unwrap(),
        ctx.upload(&v, &shape.kv_shape()).unwrap(),
    );
    let options = AttentionOptions::default();
    let rows: Vec<usize> = [0..64, (1 << 24) - 64..(1 << 24) + 3].into_iter().flatten().collect();
    // The reference for just those rows: a problem whose queries are those rows (rows of a
    // non-causal problem are independent).
    let picked: Vec<f32> = rows.iter().flat_map(|&r| q[r * d..(r + 1) * d].iter().copied()).collect();
    let sub = AttentionShape { seqlen_q: rows.len(), ..shape };
    let params = cpu::Params {
        scale: options.scale_for(d) as f64,
        causal: Causal::None,
        window: None,
        score: Default::default(),
        sinks: None,
        mask_table: None,
        bias: None,
    };
    let reference = cpu::attention(&picked, &k, &v, &sub, params).unwrap();
    for (name, out) in [
        (
            "flash",
            ctx.flash_attention_forward(
                &dq,
                &dk,
                &dv,
                &options,
                common::on_device(ctx, TileConfig::default_for(d), DType::F32, d, None),
            )
            .unwrap(),
        ),
        ("naive", ctx.attention_naive(&dq, &dk, &dv, &options).unwrap()),
    ] {
        let (o, lse) = (out.o.to_host().unwrap(), out.lse.to_host().unwrap());
        let o_rows: Vec<f32> = rows.iter().flat_map(|&r| o[r * d..(r + 1) * d].iter().copied()).collect();
        let lse_rows: Vec<f32> = rows.iter().map(|&r| lse[r]).collect();
        let (err_o, err_lse) = (relative_l2_error(&o_rows, &reference.o), lse_error(&lse_rows, &reference.lse));
        assert!(err_o <= 1e-5 && err_lse <= 1e-5, "{name}: O {err_o:.2e}, LSE {err_lse:.2e}");
        assert!(o.par_iter().all(|x| x.is_finite()), "{name}: a non-finite output");
    }
}

/// Logits of ±1e4 after scaling must not overflow: the online softmax subtracts the running
/// maximum. Inputs are small integers, so the scores are exact in f32; what is left is the
/// rounding of `score · scale · log₂e` in the exponent, about |logit| · 2⁻²⁴, hence a tolerance
/// of 1e-3 rather than the usual 1e-5.
#[test]
fn large_logits_do_not_overflow() {
    let Some(ctx) = gpu("large_logits_do_not_overflow") else { return };
    let _memory = shared_memory();
    let shape = mha(1, 2, 150, 64);
    let ints = |n: usize, salt: u64| -> Vec<f32> { (0..n).map(|i| (hashed(i, salt) * 2.0).round()).collect() };
    let (q, k, v) = (ints(150 * 128, 6), ints(150 * 128, 7), random_normal(150 * 128, 8));
    let options = AttentionOptions { scale: Some(500.0), causal: Causal::TopLeft, ..Default::default() };
    let params = cpu::Params {
        scale: 500.0,
        causal: Causal::TopLeft,
        window: None,
        score: Default::default(),
        sinks: None,
        mask_table: None,
        bias: None,
    };
    let reference = cpu::attention(&q, &k, &v, &shape, params).unwrap();
    let max_logit = reference.lse.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(max_logit > 5e3, "the test should produce logits in the thousands (max LSE {max_logit})");
    let (dq, dk, dv) = (
        ctx.upload(&q, &shape.q_shape()).unwrap(),
        ctx.upload(&k, &shape.kv_shape()).unwrap(),
        ctx.upload(&v, &shape.kv_shape()).unwrap(),
    );
    for (name, out) in [
        ("flash", ctx.flash_attention_forward(&dq, &dk, &dv, &options, TileConfig::new(32, 32)).unwrap()),
        ("naive", ctx.attention_naive(&dq, &dk, &dv, &options).unwrap()),
    ] {
        let (o, lse) = (out.o.to_host().unwrap(), out.lse.to_host().unwrap());
        assert!(o.iter().chain(&lse).all(|x| x.is_finite()), "{name}: overflow");
        let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), lse_error(&lse, &reference.lse));
        assert!(err_o <= 1e-3 && err_lse <= 1e-6, "{name}: O {err_o:.2e}, LSE {err_lse:.2e}");
    }
}

/// A NaN or ∞ in Q, K or V reaches exactly the rows the math says: with a causal mask, key j
/// reaches only the queries that see it, and query i only its own row. Rows whose reference is
/// finite must match it; rows whose reference is not finite must not be finite either.
#[test]
fn nan_and_infinity_reach_exactly_the_rows_that_see_them() {
    let Some(ctx) = gpu("nan_and_infinity_reach_exactly_the_rows_that_see_them") else { return };
    let _memory = shared_memory();
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 70, seqlen_k: 70, head_dim: 32 };
    for kernel in [Kernel::Naive, Kernel::Flash(TileConfig::new(32, 32), DqAccumulation::Atomic)] {
        poisoned_rows(ctx, kernel, shape);
    }
}

/// scale = 0 makes every visible key equally likely: O is the mean of the V rows a query sees.
#[test]
fn scale_zero_gives_the_mean_of_v() {
    let Some(ctx) = gpu("scale_zero_gives_the_mean_of_v") else { return };
    let _memory = shared_memory();
    let shape = mha(1, 1, 9, 32);
    let problem = Problem::new(ctx, shape, 400);
    let options = AttentionOptions { scale: Some(0.0), causal: Causal::TopLeft, ..Default::default() };
    for kernel in [Kernel::Naive, Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Atomic)] {
        let o = problem.forward(ctx, kernel, &options).o.to_host().unwrap();
        let v = &problem.host[2];
        for i in 0..9 {
            for c in 0..32 {
                let mean = (0..=i).map(|j| v[j * 32 + c] as f64).sum::<f64>() / (i + 1) as f64;
                assert!((o[i * 32 + c] as f64 - mean).abs() <= 1e-5, "{kernel:?}: row {i} col {c}");
            }
        }
    }
}

/// The smallest problems: one query and one key, at the smallest compiled head_dim, every mask,
/// forward and backward.
#[test]
fn one_query_one_key_smallest_head_dim() {
    let Some(ctx) = gpu("one_query_one_key_smallest_head_dim") else { return };
    let _memory = shared_memory();
    let d = TileConfig::compiled_head_dims()[0];
    for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
        for kernel in [Kernel::Naive, Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Deterministic)] {
            check(ctx, mha(1, 1, 1, d), kernel, AttentionOptions::causal(causal), 500, true);
        }
    }
}

/// Interop with code that owns its CUDA objects: a context on the caller's stream, inputs that
/// are the caller's cudarc buffers, outputs handed back as cudarc buffers; the one-call API on
/// them matches the same call on uploaded copies bit for bit. A buffer of the wrong length is
/// refused; one made through another `CudaContext` object of the same device (a framework's, say)
/// is taken.
#[test]
fn a_context_on_the_callers_stream_takes_the_callers_buffers() {
    let Some(ctx) = gpu("a_context_on_the_callers_stream_takes_the_callers_buffers") else { return };
    let _memory = shared_memory();
    let stream = ctx.cuda_stream().unwrap().context().new_stream().unwrap();
    let theirs = Context::on_stream(stream.clone()).unwrap();
    let shape = mha(1, 2, 77, 64);
    let count = |dims: [usize; 4]| dims.iter().product();
    let (q_host, k_host) = (random_normal(count(shape.q_shape()), 5), random_normal(count(shape.kv_shape()), 6));
    let wrap = |values: &[f32], dims: &[usize]| {
        let slice = stream.clone_htod(values).unwrap();
        theirs.tensor_from_cuda_slice(slice, dims).unwrap()
    };
    let (q, k) = (wrap(&q_host, &shape.q_shape()), wrap(&k_host, &shape.kv_shape()));
    let options = AttentionOptions::causal(Causal::TopLeft);
    let forward = theirs.attention(&q, &k, &k, &options).unwrap();
    let o = forward.o().to_host().unwrap();
    let (q2, k2) = (ctx.upload(&q_host, &shape.q_shape()).unwrap(), ctx.upload(&k_host, &shape.kv_shape()).unwrap());
    let expected = ctx.attention(&q2, &k2, &k2, &options).unwrap().o().to_host().unwrap();
    assert_eq!(o, expected, "the same call on the caller's stream and buffers gives other bits");
    // The output as a cudarc buffer again, readable on the caller's stream.
    let output = forward.output.o.into_cuda_slice().unwrap();
    assert_eq!(stream.clone_dtoh(&output).unwrap(), o);
    // Refused: a buffer of the wrong length, and one of another CUDA context.
    let short = stream.clone_htod(&q_host[1..]).unwrap();
    assert!(matches!(theirs.tensor_from_cuda_slice(short, &shape.q_shape()), Err(Error::Length { .. })));
    let framework = cudarc::driver::CudaContext::new(0).unwrap().default_stream();
    let theirs_too = framework.clone_htod(&q_host).unwrap();
    let q3 = theirs.tensor_from_cuda_slice(theirs_too, &shape.q_shape()).unwrap();
    assert_eq!(q3.to_host().unwrap(), q_host);
}

/// Empty problems on the GPU (a sequence length, batch or head count of 0): no kernel runs, no
/// zero-byte buffer is allocated, and the outputs follow the empty-row convention (O = 0, LSE =
/// −∞ for rows of 0 keys, zero gradients), on the flash and naive paths, f32 and f16, both dQ
/// modes and the one-call API.
#[test]
fn empty_problems_follow_the_empty_row_convention() {
    let Some(ctx) = gpu("empty_problems_follow_the_empty_row_convention") else { return };
    let _memory = shared_memory();
    let base = AttentionShape { batch: 2, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 9, seqlen_k: 11, head_dim: 64 };
    for (i, shape) in [
        AttentionShape { seqlen_k: 0, ..base },
        AttentionShape { seqlen_q: 0, ..base },
        AttentionShape { batch: 0, ..base },
        AttentionShape { num_heads_q: 0, ..base },
    ]
    .into_iter()
    .enumerate()
    {
        let options =
            if i % 2 == 0 { AttentionOptions::causal(Causal::BottomRight) } else { AttentionOptions::default() };
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            check(ctx, shape, Kernel::Flash(TileConfig::default_for(64), mode), options, 900 + i as u64, true);
        }
        check(ctx, shape, Kernel::Naive, options, 910 + i as u64, true);
        let n = |dims: [usize; 4]| dims.iter().product::<usize>();
        let to16 = |x: Vec<f32>| attn_host::dtype::from_f32_slice::<attn_host::f16>(&x);
        let q = ctx.upload(&to16(random_normal(n(shape.q_shape()), 1)), &shape.q_shape()).unwrap();
        let kv = ctx.upload(&to16(random_normal(n(shape.kv_shape()), 2)), &shape.kv_shape()).unwrap();
        let forward = ctx.attention(&q, &kv, &kv, &options).unwrap();
        assert!(forward.o().to_host().unwrap().iter().all(|x| x.to_f32() == 0.0));
        assert!(forward.lse().to_host().unwrap().iter().all(|&x| x == f32::NEG_INFINITY));
        let grads = ctx.attention_backward(&forward, &q).unwrap();
        for t in [&grads.dq, &grads.dk, &grads.dv] {
            assert!(t.to_host().unwrap().iter().all(|x| x.to_f32() == 0.0));
        }
    }
    ctx.synchronize().unwrap();
}

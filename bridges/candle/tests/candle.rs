//! The candle bridge against attention written with candle's own ops: O and, through candle's
//! autograd, dQ, dK and dV, on CPU tensors (the kernels' emulator) and, with the `cuda` feature
//! and a GPU, on CUDA tensors.
//!
//! The oracle, as in the project's other tests: the float64 computation is the truth; our error
//! must be within about twice that of the same computation in the inputs' precision (a plain
//! attention: scores and P in the inputs' dtype, the softmax in f32), plus a floor for errors at
//! rounding level. A GPU test that finds no GPU prints a skip line; `REQUIRE_GPU=1` makes it fail.

use attn_candle::{Causal, FlashAttention, TensorLayout};
use candle_core::{DType, Device, Tensor, Var};

/// One case: `[B, Hq, Hkv, Sq, Sk, D]`, the mask, the window, the layout.
#[derive(Clone, Copy, Debug)]
struct Case {
    sizes: [usize; 6],
    causal: Causal,
    window: Option<(Option<usize>, Option<usize>)>,
    layout: TensorLayout,
}

const CASES: [Case; 5] = [
    Case { sizes: [1, 2, 2, 37, 37, 64], causal: Causal::None, window: None, layout: TensorLayout::Bshd },
    Case { sizes: [2, 4, 2, 29, 45, 64], causal: Causal::BottomRight, window: None, layout: TensorLayout::Bshd },
    Case { sizes: [1, 3, 1, 40, 40, 40], causal: Causal::TopLeft, window: None, layout: TensorLayout::Bhsd },
    Case {
        sizes: [1, 2, 2, 50, 50, 64],
        causal: Causal::BottomRight,
        window: Some((Some(7), Some(0))),
        layout: TensorLayout::Bshd,
    },
    Case {
        sizes: [1, 2, 1, 17, 33, 128],
        causal: Causal::None,
        window: Some((Some(5), Some(3))),
        layout: TensorLayout::Bhsd,
    },
];

/// Which query/key pairs a case's mask lets through (bottom-right windows, as the bridge's).
fn visible(case: &Case, i: usize, j: usize) -> bool {
    let [_, _, _, sq, sk, _] = case.sizes;
    if !case.causal.visible(i, j, sq, sk) {
        return false;
    }
    let diagonal = (i + sk) as i64 - sq as i64;
    match case.window {
        None => true,
        Some((left, right)) => {
            left.is_none_or(|l| j as i64 >= diagonal - l as i64)
                && right.is_none_or(|r| j as i64 <= diagonal + r as i64)
        }
    }
}

fn relative_error(ours: &Tensor, truth: &Tensor) -> candle_core::Result<f64> {
    let (ours, truth) = (ours.to_dtype(DType::F64)?, truth.to_dtype(DType::F64)?);
    let norm = truth.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let diff = (ours - &truth)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if norm > 0.0 { diff / norm } else { diff })
}

fn floor(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.5e-2,
    }
}

/// O, dQ, dK, dV of `attention` on BHSD `q`, `k`, `v` (in the case's layout for the call) for
/// the upstream gradient `d_o`, through candle's autograd.
fn run(
    attention: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    inputs: [&Tensor; 4],
    layout: TensorLayout,
) -> candle_core::Result<[Tensor; 4]> {
    let to_layout = |t: &Tensor| match layout {
        TensorLayout::Bshd => t.transpose(1, 2)?.contiguous(),
        TensorLayout::Bhsd => Ok(t.clone()),
    };
    let [q, k, v, d_o] = inputs;
    let (q, k, v) =
        (Var::from_tensor(&to_layout(q)?)?, Var::from_tensor(&to_layout(k)?)?, Var::from_tensor(&to_layout(v)?)?);
    let o = attention(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let loss = (o.to_dtype(DType::F64)? * to_layout(d_o)?.to_dtype(DType::F64)?)?.sum_all()?;
    let grads = loss.backward()?;
    let grad =
        |var: &Var| grads.get(var.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
    let back = |t: Tensor| match layout {
        TensorLayout::Bshd => t.transpose(1, 2)?.contiguous(),
        TensorLayout::Bhsd => Ok(t),
    };
    Ok([back(o)?, back(grad(&q)?)?, back(grad(&k)?)?, back(grad(&v)?)?])
}

/// Every case in `dtype` on `device`: ours against the f64 truth, within twice the plain
/// same-precision attention's error plus the floor.
fn check_cases(device: &Device, dtype: DType) -> candle_core::Result<()> {
    for (n, case) in CASES.iter().enumerate() {
        let [b, hq, hkv, sq, sk, d] = case.sizes;
        let scale = 1.0 / (d as f64).sqrt();
        let seed = |s: u64| -> candle_core::Result<Tensor> {
            let shape = if s == 0 || s == 3 { (b, hq, sq, d) } else { (b, hkv, sk, d) };
            let values = attn_host::check::random_normal(shape.0 * shape.1 * shape.2 * shape.3, 100 * n as u64 + s);
            Tensor::from_vec(values, shape, device)?.to_dtype(dtype)
        };
        let (q, k, v, d_o) = (seed(0)?, seed(1)?, seed(2)?, seed(3)?);
        let mut attention = FlashAttention::new().scale(scale as f32).mask(case.causal).layout(case.layout);
        if let Some((left, right)) = case.window {
            attention = attention.window(left, right);
        }
        let ours = run(&|q, k, v| attention.forward(q, k, v), [&q, &k, &v, &d_o], case.layout)?;
        let f64s = [&q, &k, &v, &d_o].map(|t| t.to_dtype(DType::F64).unwrap());
        let truth = run(
            &|q, k, v| attn_candle::plain_attention(q, k, v, scale, |i, j| visible(case, i, j)),
            [&f64s[0], &f64s[1], &f64s[2], &f64s[3]],
            TensorLayout::Bhsd,
        )?;
        let same = run(
            &|q, k, v| attn_candle::plain_attention(q, k, v, scale, |i, j| visible(case, i, j)),
            [&q, &k, &v, &d_o],
            TensorLayout::Bhsd,
        )?;
        for (i, name) in ["O", "dQ", "dK", "dV"].iter().enumerate() {
            assert_eq!(ours[i].dims(), truth[i].dims(), "{name} of {case:?}");
            assert_eq!(ours[i].dtype(), dtype, "{name} of {case:?}");
            let (error, plain_error) = (relative_error(&ours[i], &truth[i])?, relative_error(&same[i], &truth[i])?);
            let bound = 2.0 * plain_error + floor(dtype);
            println!("{device:?} {dtype:?} {case:?} {name}: ours {error:.2e}, plain {plain_error:.2e}");
            assert!(error <= bound, "{name} of {case:?} in {dtype:?}: error {error:.3e} > {bound:.3e}");
        }
    }
    Ok(())
}

#[test]
fn cpu_tensors_match_plain_attention_forward_and_backward() -> candle_core::Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        check_cases(&Device::Cpu, dtype)?;
    }
    Ok(())
}

/// The GPU, or `None` after a visible skip line (a failure with `REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<Device> {
    let required = std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Device::new_cuda(0) {
        Ok(device) if device.is_cuda() => Some(device),
        other => {
            let why = match other {
                Err(e) => e.to_string(),
                Ok(_) => "candle was built without its `cuda` feature".into(),
            };
            assert!(!required, "REQUIRE_GPU=1, but {test} found no GPU: {why}");
            // Straight to stderr in one write: the harness captures `println!`, and a skip must
            // be visible in a normal `cargo test` run.
            let line = format!("{test}: skipped: no CUDA device ({why}); REQUIRE_GPU=1 makes this fail\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            None
        }
    }
}

#[test]
fn cuda_tensors_match_plain_attention_forward_and_backward() -> candle_core::Result<()> {
    let Some(device) = gpu("cuda_tensors_match_plain_attention_forward_and_backward") else { return Ok(()) };
    // A Turing GPU (compute capability 7.5: a T4) has no bf16 kernels.
    let bf16 = attn_host::Context::new(0).is_ok_and(|ctx| ctx.device().supports(attn_host::DType::Bf16));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        if dtype == DType::BF16 && !bf16 {
            eprintln!("bf16 left out: this GPU (compute capability below 8.0) has no bf16 kernels");
            continue;
        }
        check_cases(&device, dtype)?;
    }
    Ok(())
}

/// `flash_attn_varlen` on packed sequences of `lengths_q` queries and `lengths_k` keys (GQA
/// 4/2, head_dim 64, causal and not) against plain attention over the whole packed row with
/// each query seeing only its own sequence (causal: bottom-right in it), forward and backward.
fn check_varlen(device: &Device, dtype: DType, lengths_q: &[u32], lengths_k: &[u32]) -> candle_core::Result<()> {
    let (hq, hkv, d) = (4, 2, 64);
    let prefix_sums = |lengths: &[u32]| -> Vec<u32> {
        std::iter::once(0)
            .chain(lengths.iter().scan(0, |end, &n| {
                *end += n;
                Some(*end)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (prefix_sums(lengths_q), prefix_sums(lengths_k));
    let (total_q, total_k) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    // The sequence of packed row `t` and its position in it.
    let locate = |cu: &[u32], t: usize| {
        let s = cu.partition_point(|&start| start as usize <= t) - 1;
        (s, t - cu[s] as usize)
    };
    let longest = |lengths: &[u32]| *lengths.iter().max().unwrap() as usize;
    let (seqlens_q, seqlens_k) = (Tensor::new(cu_q.as_slice(), device)?, Tensor::new(cu_k.as_slice(), device)?);
    for causal in [false, true] {
        let scale = 1.0 / (d as f64).sqrt();
        let seed = |s: u64, rows: usize, h: usize| -> candle_core::Result<Tensor> {
            let values = attn_host::check::random_normal(rows * h * d, 7000 + s + causal as u64 * 10);
            Tensor::from_vec(values, (rows, h, d), device)?.to_dtype(dtype)
        };
        let (q, k, v, d_o) =
            (seed(0, total_q, hq)?, seed(1, total_k, hkv)?, seed(2, total_k, hkv)?, seed(3, total_q, hq)?);
        let visible = |i: usize, j: usize| {
            let ((s, i), (t, j)) = (locate(&cu_q, i), locate(&cu_k, j));
            let offset = lengths_k[s] as usize;
            s == t && (!causal || j + lengths_q[s] as usize <= i + offset)
        };
        // The packed row as one BHSD batch entry, for the plain attention.
        let bhsd = |t: &Tensor| t.unsqueeze(0)?.transpose(1, 2)?.contiguous();
        let grads_of = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
                        inputs: [&Tensor; 4]|
         -> candle_core::Result<[Tensor; 4]> {
            let [q, k, v, d_o] = inputs;
            let (q, k, v) = (Var::from_tensor(q)?, Var::from_tensor(k)?, Var::from_tensor(v)?);
            let o = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
            let grads = (o.to_dtype(DType::F64)? * d_o.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
            let g =
                |var: &Var| grads.get(var.as_tensor()).cloned().ok_or(candle_core::Error::Msg("no gradient".into()));
            Ok([o, g(&q)?, g(&k)?, g(&v)?])
        };
        let ours = grads_of(
            &|q, k, v| {
                let (max_q, max_k) = (longest(lengths_q), longest(lengths_k));
                attn_candle::flash_attn_varlen(q, k, v, &seqlens_q, &seqlens_k, max_q, max_k, scale as f32, causal)
            },
            [&q, &k, &v, &d_o],
        )?;
        let plain = |q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<Tensor> {
            let o = attn_candle::plain_attention(&bhsd(q)?, &bhsd(k)?, &bhsd(v)?, scale, visible)?;
            o.transpose(1, 2)?.squeeze(0)
        };
        let f64s = [&q, &k, &v, &d_o].map(|t| t.to_dtype(DType::F64).unwrap());
        let truth = grads_of(&plain, [&f64s[0], &f64s[1], &f64s[2], &f64s[3]])?;
        let same = grads_of(&plain, [&q, &k, &v, &d_o])?;
        for (i, name) in ["O", "dQ", "dK", "dV"].iter().enumerate() {
            assert_eq!(ours[i].dims(), truth[i].dims(), "{name}");
            let (error, plain_error) = (relative_error(&ours[i], &truth[i])?, relative_error(&same[i], &truth[i])?);
            let bound = 2.0 * plain_error + floor(dtype);
            let lengths = (lengths_q, lengths_k);
            println!(
                "varlen {device:?} {dtype:?} {lengths:?} causal={causal} {name}: ours {error:.2e}, plain {plain_error:.2e}"
            );
            assert!(error <= bound, "varlen {name} {lengths:?} causal={causal} {dtype:?}: {error:.3e} > {bound:.3e}");
        }
    }
    Ok(())
}

#[test]
fn varlen_batches_match_plain_attention_per_sequence() -> candle_core::Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        check_varlen(&Device::Cpu, dtype, &[9, 0, 40, 1, 23], &[9, 0, 40, 1, 23])?;
        // Chunked prefill (new queries against longer cached keys), a sequence with keys and
        // no queries, and one with more queries than keys.
        check_varlen(&Device::Cpu, dtype, &[5, 0, 17, 30], &[21, 6, 40, 12])?;
    }
    if let Some(device) = gpu("varlen_batches_match_plain_attention_per_sequence") {
        // No bf16 on a Turing GPU (compute capability 7.5).
        let bf16 = attn_host::Context::new(0).is_ok_and(|ctx| ctx.device().supports(attn_host::DType::Bf16));
        for dtype in [DType::F32, DType::F16, DType::BF16].into_iter().filter(|&d| d != DType::BF16 || bf16) {
            check_varlen(&device, dtype, &[300, 1, 700, 0, 129, 64], &[300, 1, 700, 0, 129, 64])?;
            check_varlen(&device, dtype, &[16, 1, 300, 0, 129, 200], &[700, 333, 300, 64, 2000, 90])?;
        }
    }
    Ok(())
}

/// Attention sinks and a bias (one plane per head, or one per batch entry shared by the heads)
/// through the bridge against plain attention with both, in `dtype` on `device`: O, and dQ, dK,
/// dV with the sinks and bias as constants (GQA 4/2, ragged lengths, causal and not).
fn check_sinks_and_bias(device: &Device, dtype: DType) -> candle_core::Result<()> {
    let (b, hq, hkv, sq, sk, d) = (2, 4, 2, 33, 47, 64);
    let scale = 1.0 / (d as f64).sqrt();
    let normal = |shape: &[usize], seed: u64| {
        Tensor::from_vec(attn_host::check::random_normal(shape.iter().product(), 40 + seed), shape, device)
    };
    let (q, k, v, d_o) = (
        normal(&[b, hq, sq, d], 0)?.to_dtype(dtype)?,
        normal(&[b, hkv, sk, d], 1)?.to_dtype(dtype)?,
        normal(&[b, hkv, sk, d], 2)?.to_dtype(dtype)?,
        normal(&[b, hq, sq, d], 3)?.to_dtype(dtype)?,
    );
    let sinks = normal(&[hq], 4)?;
    for (causal, bias_shape) in [(Causal::None, [1, hq, sq, sk]), (Causal::BottomRight, [b, 1, sq, sk])] {
        let bias = normal(&bias_shape, 5)?;
        let attention =
            FlashAttention::new().scale(scale as f32).mask(causal).layout(TensorLayout::Bhsd).sinks(&sinks).bias(&bias);
        let ours = run(&|q, k, v| attention.forward(q, k, v), [&q, &k, &v, &d_o], TensorLayout::Bhsd)?;
        let plain = |inputs: [&Tensor; 4]| {
            let visible = |i, j| causal.visible(i, j, sq, sk);
            let attention = |q: &Tensor, k: &Tensor, v: &Tensor| {
                attn_candle::plain_attention_with(q, k, v, scale, visible, Some(&bias), Some(&sinks))
            };
            run(&attention, inputs, TensorLayout::Bhsd)
        };
        let f64s = [&q, &k, &v, &d_o].map(|t| t.to_dtype(DType::F64).unwrap());
        let truth = plain([&f64s[0], &f64s[1], &f64s[2], &f64s[3]])?;
        let same = plain([&q, &k, &v, &d_o])?;
        for (i, name) in ["O", "dQ", "dK", "dV"].iter().enumerate() {
            let (error, plain_error) = (relative_error(&ours[i], &truth[i])?, relative_error(&same[i], &truth[i])?);
            let bound = 2.0 * plain_error + floor(dtype);
            println!(
                "{device:?} {dtype:?} sinks, bias {bias_shape:?}, {causal:?} {name}: ours {error:.2e}, plain {plain_error:.2e}"
            );
            assert!(
                error <= bound,
                "{name} with sinks and a bias {bias_shape:?} in {dtype:?}: {error:.3e} > {bound:.3e}"
            );
        }
    }
    Ok(())
}

#[test]
fn sinks_and_bias_match_plain_attention() -> candle_core::Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        check_sinks_and_bias(&Device::Cpu, dtype)?;
    }
    if let Some(device) = gpu("sinks_and_bias_match_plain_attention") {
        let bf16 = attn_host::Context::new(0).is_ok_and(|ctx| ctx.device().supports(attn_host::DType::Bf16));
        for dtype in [DType::F32, DType::F16, DType::BF16].into_iter().filter(|&d| d != DType::BF16 || bf16) {
            check_sinks_and_bias(&device, dtype)?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_is_candle_flash_attns_call() -> candle_core::Result<()> {
    // candle_flash_attn::flash_attn(q, k, v, softmax_scale, causal): BSHD, bottom-right causal.
    let device = Device::Cpu;
    let (b, sq, sk, h, d) = (1, 9, 21, 2, 32);
    let q = Tensor::from_vec(attn_host::check::random_normal(b * sq * h * d, 7), (b, sq, h, d), &device)?;
    let k = Tensor::from_vec(attn_host::check::random_normal(b * sk * h * d, 8), (b, sk, h, d), &device)?;
    let v = Tensor::from_vec(attn_host::check::random_normal(b * sk * h * d, 9), (b, sk, h, d), &device)?;
    let ours = attn_candle::flash_attn(&q, &k, &v, 0.3, true)?;
    let same = FlashAttention::new().scale(0.3).mask(Causal::BottomRight).forward(&q, &k, &v)?;
    assert_eq!(ours.dims(), &[b, sq, h, d]);
    assert_eq!(relative_error(&ours, &same)?, 0.0);
    let windowed = attn_candle::flash_attn_windowed(&q, &k, &v, 0.3, None, Some(0))?;
    assert_eq!(relative_error(&windowed, &ours)?, 0.0, "window (None, Some(0)) is causal");
    Ok(())
}

#[test]
fn bad_inputs_are_errors_that_say_why() -> candle_core::Result<()> {
    let device = Device::Cpu;
    let t = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, &device);
    let message = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let q = t(&[1, 8, 2, 64], DType::F32)?;
    let error = message(attn_candle::flash_attn(&t(&[8, 2, 64], DType::F32)?, &q, &q, 1.0, false));
    assert!(error.contains("4-dimensional"), "{error}");
    let error = message(attn_candle::flash_attn(&q, &t(&[1, 8, 2, 64], DType::F16)?, &q, 1.0, false));
    assert!(error.contains("one dtype"), "{error}");
    let q64 = t(&[1, 8, 2, 64], DType::F64)?;
    let error = message(attn_candle::flash_attn(&q64, &q64, &q64, 1.0, false));
    assert!(error.contains("f32, f16 and bf16"), "{error}");
    let k3 = t(&[1, 8, 3, 64], DType::F32)?;
    assert!(attn_candle::flash_attn(&q, &k3, &k3, 1.0, false).is_err(), "3 K/V heads do not divide 2 Q heads");
    let narrow = t(&[1, 8, 2, 16], DType::F32)?;
    let error = message(attn_candle::flash_attn(&q, &narrow, &narrow, 1.0, false));
    assert!(error.contains("head_dim") && error.contains("after transposing the BSHD inputs"), "{error}");
    let wide = t(&[1, 8, 2, 300], DType::F32)?;
    assert!(!message(attn_candle::flash_attn(&wide, &wide, &wide, 1.0, false)).is_empty(), "head_dim 300");
    let error = message(FlashAttention::new().scale(f32::NAN).forward(&q, &q, &q));
    assert!(!error.is_empty(), "a NaN scale");
    // Varlen: offsets that do not end at the rows, different query and key lengths, a sequence
    // longer than max_seqlen, a 4-dimensional Q.
    let packed = t(&[10, 2, 64], DType::F32)?;
    let offsets = |cu: &[u32]| Tensor::new(cu, &device);
    let varlen = |cu_q: &[u32], cu_k: &[u32], max: usize| {
        attn_candle::flash_attn_varlen(&packed, &packed, &packed, &offsets(cu_q)?, &offsets(cu_k)?, max, max, 1.0, true)
    };
    let error = message(varlen(&[0, 4, 9], &[0, 4, 9], 5));
    assert!(error.contains("cu_seqlens must start at 0"), "{error}");
    let error = message(attn_candle::flash_attn_varlen(
        &packed,
        &packed,
        &packed,
        &Tensor::new(&[0i64, 10], &device)?,
        &offsets(&[0, 10])?,
        10,
        10,
        1.0,
        false,
    ));
    assert!(error.contains("u32 tensor"), "{error}");
    let error = message(varlen(&[0, 4, 10], &[0, 4, 10], 5));
    assert!(error.contains("max_seqlen_q"), "{error}");
    let error = message(varlen(&[0, 4, 10], &[0, 3, 10], 6));
    assert!(error.contains("max_seqlen_k"), "{error}");
    let short_q = t(&[7, 2, 64], DType::F32)?;
    let qk = |cu_q: &[u32], cu_k: &[u32]| FlashAttention::new().varlen_qk(cu_q, cu_k);
    let error = message(qk(&[0, 7], &[0, 9]).forward_varlen(&short_q, &packed, &packed));
    assert!(error.contains("cu_seqlens_k") && error.contains("k and v"), "{error}");
    let error = message(qk(&[0, 3, 7], &[0, 10]).forward_varlen(&short_q, &packed, &packed));
    assert!(error.contains("one pair per sequence"), "{error}");
    let error = message(qk(&[0, 7], &[0, 10]).alibi(8.0).forward_varlen(&short_q, &packed, &packed));
    assert!(error.contains("ALiBi"), "{error}");
    let error = message(FlashAttention::new().varlen(&[0, 2]).forward_varlen(&q, &q, &q));
    assert!(error.contains("[total, heads, head_dim]"), "{error}");
    // Sinks and a bias: a gradient the op would drop, another dtype, another shape, with softcap.
    let sinks = Var::from_tensor(&t(&[2], DType::F32)?)?;
    let error = message(FlashAttention::new().sinks(sinks.as_tensor()).forward(&q, &q, &q));
    assert!(error.contains("track a gradient") && error.contains("detach"), "{error}");
    assert!(FlashAttention::new().sinks(&sinks.as_tensor().detach()).forward(&q, &q, &q).is_ok(), "detached sinks");
    let error = message(FlashAttention::new().bias(&t(&[1, 2, 8, 8], DType::F16)?).forward(&q, &q, &q));
    assert!(error.contains("bias must be f32"), "{error}");
    let error = message(FlashAttention::new().bias(&t(&[1, 2, 8, 7], DType::F32)?).forward(&q, &q, &q));
    assert!(error.contains("the bias must have shape"), "{error}");
    let error = message(FlashAttention::new().sinks(&t(&[3], DType::F32)?).forward(&q, &q, &q));
    assert!(error.contains("the sinks must have shape"), "{error}");
    let error = message(FlashAttention::new().softcap(30.0).bias(&t(&[1, 2, 8, 8], DType::F32)?).forward(&q, &q, &q));
    assert!(error.contains("softcap"), "{error}");
    Ok(())
}

//! The Hopper building blocks (`kernels/src/hw/warpgroup.rs`, `hw/tma.rs` and `sm90/probes.rs`, PTX for `sm_90a`) on a GPU of compute
//! capability 9.0: `wgmma` reading both operands from shared memory through matrix descriptors
//! (f16 and bf16, one to eight k-steps) against the product in f64, and a TMA load of a 2-D box
//! completing on an `mbarrier`, inside and across the tensor's edges, against the tensor itself
//! (and `wgmma` with A in registers); the Hopper FlashAttention forward (TMA producer, two or
//! three `wgmma` consumer warpgroups, both head_dim-64 configurations) and backward against the
//! float64 reference, and their selection by the kernel path.
//! Other GPUs skip these tests with a visible line (they do not load the `sm_90a` module).

mod common;

use attn_host::DqAccumulation;
use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Causal, Context, DType, DescriptorOffsets, Element, Gradients,
    KernelPath, SlidingWindow, TileConfig, bf16, cpu, f16,
};
use common::tensor_cores::{Inputs, LSE_TOLERANCE, Problem16, check16, tolerances};
use common::{gpu, gqa};

/// The context, if it runs the `sm_90a` kernels; otherwise a skip line.
fn hopper(test: &str) -> Option<&'static Context> {
    let ctx = gpu(test)?;
    if ctx.has_hopper_kernels() {
        return Some(ctx);
    }
    common::tally(test, Some("no Hopper GPU (compute capability 9.0)"));
    eprintln!("{test}: skipped: {} is not compute capability 9.0 (no sm_90a kernels)", ctx.device().name);
    None
}

/// C = A · Bᵀ by the probe (with `offsets`) against f64 on the same rounded inputs: relative L2.
fn wgmma_error<T: Element>(ctx: &Context, k: usize, offsets: DescriptorOffsets, seed: u64) -> f64 {
    let (a, b) =
        (from_f32_slice::<T>(&random_normal(64 * k, seed)), from_f32_slice::<T>(&random_normal(64 * k, seed + 1)));
    let (a32, b32) = (to_f32_vec(&a), to_f32_vec(&b));
    let want: Vec<f64> = (0..64 * 64)
        .map(|i| {
            let (row, col) = (i / 64, i % 64);
            (0..k).map(|j| a32[row * k + j] as f64 * b32[col * k + j] as f64).sum()
        })
        .collect();
    let (a, b) = (ctx.upload(&a, &[64, k]).unwrap(), ctx.upload(&b, &[64, k]).unwrap());
    let c = ctx.hopper_probe_wgmma(&a, &b, offsets).unwrap().to_host().unwrap();
    relative_l2_error(&c, &want)
}

#[test]
fn wgmma_from_shared_memory_descriptors_matches_f64() {
    let Some(ctx) = hopper("wgmma_from_shared_memory_descriptors_matches_f64") else { return };
    for k in [16, 32, 64, 128] {
        let offsets = DescriptorOffsets::for_depth(k);
        for (name, err) in
            [("f16", wgmma_error::<f16>(ctx, k, offsets, 1)), ("bf16", wgmma_error::<bf16>(ctx, k, offsets, 3))]
        {
            // Products of 16-bit values are exact in f32; only the f32 sums round.
            if err > 1e-6 {
                // Say whether the two descriptor offsets were read the other way round.
                let swapped = DescriptorOffsets { leading: offsets.stride, stride: offsets.leading };
                let other = wgmma_error::<f16>(ctx, k, swapped, 1);
                panic!("{name} k={k}: relative L2 error {err:.3e} with {offsets:?}; {other:.3e} with {swapped:?}");
            }
        }
    }
}

/// C = A · B by the register-A probe (B MN-major, with `offsets`) against f64: relative L2.
fn register_a_error<T: Element>(ctx: &Context, k: usize, offsets: DescriptorOffsets, seed: u64) -> f64 {
    let (a, b) =
        (from_f32_slice::<T>(&random_normal(64 * k, seed)), from_f32_slice::<T>(&random_normal(k * 64, seed + 1)));
    let (a32, b32) = (to_f32_vec(&a), to_f32_vec(&b));
    let want: Vec<f64> = (0..64 * 64)
        .map(|i| {
            let (row, col) = (i / 64, i % 64);
            (0..k).map(|j| a32[row * k + j] as f64 * b32[j * 64 + col] as f64).sum()
        })
        .collect();
    let (a, b) = (ctx.upload(&a, &[64, k]).unwrap(), ctx.upload(&b, &[k, 64]).unwrap());
    let c = ctx.hopper_probe_wgmma_register_a(&a, &b, offsets).unwrap().to_host().unwrap();
    relative_l2_error(&c, &want)
}

#[test]
fn wgmma_with_a_in_registers_and_mn_major_b_matches_f64() {
    let Some(ctx) = hopper("wgmma_with_a_in_registers_and_mn_major_b_matches_f64") else { return };
    let offsets = DescriptorOffsets::mn_major_n64();
    for k in [16, 64, 128] {
        for (name, err) in [
            ("f16", register_a_error::<f16>(ctx, k, offsets, 11)),
            ("bf16", register_a_error::<bf16>(ctx, k, offsets, 13)),
        ] {
            assert!(err <= 1e-6, "{name} k={k}: relative L2 error {err:.3e} with {offsets:?}");
        }
    }
}

#[test]
fn tma_box_loads_match_the_tensor_and_fill_zeros_outside() {
    let Some(ctx) = hopper("tma_box_loads_match_the_tensor_and_fill_zeros_outside") else { return };
    let (rows, cols) = (100, 72);
    let host: Vec<f16> = from_f32_slice(&random_normal(rows * cols, 7));
    let tensor = ctx.upload(&host, &[rows, cols]).unwrap();
    // Inside, across the right edge, across the bottom edge, across both.
    for (x, y) in [(0, 0), (8, 30), (32, 0), (0, 60), (40, 50)] {
        let got = ctx.hopper_probe_tma(&tensor, x, y).unwrap().to_host().unwrap();
        for r in 0..64 {
            for c in 0..64 {
                let (row, col) = (y + r, x + c);
                let want = if row < rows && col < cols { host[row * cols + col] } else { f16::ZERO };
                let value = got[r * 64 + c];
                assert_eq!(value.to_bits(), want.to_bits(), "box ({x}, {y}) element ({r}, {c}): {value} != {want}");
            }
        }
    }
}

#[test]
fn probes_refuse_bad_shapes() {
    let Some(ctx) = hopper("probes_refuse_bad_shapes") else { return };
    let a = ctx.upload(&from_f32_slice::<f16>(&random_normal(64 * 24, 1)), &[64, 24]).unwrap();
    let err = ctx.hopper_probe_wgmma(&a, &a, DescriptorOffsets::for_depth(24)).unwrap_err();
    assert!(err.to_string().contains("multiple of 16"), "{err}");
    let odd = ctx.upload(&from_f32_slice::<f16>(&random_normal(10 * 7, 1)), &[10, 7]).unwrap();
    let err = ctx.hopper_probe_tma(&odd, 0, 0).unwrap_err();
    assert!(err.to_string().contains("16 bytes"), "{err}");
}

/// The `wgmma` forward on fresh inputs of `shape` (outputs poisoned with NaN) against the float64
/// reference on the same rounded inputs, at the tensor-core kernels' tolerances.
fn check_hopper_forward<T: Element>(ctx: &Context, shape: AttentionShape, options: AttentionOptions, seed: u64) {
    let problem = Problem16::<T>::new(ctx, shape, seed, Inputs::Normal);
    let [q, k, v, _] = &problem.device;
    let mut out = AttentionOutput {
        o: ctx.full(&shape.q_shape(), T::from_f32(f32::NAN)).unwrap(),
        lse: ctx.full(&shape.lse_shape(), f32::NAN).unwrap(),
    };
    ctx.flash_attention_forward_hopper_into(q, k, v, &mut out, &options).unwrap();
    let [qh, kh, vh, _] = &problem.host;
    let params = cpu::Params::of(&options, shape.head_dim);
    let reference = cpu::attention(qh, kh, vh, &shape, params).unwrap();
    let o = to_f32_vec(&out.o.to_host().unwrap());
    let (err_o, err_lse) =
        (relative_l2_error(&o, &reference.o), lse_error(&out.lse.to_host().unwrap(), &reference.lse));
    let (o_tolerance, _) = tolerances(T::DTYPE);
    assert!(
        err_o <= o_tolerance && err_lse <= LSE_TOLERANCE,
        "{} {options:?} on {shape:?}: relative L2 error O {err_o:.3e}, LSE {err_lse:.3e}",
        T::DTYPE
    );
}

#[test]
fn hopper_forward_matches_the_reference() {
    let Some(ctx) = hopper("hopper_forward_matches_the_reference") else { return };
    for head_dim in [64, 80, 96, 128, 160, 192, 256] {
        check_hopper_cases(ctx, head_dim);
    }
}

/// A grid of 6 · 16 · 3 = 288 blocks of up to 192 query rows: 400 queries per head make blocks
/// of 192, 128 and 80 rows, so the third consumer warpgroup owns no rows in two of them. At least
/// two waves on an H200's 132 SMs, so head_dim 64 runs its three-consumer forward without a mask
/// (`waves_for_192_rows`; 384 keys, three whole 128-key tiles, more than the one-consumer forward
/// takes); under a causal mask, one consumer over 64-key tiles. GQA with 4 query heads per
/// key/value head.
fn deep_grid(head_dim: usize) -> AttentionShape {
    gqa(6, 16, 4, 400, 384, head_dim)
}

/// As [`deep_grid`] with more keys than the causal 64-key tiles take (2048): at head_dim 64 one
/// consumer over 128-key tiles under a causal mask, 33 · 12 = 396 units, a persistent grid.
fn deep_causal_grid(head_dim: usize) -> AttentionShape {
    gqa(1, 12, 4, 2100, 2100, head_dim)
}

/// Every case of the Hopper forward at `head_dim`: block edges (1, 64, 65, 127–130 rows), ragged
/// key tiles, GQA, both causal alignments (including query blocks that see no key), negative and
/// zero scales, and a batch that fills the GPU.
fn check_hopper_cases(ctx: &Context, head_dim: usize) {
    let shape =
        |batch, heads_q, heads_kv, seqlen_q, seqlen_k| gqa(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim);
    let cases = [
        (shape(1, 1, 1, 64, 64), AttentionOptions::default()),
        (shape(2, 4, 2, 333, 333), AttentionOptions::default()),
        (shape(2, 4, 2, 333, 333), AttentionOptions::causal(Causal::TopLeft)),
        (shape(1, 2, 1, 1, 1), AttentionOptions::default()),
        (shape(1, 2, 2, 65, 200), AttentionOptions::causal(Causal::BottomRight)),
        (shape(1, 2, 2, 200, 37), AttentionOptions::causal(Causal::BottomRight)),
        (shape(1, 2, 2, 200, 37), AttentionOptions::causal(Causal::TopLeft)),
        (shape(1, 3, 3, 130, 1000), AttentionOptions::with_scale(-0.3)),
        (shape(1, 3, 3, 130, 100), AttentionOptions::with_scale(0.0)),
        (shape(1, 1, 1, 127, 129), AttentionOptions::causal(Causal::TopLeft)),
        (shape(1, 2, 1, 300, 257), AttentionOptions::causal(Causal::BottomRight)),
        (shape(4, 8, 8, 1024, 1024), AttentionOptions::causal(Causal::TopLeft)),
        (shape(2, 16, 4, 1000, 1000), AttentionOptions::default()),
        // Deep enough for the three-consumer configuration at head_dim 64 (checked in
        // `the_kernel_path_picks_the_forward_kernel`), with short blocks in which the third
        // consumer warpgroup has no rows and only hands the K/V tiles back, a ragged last block,
        // and the grid's longest-first order, causal (by sections of heads) and not.
        (deep_grid(head_dim), AttentionOptions::default()),
        (deep_grid(head_dim), AttentionOptions::causal(Causal::BottomRight)),
        (deep_grid(head_dim), AttentionOptions { scale: Some(-0.2), causal: Causal::TopLeft, ..Default::default() }),
        (deep_causal_grid(head_dim), AttentionOptions::causal(Causal::BottomRight)),
        // Sliding windows: narrower than a key tile (whole tiles skipped at both ends), wider
        // than several, open on one side, top-left, with a causal mask, rows that see nothing.
        (shape(2, 4, 2, 1000, 1000), AttentionOptions::default().with_window(SlidingWindow::left(100))),
        (shape(1, 4, 4, 700, 900), AttentionOptions::default().with_window(SlidingWindow::new(Some(300), Some(40)))),
        (
            shape(1, 2, 1, 600, 400),
            AttentionOptions::causal(Causal::TopLeft).with_window(SlidingWindow::left(7).top_left()),
        ),
        (shape(1, 2, 2, 500, 300), AttentionOptions::default().with_window(SlidingWindow::new(None, Some(20)))),
        (shape(1, 2, 2, 300, 500), AttentionOptions::default().with_window(SlidingWindow::new(Some(130), None))),
        (deep_grid(head_dim), AttentionOptions::default().with_window(SlidingWindow::left(255))),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let seed = (head_dim + i) as u64;
        check_hopper_forward::<f16>(ctx, shape, options, 100 + seed);
        check_hopper_forward::<bf16>(ctx, shape, options, 300 + seed);
    }
}

/// The lengths models run (issue 20: 1, 17, 197, 577, 1023 tokens) on grids of many more units
/// (query blocks) than an H200 keeps resident, so that the persistent forward's blocks take
/// several units each, of different lengths under a causal mask: at 197 tokens and head_dim 64,
/// 100 heads of 4 units of 64 rows make 400 units for 264 resident blocks. GQA and cross
/// attention (seqlen_q ≠ seqlen_k) too.
#[test]
fn hopper_forward_runs_model_lengths_on_persistent_grids() {
    let Some(ctx) = hopper("hopper_forward_runs_model_lengths_on_persistent_grids") else { return };
    let (none, top_left, bottom_right) = (
        AttentionOptions::default(),
        AttentionOptions::causal(Causal::TopLeft),
        AttentionOptions::causal(Causal::BottomRight),
    );
    for head_dim in [64, 128, 256] {
        let shape = |b, hq, hkv, sq, sk| gqa(b, hq, hkv, sq, sk, head_dim);
        let cases = [
            (shape(1, 300, 100, 1, 1), none, bottom_right),
            (shape(1, 300, 300, 17, 17), top_left, none),
            (shape(4, 25, 25, 197, 197), none, bottom_right),
            (shape(2, 32, 8, 577, 577), top_left, none),
            (shape(1, 40, 40, 1023, 1023), top_left, none),
            (shape(2, 60, 60, 197, 577), bottom_right, top_left),
        ];
        for (i, (shape, for_f16, for_bf16)) in cases.into_iter().enumerate() {
            let seed = (10 * head_dim + i) as u64;
            check_hopper_forward::<f16>(ctx, shape, for_f16, 500 + seed);
            check_hopper_forward::<bf16>(ctx, shape, for_bf16, 700 + seed);
        }
    }
}

/// A context on the sm_90a path whatever `RUST_ATTENTION_KERNELS` says, so that the Hopper
/// kernels run through the public entry points in both of the suite's runs.
fn sm90a_context(ctx: &Context) -> Context {
    Context::new(ctx.device().ordinal).unwrap().with_kernel_path(KernelPath::Sm90a).unwrap()
}

/// The Hopper backward in dQ mode `dq` (called directly, outputs poisoned with NaN) after the
/// Hopper forward, on fresh inputs of `shape`, against the float64 reference on the same rounded
/// inputs.
fn check_hopper_backward<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    options: AttentionOptions,
    dq: DqAccumulation,
    seed: u64,
) {
    let problem = Problem16::<T>::new(ctx, shape, seed, Inputs::Normal);
    let [q, k, v, _] = &problem.device;
    let fwd = ctx.flash_attention_forward_hopper(q, k, v, &options).unwrap();
    let grads = hopper_gradients(ctx, &problem, &fwd, options, dq);
    let [qh, kh, vh, doh] = &problem.host;
    let params = cpu::Params::of(&options, shape.head_dim);
    // The exact gradient of the O the backward was handed (`cpu::attention_backward_given_o`),
    // once that O is checked itself: the reference takes its D from it, as the kernel does, so a
    // wrong O row would otherwise go unseen.
    let o = to_f32_vec(&fwd.o.to_host().unwrap());
    let (o_tolerance, tolerance) = tolerances(T::DTYPE);
    let err_o = relative_l2_error(&o, &cpu::attention(qh, kh, vh, &shape, params).unwrap().o);
    assert!(err_o <= o_tolerance, "{} forward {options:?} on {shape:?}: O relative L2 error {err_o:.3e}", T::DTYPE);
    let reference = cpu::attention_backward_given_o(qh, kh, vh, &o, doh, &shape, params).unwrap();
    for (name, got, want) in
        [("dQ", &grads[0], &reference.dq), ("dK", &grads[1], &reference.dk), ("dV", &grads[2], &reference.dv)]
    {
        let err = relative_l2_error(&to_f32_vec(got), want);
        assert!(err <= tolerance, "{} {dq:?} {options:?} on {shape:?}: {name} relative L2 error {err:.3e}", T::DTYPE);
    }
}

/// dQ, dK and dV of one call of the Hopper backward on `problem` (outputs poisoned with NaN
/// first), copied to the host.
fn hopper_gradients<T: Element>(
    ctx: &Context,
    problem: &Problem16<T>,
    fwd: &AttentionOutput<T>,
    options: AttentionOptions,
    dq: DqAccumulation,
) -> [Vec<T>; 3] {
    let [q, k, v, d_o] = &problem.device;
    let shape = problem.shape;
    let nan = T::from_f32(f32::NAN);
    let mut grads = Gradients {
        dq: ctx.full(&shape.q_shape(), nan).unwrap(),
        dk: ctx.full(&shape.kv_shape(), nan).unwrap(),
        dv: ctx.full(&shape.kv_shape(), nan).unwrap(),
        d_sinks: options.sinks.map(|_| ctx.full(&[shape.num_heads_q], f32::NAN).unwrap()),
        d_bias: None,
    };
    ctx.flash_attention_backward_hopper_into(q, k, v, &fwd.o, &fwd.lse, d_o, &mut grads, &options, dq).unwrap();
    [grads.dq.to_host().unwrap(), grads.dk.to_host().unwrap(), grads.dv.to_host().unwrap()]
}

#[test]
fn hopper_backward_matches_the_reference() {
    let Some(ctx) = hopper("hopper_backward_matches_the_reference") else { return };
    // 64 to 128 (80 and 96 in tiles of two column blocks, the second one partly padding), and
    // the wide-head kernel (64 keys a block) at 160, 192 and 256.
    for head_dim in [64, 80, 96, 128, 160, 192, 256] {
        let shape =
            |batch, heads_q, heads_kv, seqlen_q, seqlen_k| gqa(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim);
        // Key blocks of 128 (64 above head_dim 128) and query tiles of 64: whole, ragged on
        // either side, a block that no query sees (bottom-right with seqlen_q < seqlen_k), GQA,
        // negative scale, sections.
        let cases = [
            (shape(1, 1, 1, 1, 1), AttentionOptions::default()),
            (shape(2, 4, 2, 256, 256), AttentionOptions::default()),
            (shape(2, 4, 2, 333, 333), AttentionOptions::causal(Causal::TopLeft)),
            (shape(1, 2, 2, 65, 200), AttentionOptions::causal(Causal::BottomRight)),
            (shape(1, 2, 2, 200, 37), AttentionOptions::causal(Causal::BottomRight)),
            (shape(1, 2, 2, 200, 130), AttentionOptions::causal(Causal::TopLeft)),
            (shape(1, 3, 3, 130, 300), AttentionOptions::with_scale(-0.3)),
            (shape(1, 8, 2, 300, 257), AttentionOptions::default()),
            // A causal grid taken in several sections of heads: with 16 query heads per
            // key/value head, a head's Q, dO and dQ come to 8 MiB (head_dim 64) or 16 MiB (128),
            // so the 16 key/value heads make 2 or 4 sections of the backward's 64 MiB.
            (shape(2, 128, 8, 1024, 256), AttentionOptions::causal(Causal::BottomRight)),
            // Sliding windows (key blocks that visit only the query tiles of their window, and
            // deterministic turns that count from a tile's first or last key block).
            (shape(1, 4, 2, 1000, 1000), AttentionOptions::default().with_window(SlidingWindow::left(100))),
            (
                shape(1, 2, 2, 700, 900),
                AttentionOptions::default().with_window(SlidingWindow::new(Some(300), Some(40))),
            ),
            (shape(1, 2, 1, 500, 300), AttentionOptions::default().with_window(SlidingWindow::new(Some(130), None))),
            (shape(1, 2, 2, 600, 400), AttentionOptions::causal(Causal::TopLeft).with_window(SlidingWindow::left(7))),
        ];
        // The deterministic mode stops at head_dim 128 (above, it runs on the sm_80 kernels).
        let modes: &[DqAccumulation] = match head_dim {
            ..=128 => &[DqAccumulation::Atomic, DqAccumulation::Deterministic],
            _ => &[DqAccumulation::Atomic],
        };
        for (i, (shape, options)) in cases.into_iter().enumerate() {
            let seed = 500 + (head_dim + i) as u64;
            for &dq in modes {
                check_hopper_backward::<f16>(ctx, shape, options, dq, seed);
                check_hopper_backward::<bf16>(ctx, shape, options, dq, seed + 1);
            }
        }
    }
}

/// The deterministic Hopper backward gives the same bits on every run: dQ (whose tiles the key
/// blocks add in turns) as well as dK and dV, on grids where many key blocks add to each dQ
/// tile at once (8192 keys: 64 key blocks a head), with and without a causal mask, GQA, head
/// dims 64, 96 and 128, both types. Its dQ also matches the atomic mode's to within rounding.
#[test]
fn hopper_deterministic_backward_is_bit_identical() {
    let Some(ctx) = hopper("hopper_deterministic_backward_is_bit_identical") else { return };
    fn runs<T: Element>(ctx: &Context, shape: AttentionShape, options: AttentionOptions, seed: u64) {
        let problem = Problem16::<T>::new(ctx, shape, seed, Inputs::Normal);
        let [q, k, v, _] = &problem.device;
        let fwd = ctx.flash_attention_forward_hopper(q, k, v, &options).unwrap();
        let bits =
            |grads: &[Vec<T>; 3]| grads.each_ref().map(|g| g.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>());
        let first = hopper_gradients(ctx, &problem, &fwd, options, DqAccumulation::Deterministic);
        let first_bits = bits(&first);
        for run in 1..4 {
            let again = bits(&hopper_gradients(ctx, &problem, &fwd, options, DqAccumulation::Deterministic));
            for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
                let differing = first_bits[i].iter().zip(&again[i]).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differing,
                    0,
                    "{} {options:?} on {shape:?}, run {run}: {differing} elements of {name} differ",
                    T::DTYPE
                );
            }
        }
        let atomic = hopper_gradients(ctx, &problem, &fwd, options, DqAccumulation::Atomic);
        let err = relative_l2_error(
            &to_f32_vec(&atomic[0]),
            &to_f32_vec(&first[0]).iter().map(|&x| x as f64).collect::<Vec<_>>(),
        );
        assert!(err <= 1e-2, "{} {options:?} on {shape:?}: dQ atomic against deterministic {err:.3e}", T::DTYPE);
    }
    for head_dim in [64, 96, 128] {
        let shape = gqa(1, 4, 2, 8192, 8192, head_dim);
        runs::<f16>(ctx, shape, AttentionOptions::default(), 31 + head_dim as u64);
        runs::<bf16>(ctx, shape, AttentionOptions::causal(Causal::TopLeft), 37 + head_dim as u64);
        let ragged = gqa(2, 6, 3, 1000, 1500, head_dim);
        runs::<bf16>(ctx, ragged, AttentionOptions::causal(Causal::BottomRight), 41 + head_dim as u64);
        // More queries than keys, bottom-right: the first query tiles see no key (no turns).
        let tall = gqa(1, 4, 2, 1500, 1000, head_dim);
        runs::<f16>(ctx, tall, AttentionOptions::causal(Causal::BottomRight), 43 + head_dim as u64);
        // Sliding windows, with and without a right edge: turns counted from each tile's last
        // key block (decreasing) or its first (increasing).
        runs::<bf16>(ctx, shape, AttentionOptions::default().with_window(SlidingWindow::left(1000)), 47);
        let open_right = AttentionOptions::default().with_window(SlidingWindow::new(Some(700), None));
        runs::<f16>(ctx, shape, open_right, 53 + head_dim as u64);
    }
}

/// Head dims between the compiled ones (multiples of 8, the unit of a tensor map's row stride)
/// run on the next compiled Hopper kernel: the TMA boxes read zeros past the last column, the
/// stores and the dQ reduction skip it. Forward and backward, both types, ragged GQA shapes, both
/// causal alignments. Head dims that are not multiples of 8 take the sm_80 kernels.
#[test]
fn hopper_padded_head_dims_match_the_reference() {
    let Some(ctx) = hopper("hopper_padded_head_dims_match_the_reference") else { return };
    for head_dim in [8, 40, 72, 88, 104, 120] {
        let cases = [
            (gqa(1, 4, 2, 200, 333, head_dim), AttentionOptions::causal(Causal::BottomRight)),
            (gqa(2, 2, 2, 65, 129, head_dim), AttentionOptions::default()),
            (gqa(1, 2, 1, 300, 197, head_dim), AttentionOptions::causal(Causal::TopLeft)),
        ];
        for (i, (shape, options)) in cases.into_iter().enumerate() {
            let seed = 900 + (10 * head_dim + i) as u64;
            check_hopper_forward::<f16>(ctx, shape, options, seed);
            check_hopper_forward::<bf16>(ctx, shape, options, seed + 1);
            // Each case in one dQ mode, the modes alternating.
            let dq = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
            check_hopper_backward::<f16>(ctx, shape, options, dq, seed + 2);
            check_hopper_backward::<bf16>(ctx, shape, options, dq, seed + 3);
        }
    }
    // Above 128 the Hopper forward and backward run on the 160, 192 and 256 kernels (the
    // backward's wide-head kernel in atomic dQ only).
    for head_dim in [136, 152, 176, 200, 248] {
        let cases = [
            (gqa(1, 4, 2, 200, 333, head_dim), AttentionOptions::causal(Causal::BottomRight)),
            (gqa(1, 2, 1, 300, 197, head_dim), AttentionOptions::causal(Causal::TopLeft)),
        ];
        for (i, (shape, options)) in cases.into_iter().enumerate() {
            let seed = 1900 + (10 * head_dim + i) as u64;
            check_hopper_forward::<f16>(ctx, shape, options, seed);
            check_hopper_forward::<bf16>(ctx, shape, options, seed + 1);
            check_hopper_backward::<f16>(ctx, shape, options, DqAccumulation::Atomic, seed + 2);
            check_hopper_backward::<bf16>(ctx, shape, options, DqAccumulation::Atomic, seed + 3);
        }
    }
    let sm90a = sm90a_context(ctx);
    let shape = |head_dim| gqa(1, 4, 2, 300, 300, head_dim);
    let paths = [
        (96, "sm_90a"),
        (40, "sm_90a"),
        (72, "sm_90a"),
        (100, "sm_80"),
        (17, "sm_80"),
        (160, "sm_90a"),
        (200, "sm_90a"),
    ];
    for (head_dim, path) in paths {
        let tile = TileConfig::default_for_dtype(DType::F16, head_dim);
        let label = sm90a.forward_kernel_label(DType::F16, &shape(head_dim), tile, &AttentionOptions::default());
        assert!(label.starts_with(path), "head_dim {head_dim}: {label}");
    }
}

#[test]
fn the_kernel_path_picks_the_backward_kernel() {
    let Some(ctx) = hopper("the_kernel_path_picks_the_backward_kernel") else { return };
    let sm90a = sm90a_context(ctx);
    let none = AttentionOptions::default();
    for head_dim in [64, 96, 128] {
        let tile = TileConfig::default_backward_for_dtype(DType::Bf16, head_dim);
        let mode = sm90a.dq_accumulation_for(DType::Bf16, head_dim);
        let label = sm90a.backward_kernel_label(DType::Bf16, head_dim, tile, mode, &none);
        // The Hopper backward, with atomic dQ by default ...
        assert!(label.starts_with("sm_90a") && mode == DqAccumulation::Atomic, "{label} {mode:?}");
        // ... and for a deterministic dQ its deterministic instance, unless
        // RUST_ATTENTION_HOPPER_DETERMINISTIC=0 asks for the sm_80 kernels.
        let label = sm90a.backward_kernel_label(DType::Bf16, head_dim, tile, DqAccumulation::Deterministic, &none);
        let hopper = std::env::var("RUST_ATTENTION_HOPPER_DETERMINISTIC").as_deref() != Ok("0");
        let expected = if hopper { "sm_90a m64_n128_s2_deterministic" } else { "sm_80" };
        assert!(label.starts_with(expected), "{label}");
    }
    // Through the public entry point, poisoned outputs, against the reference.
    for head_dim in [64, 128] {
        let shape =
            AttentionShape { batch: 1, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 300, seqlen_k: 300, head_dim };
        let (fwd, bwd) = (
            TileConfig::default_for_dtype(DType::Bf16, head_dim),
            TileConfig::default_backward_for_dtype(DType::Bf16, head_dim),
        );
        let options = AttentionOptions::causal(Causal::TopLeft);
        let seed = 77 + head_dim as u64;
        for dq in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            check16::<bf16>(&sm90a, shape, fwd, Some((bwd, dq)), options, seed, Inputs::Normal);
        }
    }
}

#[test]
fn the_kernel_path_picks_the_forward_kernel() {
    let Some(ctx) = hopper("the_kernel_path_picks_the_forward_kernel") else { return };
    let default = TileConfig::default_for_dtype(DType::F16, 64);
    let sm80 = Context::new(ctx.device().ordinal).unwrap().with_kernel_path(KernelPath::Sm80).unwrap();
    let sm90a = Context::new(ctx.device().ordinal).unwrap().with_kernel_path(KernelPath::Sm90a).unwrap();
    let small =
        AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q: 300, seqlen_k: 300, head_dim: 64 };
    let none = AttentionOptions::default();
    assert!(
        sm90a.forward_kernel_entry(DType::F16, &small, default, &none).unwrap().starts_with("hopper_flash_fwd_f16")
    );
    assert!(sm80.forward_kernel_entry(DType::F16, &small, default, &none).unwrap().starts_with("flash_fwd_f16"));
    // At head_dim 64 (`HopperForward::head_dim_64_tile`), without a mask: a grid of less than a
    // wave runs two consumer warpgroups with ping-pong turns, a deeper one three (see
    // `deep_grid` in the forward cases). (A grid of fewer units than fit on the GPU is one block
    // per unit; a deeper one is persistent.)
    let label = |shape: &AttentionShape, causal| {
        sm90a.forward_kernel_label(DType::F16, shape, default, &AttentionOptions::causal(causal))
    };
    let none = Causal::None;
    let long = AttentionShape { seqlen_k: 1000, ..small };
    assert_eq!(label(&long, none), "sm_90a m128_n128_s2_pingpong");
    assert_eq!(label(&deep_grid(64), none), "sm_90a m192_n128_s2 persistent");
    // Up to 640 keys with a partial last 128-key tile, one consumer over 64-key tiles, three
    // blocks per SM (ViT's 197 tokens); whole 128-key tiles up to 256 keys keep them.
    assert_eq!(label(&small, none), "sm_90a m64_n64_s2");
    let short = AttentionShape { seqlen_q: 197, seqlen_k: 197, ..small };
    assert_eq!(label(&short, none), "sm_90a m64_n64_s2");
    let vit = AttentionShape { batch: 256, num_heads_q: 12, num_heads_kv: 12, ..short };
    assert_eq!(label(&vit, none), "sm_90a m64_n64_s2 persistent");
    let whole = AttentionShape { seqlen_k: 256, ..small };
    assert_eq!(label(&whole, none), "sm_90a m64_n128_s2");
    // Causal, one consumer: 64-key tiles up to 2048 keys, 128-key ones up to 4096.
    assert_eq!(label(&deep_grid(64), Causal::TopLeft), "sm_90a m64_n64_s2 persistent dynamic");
    assert_eq!(label(&deep_causal_grid(64), Causal::TopLeft), "sm_90a m64_n128_s2 persistent dynamic");
    // Above head_dim 128, two consumers over smaller key tiles (96 keys at 160 and 192, 64 at
    // 256); a head_dim between compiled ones on the next.
    for (head_dim, want) in [
        (256, "sm_90a m128_n64_s2"),
        (192, "sm_90a m128_n96_s2"),
        (160, "sm_90a m128_n96_s2"),
        (152, "sm_90a m128_n96_s2 on d160"),
        (88, "sm_90a m128_n128_s2 on d96"),
    ] {
        let wide = AttentionShape { head_dim, ..small };
        let tile = TileConfig::default_for_dtype(DType::F16, head_dim);
        assert_eq!(sm90a.forward_kernel_label(DType::F16, &wide, tile, &AttentionOptions::default()), want);
    }
    // A bias runs on the sm_80 kernel of the default tile (the Hopper kernels do not read one),
    // and the label and entry say so.
    let bias = sm90a.full(&[1, 1, small.seqlen_q, small.seqlen_k], 0.5f32).unwrap();
    let biased = AttentionOptions::default().with_bias(&bias);
    assert!(sm90a.forward_kernel_label(DType::F16, &small, default, &biased).starts_with("sm_80 "));
    assert!(sm90a.forward_kernel_entry(DType::F16, &small, default, &biased).unwrap().starts_with("flash_fwd_f16"));
    // An explicit tile runs the sm_80 kernel it names on either path; f32 never leaves sm_80.
    let explicit = TileConfig::new(64, 64).with_stages(2);
    let none = AttentionOptions::default();
    let entry = sm90a.forward_kernel_entry(DType::F16, &small, explicit, &none).unwrap();
    assert!(entry.starts_with("flash_fwd_f16_m64_n64"));
    let f32_tile = TileConfig::default_for_dtype(DType::F32, 64);
    assert!(sm90a.forward_kernel_entry(DType::F32, &small, f32_tile, &none).unwrap().starts_with("flash_fwd_f32"));

    // Both paths agree with each other on the same inputs, through the public entry point.
    let shape =
        AttentionShape { batch: 2, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 300, seqlen_k: 300, head_dim: 64 };
    let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape()];
    let host: Vec<Vec<f16>> =
        (0..3).map(|i| from_f32_slice(&random_normal(shapes[i].iter().product(), 40 + i as u64))).collect();
    let run = |ctx: &Context| {
        let [q, k, v] = [0, 1, 2].map(|i| ctx.upload(&host[i], &shapes[i]).unwrap());
        let options = AttentionOptions::causal(Causal::TopLeft);
        let out = ctx.flash_attention_forward(&q, &k, &v, &options, default).unwrap();
        to_f32_vec(&out.o.to_host().unwrap())
    };
    let (a, b) = (run(&sm80), run(&sm90a));
    let err = relative_l2_error(&b, &a.iter().map(|&x| x as f64).collect::<Vec<_>>());
    assert!(err < 2e-3, "sm_80 and sm_90a forward differ by {err:.3e}");
}

#[test]
fn hopper_forward_refuses_what_it_does_not_cover() {
    let Some(ctx) = hopper("hopper_forward_refuses_what_it_does_not_cover") else { return };
    // A head_dim that is not a multiple of 8 cannot have a tensor map (rows of 200 bytes).
    let x = ctx.upload(&from_f32_slice::<f16>(&random_normal(128 * 100, 1)), &[1, 1, 128, 100]).unwrap();
    let err = ctx.flash_attention_forward_hopper(&x, &x, &x, &AttentionOptions::default()).unwrap_err();
    assert!(matches!(err, attn_host::Error::HeadDimNotCompiled { head_dim: 100, .. }), "{err}");
    let x = ctx.upload(&random_normal(128 * 64, 1), &[1, 1, 128, 64]).unwrap();
    let err = ctx.flash_attention_forward_hopper(&x, &x, &x, &AttentionOptions::default()).unwrap_err();
    assert!(matches!(err, attn_host::Error::Shape(_)), "{err}");
}

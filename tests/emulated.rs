//! Every kernel family run through the CPU emulator, in plain `cargo test` on any machine: the
//! kernels' own source, not a reference, against the float64 CPU reference, with ragged tails,
//! causal masks and GQA; and the emulator's own checks on kernels with planted bugs.
//!
//! Shapes are small: the emulator runs one OS thread per GPU thread. Each test prints how many
//! emulated cases it ran.

mod common;

use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

use attn_host::check::{random_normal, relative_l2_error};
use attn_host::{AttentionShape, Causal, Context, DqAccumulation, TileConfig, cpu};
use attn_kernels::emu::{self, Arg, EmuErrorKind, Launch};
use common::attention::{Extras, Kernel, check, check_with_extras, check_with_sinks, poisoned_rows};
use common::decode::{DecodeCase, check_decode};
use common::tensor_cores::{Inputs, check16, check16_with_extras, check16_with_sinks};

fn emulator() -> &'static Context {
    static CONTEXT: OnceLock<Context> = OnceLock::new();
    CONTEXT.get_or_init(Context::cpu_emulated)
}

/// Prints, outside the test harness's capture, how many emulated cases a test ran.
fn report(test: &str, cases: u64) {
    let line = format!("{test}: {cases} emulated cases passed\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

fn options(causal: Causal) -> attn_host::AttentionOptions<'static> {
    attn_host::AttentionOptions::causal(causal)
}

#[test]
fn emulated_vector_add_every_tail() {
    let ctx = emulator();
    let lengths = [1, 2, 3, 4, 5, 255, 257, 1023, 40_003];
    for len in lengths {
        let (a, b) = (random_normal(len, len as u64), random_normal(len, len as u64 + 1));
        let (da, db) = (ctx.upload(&a, &[len]).unwrap(), ctx.upload(&b, &[len]).unwrap());
        let mut dc = ctx.full(&[len], f32::NAN).unwrap();
        ctx.vector_add_into(&da, &db, &mut dc).unwrap();
        let err = relative_l2_error(&dc.to_host().unwrap(), &cpu::vector_add(&a, &b).unwrap());
        assert!(err <= 1e-7, "emulated vector_add of {len}: {err:.3e}");
    }
    report("emulated_vector_add_every_tail", lengths.len() as u64);
}

/// Naive forward and backward (scores, softmax, P·V, Pᵀ·X, dS, the D preprocess) with every
/// mask, cross lengths and a GQA group.
#[test]
fn emulated_naive_attention_forward_and_backward() {
    let ctx = emulator();
    let mut cases = 0;
    for (seqlen_q, seqlen_k) in [(17, 23), (23, 9)] {
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let shape = AttentionShape { batch: 2, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 20 };
            check(ctx, shape, Kernel::Naive, options(causal), cases, true);
            cases += 1;
        }
    }
    report("emulated_naive_attention_forward_and_backward", cases);
}

/// The flash forward and both backward modes at every compiled head_dim, on ragged causal GQA
/// shapes, with tiles of every block_m and block_n.
#[test]
fn emulated_flash_forward_and_backward() {
    let ctx = emulator();
    let mut cases = 0;
    let runs = [
        (32, TileConfig::new(16, 16), Causal::None, DqAccumulation::Atomic),
        (32, TileConfig::new(16, 32), Causal::TopLeft, DqAccumulation::Deterministic),
        (64, TileConfig::new(32, 16), Causal::BottomRight, DqAccumulation::Atomic),
        (64, TileConfig::new(64, 64), Causal::TopLeft, DqAccumulation::Deterministic),
        (128, TileConfig::new(16, 64), Causal::None, DqAccumulation::Deterministic),
        (128, TileConfig::new(32, 32), Causal::BottomRight, DqAccumulation::Atomic),
        // Head dims between the compiled ones, on the next compiled kernel: rows that are still
        // 16-byte aligned (20, 100) and rows that are not (30, 7), and 200 on the 256 kernels.
        (20, TileConfig::new(16, 32), Causal::BottomRight, DqAccumulation::Atomic),
        (30, TileConfig::new(32, 16), Causal::TopLeft, DqAccumulation::Deterministic),
        (7, TileConfig::new(16, 16), Causal::None, DqAccumulation::Atomic),
        (100, TileConfig::new(16, 16), Causal::TopLeft, DqAccumulation::Atomic),
        (200, TileConfig::new(16, 32), Causal::BottomRight, DqAccumulation::Deterministic),
    ];
    for (head_dim, tile, causal, mode) in runs {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 37, seqlen_k: 45, head_dim };
        check(ctx, shape, Kernel::Flash(tile, mode), options(causal), 100 + cases, true);
        cases += 1;
    }
    // Rows that see no key (bottom-right, seqlen_q > seqlen_k), through every flash kernel.
    let shape = AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 40, seqlen_k: 9, head_dim: 32 };
    for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
        check(ctx, shape, Kernel::Flash(TileConfig::new(16, 16), mode), options(Causal::BottomRight), 200, true);
        cases += 1;
    }
    report("emulated_flash_forward_and_backward", cases);
}

/// The five smallest failures of `gpu_tensor_cores`' random test found on an H100 (2026-12-06):
/// two keys and large logits (scale 1 at head_dim 8–155, or −0.2), or head_dim 1, so each row's
/// softmax is nearly or exactly one-hot and dS = P ∘ (dP − D) almost cancels. The kernels were
/// right: the test had judged dQ against the exact O's gradient, where D differs by O's
/// rounding, and relative to a dQ of ~1e-11. `check16` now takes the exact gradient of the O the backward was handed
/// (`cpu::attention_backward_given_o`) with an absolute floor; these must pass, as they do on
/// the GPU (the emulator reproduces its errors to the digit).
#[test]
fn emulated_backward_on_nearly_one_hot_rows() {
    let ctx = emulator();
    let shape = |heads_q, seqlen_q, seqlen_k, head_dim| AttentionShape {
        batch: 1,
        num_heads_q: heads_q,
        num_heads_kv: 1,
        seqlen_q,
        seqlen_k,
        head_dim,
    };
    let first = |kernel, dtype, head_dim| TileConfig::compiled_for(kernel, dtype, head_dim)[0];
    // (shape, causal, scale, bf16, the random test's seed)
    let cases = [
        (shape(1, 2, 2, 155), Causal::None, Some(1.0), false, 109_260_159u64),
        (shape(1, 1, 2, 8), Causal::BottomRight, Some(1.0), false, 525_230_694),
        (shape(1, 2, 2, 80), Causal::None, Some(-0.2), true, 1_061_338_907),
        (shape(4, 210, 2, 1), Causal::None, None, true, 488_193_444),
        (shape(1, 2, 2, 80), Causal::None, Some(1.0), false, 421_708_977),
    ];
    for (shape, causal, scale, bf, seed) in cases {
        let options = attn_host::AttentionOptions { scale, causal, ..Default::default() };
        let dtype = if bf { attn_host::DType::Bf16 } else { attn_host::DType::F16 };
        let d = shape.head_dim;
        let fwd = first(attn_host::FlashKernel::Forward, dtype, d);
        let bwd = Some((first(attn_host::FlashKernel::Backward, dtype, d), DqAccumulation::Atomic));
        // The random test's inputs: its seed times 4 (Q, K, V, dO draw seeds s … s + 3).
        if bf {
            check16::<attn_host::bf16>(ctx, shape, fwd, bwd, options, seed * 4, Inputs::Normal);
        } else {
            check16::<attn_host::f16>(ctx, shape, fwd, bwd, options, seed * 4, Inputs::Normal);
        }
    }
    report("emulated_backward_on_nearly_one_hot_rows", cases.len() as u64);
}

/// A NaN or ∞ in Q, K or V reaches exactly the rows that see it, through the kernels' own code.
/// The KV-cache decoder (level 10) from its Rust source: GQA packing, splits with their merge
/// (and a split count above the key tiles, whose extra splits see nothing), ragged and empty
/// sequences, paged and token- or head-major caches, an append, bottom-right causal with
/// several queries, a padded head_dim.
#[test]
fn emulated_decoder_with_splits_pages_and_appends() {
    let ctx = emulator();
    let mut cases = Vec::new();
    let mut case = DecodeCase::simple(2, (4, 2), 1, 64, 70);
    case.num_splits = Some(1);
    cases.push(case.clone());
    case.num_splits = Some(3);
    cases.push(case.clone());
    let mut case = DecodeCase::simple(3, (8, 2), 2, 40, 0);
    case.cached = vec![37, 0, 100];
    case.capacity = 128;
    case.page_size = Some(32);
    case.layout = attn_host::Layout::Bhsd;
    case.causal = Causal::BottomRight;
    case.num_splits = Some(2);
    cases.push(case.clone());
    case.new_keys = 3;
    case.num_splits = Some(9);
    case.layout = attn_host::Layout::Bshd;
    cases.push(case);
    let mut case = DecodeCase::simple(1, (2, 2), 5, 128, 29);
    case.causal = Causal::BottomRight;
    case.new_keys = 2;
    case.capacity = 40;
    case.num_splits = Some(2);
    cases.push(case);
    for (i, case) in cases.iter().enumerate() {
        check_decode::<attn_host::f16>(ctx, case, 40 + i as u64);
        check_decode::<attn_host::bf16>(ctx, case, 50 + i as u64);
    }
    report("emulated_decoder_with_splits_pages_and_appends", 2 * cases.len() as u64);
}

/// The decoder with what models' decoding layers add: sliding windows (Mistral's causal one,
/// one open on the right, one reaching past the keys), softcapping (Gemma 2), ALiBi (with GQA:
/// each packed row its head's slope), attention sinks (GPT-OSS: with a window, on empty
/// sequences, merged by the block with one split and by the merge kernel with several).
#[test]
fn emulated_decoder_with_windows_score_mods_and_sinks() {
    use attn_host::{ScoreMod, SlidingWindow};
    let ctx = emulator();
    let mut cases = Vec::new();
    let mut base = DecodeCase::simple(3, (8, 2), 3, 64, 0);
    base.cached = vec![90, 0, 37];
    base.capacity = 128;
    base.causal = Causal::BottomRight;
    for (window, splits) in [
        (SlidingWindow::left(20), Some(1)),
        (SlidingWindow::left(20), Some(3)),
        (SlidingWindow::new(Some(5), None), Some(2)),
        (SlidingWindow::new(Some(200), Some(1)), Some(1)),
    ] {
        cases.push(DecodeCase { window: Some(window), num_splits: splits, ..base.clone() });
    }
    cases.push(DecodeCase { score: ScoreMod::softcap(5.0), num_splits: Some(2), ..base.clone() });
    cases.push(DecodeCase {
        score: ScoreMod::alibi(attn_host::Alibi::standard()),
        num_splits: Some(1),
        ..base.clone()
    });
    for splits in [Some(1), Some(4)] {
        cases.push(DecodeCase {
            sinks: true,
            window: Some(SlidingWindow::left(16)),
            num_splits: splits,
            ..base.clone()
        });
    }
    let mut paged = DecodeCase { sinks: true, score: ScoreMod::softcap(30.0), ..base.clone() };
    paged.page_size = Some(32);
    paged.layout = attn_host::Layout::Bhsd;
    paged.new_keys = 2;
    paged.window = Some(SlidingWindow::left(40));
    cases.push(paged);
    // A +∞ sink takes every row's whole weight: O = 0 and LSE = +∞ (not NaN), with one split
    // and with several; a −∞ sink is none.
    for (value, splits) in [(f32::INFINITY, Some(1)), (f32::INFINITY, Some(3)), (f32::NEG_INFINITY, Some(2))] {
        cases.push(DecodeCase { sinks: true, sink_value: Some(value), num_splits: splits, ..base.clone() });
    }
    for (i, case) in cases.iter().enumerate() {
        check_decode::<attn_host::f16>(ctx, case, 70 + i as u64);
        check_decode::<attn_host::bf16>(ctx, case, 90 + i as u64);
    }
    report("emulated_decoder_with_windows_score_mods_and_sinks", 2 * cases.len() as u64);
}

#[test]
fn emulated_nan_and_infinity_reach_exactly_the_rows_that_see_them() {
    let ctx = emulator();
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 40, seqlen_k: 40, head_dim: 32 };
    for kernel in [Kernel::Naive, Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Atomic)] {
        poisoned_rows(ctx, kernel, shape);
    }
    report("emulated_nan_and_infinity_reach_exactly_the_rows_that_see_them", 8);
}

// ---------------------------------------------------------------------------------------------
// The emulator's own checks, on kernels with planted bugs (`attn_kernels::emu::selftest`).
// ---------------------------------------------------------------------------------------------

/// Runs a self-test kernel on one block of 64 threads writing to a 64-float output.
#[allow(clippy::result_large_err)] // the error is the point of these tests
fn run_selftest(kernel: &emu::HostKernel, timeout: Duration) -> Result<Vec<f32>, emu::EmuError> {
    let mut out = vec![0.0f32; 64];
    let launch = Launch { grid: (1, 1, 1), block: 64, shared_bytes: 64 * 4, barrier_timeout: timeout };
    // SAFETY: the self-test kernels write at most 64 floats through their one pointer.
    unsafe { emu::launch(kernel, launch, &[Arg::Ptr(out.as_mut_ptr())]) }?;
    Ok(out)
}

#[test]
fn emulator_reports_a_missing_barrier() {
    let err = run_selftest(&emu::selftest::emu_missing_barrier, Duration::from_secs(30)).unwrap_err();
    assert_eq!(err.kernel, "missing_barrier");
    assert_eq!(err.block, Some((0, 0, 0)));
    assert!(err.thread.is_some());
    assert!(
        matches!(err.kind, EmuErrorKind::SharedRace { .. } | EmuErrorKind::SharedUninitialised { .. }),
        "expected a race report, got: {err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("missing_barrier") && message.contains("offset") && message.contains("barrier"),
        "{message}"
    );
    // With the barrier in place the same kernel passes and reads its neighbour's value.
    let out = run_selftest(&emu::selftest::emu_with_barrier, Duration::from_secs(30)).unwrap();
    assert_eq!(out[0], 1.0);
    assert_eq!(out[63], 0.0);
}

#[test]
fn emulator_reports_divergent_and_abandoned_barriers() {
    let err = run_selftest(&emu::selftest::emu_divergent_barrier, Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err.kind, EmuErrorKind::DivergentBarrier { .. }), "expected a divergent barrier, got: {err}");
    // Found when the 63 others are there and the 64th has returned, not by a timeout: a loaded
    // machine (the suite on several kernel paths side by side) once let a 300 ms timeout expire
    // with only 43 arrived.
    let err = run_selftest(&emu::selftest::emu_early_return, Duration::from_secs(30)).unwrap_err();
    match &err.kind {
        EmuErrorKind::AbandonedBarrier { arrived, expected, .. } => {
            assert_eq!((*arrived, *expected), (63, 64), "{err}")
        }
        _ => panic!("expected an abandoned barrier, got: {err}"),
    }
}

#[test]
fn emulator_reports_an_out_of_bounds_shared_access() {
    let err = run_selftest(&emu::selftest::emu_out_of_bounds, Duration::from_secs(30)).unwrap_err();
    match &err.kind {
        EmuErrorKind::SharedOutOfBounds { offset, bytes, size, site } => {
            assert_eq!((*offset, *bytes, *size), (256, 4, 256), "{err}");
            assert_eq!(err.thread, Some(63));
            // The report points at the kernel's line, not at the emulator.
            assert!(site.contains("emu.rs"), "{err}");
        }
        _ => panic!("expected an out-of-bounds report, got: {err}"),
    }
}

#[test]
fn emulator_errors_reach_the_library_caller() {
    // A tile the kernels were compiled for but with a shape whose data is smaller than the
    // launch claims is not possible through the API; what the API can do is refuse bad input
    // before launching, on the emulator exactly as on a GPU.
    let ctx = emulator();
    let q = ctx.full(&[1, 2, 8, 32], 1.0).unwrap();
    let k = ctx.full(&[1, 3, 8, 32], 1.0).unwrap();
    let err = ctx.flash_attention_forward(&q, &k, &k, &Default::default(), TileConfig::new(16, 16)).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    // And a tensor from another context is refused.
    let other = Context::cpu_emulated();
    let foreign = other.full(&[1, 2, 8, 32], 1.0).unwrap();
    let err = ctx.vector_add(&q, &foreign).unwrap_err();
    assert!(err.to_string().contains("another context"), "{err}");
    assert!(ctx.memory_info().is_err());
}

/// The tensor-core kernels (`mma.sync`, `ldmatrix`, `cp.async`, emulated lane by lane): forward
/// and both backward modes, `f16` and `bf16`, both head_dims, ragged lengths, GQA and both
/// causal alignments.
#[test]
fn emulated_tensor_core_forward_and_backward() {
    let ctx = emulator();
    let mut cases = 0;
    for (head_dim, seqlen_q, seqlen_k, causal) in
        [(64, 70, 90, Causal::BottomRight), (128, 33, 20, Causal::TopLeft), (64, 17, 40, Causal::None)]
    {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim };
        let fwd = TileConfig::default_for_dtype(attn_host::DType::F16, head_dim);
        let bwd = TileConfig::default_backward_for_dtype(attn_host::DType::F16, head_dim);
        let mode = if cases % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        check16::<attn_host::f16>(ctx, shape, fwd, Some((bwd, mode)), options(causal), cases, Inputs::Normal);
        check16::<attn_host::bf16>(
            ctx,
            shape,
            fwd,
            Some((bwd, DqAccumulation::Deterministic)),
            options(causal),
            cases + 1,
            Inputs::LargeLogits,
        );
        cases += 2;
    }
    // Head dims between the compiled ones, on the next compiled kernel: 40 (rows still 16-byte
    // aligned), 17 and 100 (copied and stored element by element); 160 and 256 (Q re-read from
    // shared memory), whose backward splits each 16-row slice's columns between two warps (and
    // re-reads Q and dO in the dQ kernel), at 160 on the head_dim-192 kernels.
    for (head_dim, backward) in [(40, true), (17, true), (100, true), (160, true), (256, true)] {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 37, seqlen_k: 70, head_dim };
        let fwd = TileConfig::default_for_dtype(attn_host::DType::Bf16, head_dim);
        let bwd = backward.then(|| {
            let mode = if cases % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
            (TileConfig::default_backward_for_dtype(attn_host::DType::Bf16, head_dim), mode)
        });
        check16::<attn_host::bf16>(ctx, shape, fwd, bwd, options(Causal::BottomRight), cases, Inputs::Normal);
        cases += 1;
    }
    // The forward with one m-tile per warp (block_m = 64: Q in registers, borrowing a ring slot),
    // next to the defaults' two.
    for head_dim in [64, 128] {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q: 70, seqlen_k: 83, head_dim };
        let tile = TileConfig::new(64, 64).with_stages(2);
        check16::<attn_host::f16>(ctx, shape, tile, None, options(Causal::TopLeft), cases, Inputs::Normal);
        cases += 1;
    }
    // Negative and zero scales (the forward kernel folds the scale into its exponent).
    for scale in [-0.3, 0.0] {
        let shape =
            AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 40, seqlen_k: 70, head_dim: 64 };
        let options = attn_host::AttentionOptions { scale: Some(scale), causal: Causal::TopLeft, ..Default::default() };
        let (fwd, bwd) = (
            TileConfig::default_for_dtype(attn_host::DType::F16, 64),
            TileConfig::default_backward_for_dtype(attn_host::DType::F16, 64),
        );
        check16::<attn_host::f16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Atomic)), options, cases, Inputs::Normal);
        cases += 1;
    }
    report("emulated_tensor_core_forward_and_backward", cases);
}

/// The wide-head backward (above head_dim 128: two warps share each 16-row slice, half of the
/// columns each) in both dQ modes, exact and padded instances, with ragged lengths: the pair's
/// column split, the first warp's dSᵀ for the atomic dQ, and the per-warp column range of the
/// epilogue (at 136 on the 192 kernels the second warp of a pair owns columns 96–191, of which
/// 40 are real; 250 is not a multiple of 8, so its rows are written element by element).
#[test]
fn emulated_wide_head_backward_in_both_modes() {
    let ctx = emulator();
    let mut cases = 0;
    for (head_dim, seqlen_q, seqlen_k) in [(192, 33, 45), (136, 20, 37), (256, 40, 17), (250, 9, 70)] {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim };
        let fwd = TileConfig::default_for_dtype(attn_host::DType::Bf16, head_dim);
        let bwd = TileConfig::default_backward_for_dtype(attn_host::DType::Bf16, head_dim);
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            let causal = if cases % 2 == 0 { Causal::BottomRight } else { Causal::None };
            check16::<attn_host::bf16>(ctx, shape, fwd, Some((bwd, mode)), options(causal), 40 + cases, Inputs::Normal);
            cases += 1;
        }
    }
    report("emulated_wide_head_backward_in_both_modes", cases);
}

/// The backward tiles that smaller GPUs get (their three kernels fit 99 KiB a block: an RTX
/// 3090/4090 or an L4; at 256 also an A100's deterministic dQ kernel; up to 192 a T4's 64 KiB),
/// exact and padded, in both dQ modes and both 16-bit formats: the tiles
/// `Context::default_backward_tile` picks there; and the T4's forward tile at 97–128.
#[test]
fn emulated_small_gpu_backward_tiles() {
    let ctx = emulator();
    let mut cases = 0;
    for (head_dim, tile, seqlen_q, seqlen_k) in [
        (128, (32, 64), 37, 70),
        (104, (32, 64), 50, 21),
        (192, (32, 32), 33, 45),
        (168, (32, 32), 20, 37),
        (256, (16, 32), 40, 17),
        (232, (16, 32), 9, 70),
        (64, (32, 64), 45, 70),
        (40, (32, 64), 33, 19),
        (96, (32, 32), 40, 65),
        (72, (32, 32), 21, 34),
        (128, (32, 32), 35, 30),
        (112, (32, 32), 50, 17),
        (192, (16, 32), 30, 41),
        (160, (16, 32), 17, 50),
    ] {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim };
        let fwd = TileConfig::default_for_dtype(attn_host::DType::F16, head_dim);
        let bwd = TileConfig::new(tile.0, tile.1).with_stages(2);
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            let causal = if cases % 2 == 0 { Causal::BottomRight } else { Causal::None };
            let seed = 80 + cases;
            if cases % 3 == 0 {
                check16::<attn_host::bf16>(ctx, shape, fwd, Some((bwd, mode)), options(causal), seed, Inputs::Normal);
            } else {
                check16::<attn_host::f16>(ctx, shape, fwd, Some((bwd, mode)), options(causal), seed, Inputs::Normal);
            }
            cases += 1;
        }
    }
    for (head_dim, seqlen_q, seqlen_k) in [(128, 70, 41), (104, 33, 80)] {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim };
        let fwd = TileConfig::new(64, 32).with_stages(2);
        check16::<attn_host::f16>(ctx, shape, fwd, None, options(Causal::BottomRight), 90 + cases, Inputs::Normal);
        cases += 1;
    }
    report("emulated_small_gpu_backward_tiles", cases);
}

/// The one-call API (`Context::attention`, `Context::attention_backward`) on the emulator: it
/// picks the tile and dQ mode itself, for `f32` and `bf16`, GQA, both causal alignments, a
/// head_dim between the compiled ones, and a deterministic backward, against the float64
/// reference on the same (rounded) inputs.
#[test]
fn emulated_one_call_attention_and_backward() {
    use attn_host::dtype::to_f32_vec;
    use attn_host::{AttentionOptions, Element, bf16};
    use common::tensor_cores::Problem16;
    fn run<T: Element>(ctx: &Context, shape: AttentionShape, options: AttentionOptions, seed: u64) {
        // Inputs rounded to T, so that the reference sees what the kernels see.
        let Problem16 { host, device, .. } = Problem16::<T>::new(ctx, shape, seed, Inputs::Normal);
        let forward = ctx.attention(&device[0], &device[1], &device[2], &options).unwrap();
        let grads = ctx.attention_backward(&forward, &device[3]).unwrap();
        let params = cpu::Params::of(&options, shape.head_dim);
        let forward_reference = cpu::attention(&host[0], &host[1], &host[2], &shape, params).unwrap();
        let reference = cpu::attention_backward(&host[0], &host[1], &host[2], &host[3], &shape, params).unwrap();
        let tolerance = if T::DTYPE == attn_host::DType::F32 { 1e-4 } else { 2e-2 };
        let outputs = [
            ("O", to_f32_vec(&forward.o().to_host().unwrap()), &forward_reference.o),
            ("dQ", to_f32_vec(&grads.dq.to_host().unwrap()), &reference.dq),
            ("dK", to_f32_vec(&grads.dk.to_host().unwrap()), &reference.dk),
            ("dV", to_f32_vec(&grads.dv.to_host().unwrap()), &reference.dv),
        ];
        for (name, got, want) in outputs {
            let err = relative_l2_error(&got, want);
            assert!(err <= tolerance, "{} {options:?} on {shape:?}: {name} relative L2 error {err:.3e}", T::DTYPE);
        }
    }
    let ctx = emulator();
    let shape = |seqlen_q, seqlen_k, head_dim| AttentionShape {
        batch: 1,
        num_heads_q: 4,
        num_heads_kv: 2,
        seqlen_q,
        seqlen_k,
        head_dim,
    };
    run::<f32>(ctx, shape(37, 50, 32), AttentionOptions::causal(Causal::BottomRight), 1);
    run::<bf16>(ctx, shape(40, 29, 40), AttentionOptions::causal(Causal::TopLeft).deterministic(), 11);
    run::<bf16>(ctx, shape(33, 33, 64), AttentionOptions::with_scale(-0.2), 21);
    report("emulated_one_call_attention_and_backward", 3);
}

/// Sliding windows (local attention) through the kernels' own source: windows narrower than a
/// tile and wider than several, open on one side, both alignments, combined with a causal mask,
/// and on lengths where some rows' windows hold no key; the f32 flash kernels (both dQ modes),
/// the tensor-core kernels and the naive kernels, against the float64 reference. Tiles of 16
/// keys over 100 keys with a window of 9: most tiles of a row block are skipped at both ends.
#[test]
fn emulated_sliding_windows_in_every_family() {
    use attn_host::{AttentionOptions, SlidingWindow};
    let ctx = emulator();
    let mut cases = 0;
    let windows = [
        (AttentionOptions::default().with_window(SlidingWindow::new(Some(8), Some(0))), 96, 100),
        (AttentionOptions::default().with_window(SlidingWindow::new(Some(20), Some(5)).top_left()), 70, 50),
        (AttentionOptions::causal(Causal::BottomRight).with_window(SlidingWindow::left(30)), 40, 90),
        (AttentionOptions::default().with_window(SlidingWindow::new(None, Some(3))), 45, 37),
        (AttentionOptions::default().with_window(SlidingWindow::new(Some(2), None)), 37, 45),
        // More queries than keys, bottom-right: the first 30 rows' windows hold no key.
        (AttentionOptions::default().with_window(SlidingWindow::new(Some(4), Some(4))), 60, 30),
    ];
    for (i, &(options, seqlen_q, seqlen_k)) in windows.iter().enumerate() {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 32 };
        let (tile, mode) = if i % 2 == 0 {
            (TileConfig::new(16, 16), DqAccumulation::Atomic)
        } else {
            (TileConfig::new(32, 16), DqAccumulation::Deterministic)
        };
        check(ctx, shape, Kernel::Flash(tile, mode), options, 300 + cases, true);
        cases += 1;
        let shape = AttentionShape { head_dim: 64, ..shape };
        let (fwd, bwd) = (
            TileConfig::default_for_dtype(attn_host::DType::F16, 64),
            TileConfig::default_backward_for_dtype(attn_host::DType::F16, 64),
        );
        check16::<attn_host::f16>(ctx, shape, fwd, Some((bwd, mode)), options, 300 + cases, Inputs::Normal);
        cases += 1;
    }
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 23, seqlen_k: 30, head_dim: 20 };
    check(ctx, shape, Kernel::Naive, windows[0].0, 400, true);
    cases += 1;
    report("emulated_sliding_windows_in_every_family", cases);
}

/// Softcapping and ALiBi (`attention::score`) through the kernels' own source, forward and
/// backward: the f32 flash kernels and the tensor-core kernels in both dQ modes, causal or not,
/// GQA with 3 query heads (ALiBi slopes off the power-of-two sequence), ragged lengths; a cap of
/// 2 on logits of spread 1.4 (scale 0.25 on head_dim 32) is deep in tanh's bend. The naive kernels
/// take both forward and ALiBi backward.
#[test]
fn emulated_score_mods_in_every_family() {
    use attn_host::{Alibi, AttentionOptions};
    let ctx = emulator();
    let mut cases = 0;
    let softcap = AttentionOptions::with_scale(0.25).with_softcap(2.0);
    let alibi = AttentionOptions::default().with_alibi(Alibi::standard());
    let mods = [
        (softcap, Causal::None, 45, 70),
        (alibi, Causal::BottomRight, 70, 45),
        (AttentionOptions::causal(Causal::TopLeft).with_softcap(1.0), Causal::TopLeft, 33, 33),
        (alibi, Causal::None, 20, 50),
    ];
    for (i, &(options, causal, seqlen_q, seqlen_k)) in mods.iter().enumerate() {
        let options = AttentionOptions { causal, ..options };
        let shape = AttentionShape { batch: 1, num_heads_q: 3, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 32 };
        let mode = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        check(ctx, shape, Kernel::Flash(TileConfig::new(16, 16), mode), options, 500 + cases, true);
        cases += 1;
        let shape = AttentionShape { head_dim: 64, ..shape };
        let (fwd, bwd) = (
            TileConfig::default_for_dtype(attn_host::DType::F16, 64),
            TileConfig::default_backward_for_dtype(attn_host::DType::F16, 64),
        );
        check16::<attn_host::f16>(ctx, shape, fwd, Some((bwd, mode)), options, 500 + cases, Inputs::Normal);
        cases += 1;
    }
    let shape = AttentionShape { batch: 1, num_heads_q: 3, num_heads_kv: 3, seqlen_q: 23, seqlen_k: 30, head_dim: 20 };
    check(ctx, shape, Kernel::Naive, alibi, 600, true);
    check(ctx, shape, Kernel::Naive, softcap, 601, false);
    cases += 2;
    report("emulated_score_mods_in_every_family", cases);
}

/// Attention sinks (one per query head) in every flash family, forward and backward with dSinks:
/// the `f32` kernels and the tensor-core kernels in both dQ modes, with GQA, rows that see no key
/// (bottom-right, more queries than keys: LSE = the sink), a sliding window, softcapping and
/// ALiBi; a sink large enough to take most of a row's mass. The naive kernels, a wrong shape and
/// a missing dSinks are typed errors.
#[test]
fn emulated_sinks_in_every_family() {
    use attn_host::{Alibi, AttentionOptions, Error, SlidingWindow};
    let ctx = emulator();
    let sinks = [1.5f32, -0.5, 6.0];
    let window = SlidingWindow::new(Some(9), Some(4));
    let cases = [
        (AttentionOptions::default(), Causal::None, 45, 70),
        (AttentionOptions::with_scale(0.25).with_softcap(2.0), Causal::BottomRight, 70, 45),
        (AttentionOptions::default().with_alibi(Alibi::standard()), Causal::TopLeft, 33, 33),
        (AttentionOptions::default().with_window(window), Causal::TopLeft, 40, 52),
    ];
    let mut count = 0;
    for (i, &(options, causal, seqlen_q, seqlen_k)) in cases.iter().enumerate() {
        let options = AttentionOptions { causal, ..options };
        let shape = AttentionShape { batch: 2, num_heads_q: 3, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 32 };
        let mode = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        let kernel = Kernel::Flash(TileConfig::new(16, 16), mode);
        check_with_sinks(ctx, shape, kernel, options, Some(&sinks), 700 + count, true);
        count += 1;
        let shape = AttentionShape { head_dim: 64, ..shape };
        let dtype = if i % 2 == 0 { attn_host::DType::F16 } else { attn_host::DType::Bf16 };
        let tiles = (TileConfig::default_for_dtype(dtype, 64), TileConfig::default_backward_for_dtype(dtype, 64));
        let run = if i % 2 == 0 { check16_with_sinks::<attn_host::f16> } else { check16_with_sinks::<attn_host::bf16> };
        run(ctx, shape, tiles.0, Some((tiles.1, mode)), options, Some(&sinks), 700 + count, Inputs::Normal);
        count += 1;
    }
    // What refuses sinks, before any launch.
    let shape = AttentionShape { batch: 1, num_heads_q: 3, num_heads_kv: 3, seqlen_q: 8, seqlen_k: 8, head_dim: 32 };
    let n = shape.q_shape().iter().product();
    let [q, k, v] = [1, 2, 3].map(|seed| ctx.upload(&random_normal(n, seed), &shape.q_shape()).unwrap());
    let good = ctx.upload(&sinks, &[3]).unwrap();
    let options = AttentionOptions::default().with_sinks(&good);
    let naive = ctx.attention_naive(&q, &k, &v, &options);
    assert!(matches!(naive, Err(Error::Sinks(_))), "{naive:?}");
    let bad = ctx.upload(&sinks[..2], &[2]).unwrap();
    let wrong = ctx.attention(&q, &k, &v, &AttentionOptions::default().with_sinks(&bad));
    assert!(matches!(wrong, Err(Error::Sinks(_))), "{:?}", wrong.map(|_| ()));
    let forward = ctx.attention(&q, &k, &v, &options).unwrap();
    let tile = TileConfig::new(16, 16);
    let mut grads = plain_gradients(ctx, &shape);
    let (o, lse) = (forward.o(), forward.lse());
    let missing =
        ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &q, &mut grads, &options, tile, DqAccumulation::Atomic);
    assert!(matches!(missing, Err(Error::Sinks(_))), "{missing:?}");
    // The one-call API carries the sinks to the backward, which returns their gradient.
    let grads = ctx.attention_backward(&forward, &q).unwrap();
    assert_eq!(grads.d_sinks.map(|t| t.shape().to_vec()), Some(vec![3]));
    report("emulated_sinks_in_every_family", count);
}

/// Zeroed `f32` dQ, dK, dV for `shape`, with no dSinks or dBias: what a refusal test passes to
/// `flash_attention_backward_into` for a problem that needs one of them.
fn plain_gradients(ctx: &Context, shape: &AttentionShape) -> attn_host::Gradients<f32> {
    attn_host::Gradients {
        dq: ctx.full(&shape.q_shape(), 0.0).unwrap(),
        dk: ctx.full(&shape.kv_shape(), 0.0).unwrap(),
        dv: ctx.full(&shape.kv_shape(), 0.0).unwrap(),
        d_sinks: None,
        d_bias: None,
    }
}

/// Random bias values of `shape` (`[batch or 1, heads or 1, seqlen_q, seqlen_k]`, spread 2) with
/// −∞ entries scattered through them and one query row (row 5 of the first plane) −∞ throughout:
/// a row that sees no key through its bias alone.
fn bias_values(shape: [usize; 4], seed: u64) -> Vec<f32> {
    let seqlen_k = shape[3];
    let mut values: Vec<f32> = random_normal(shape.iter().product(), seed).iter().map(|x| 2.0 * x).collect();
    for (index, x) in values.iter_mut().enumerate() {
        let (i, j) = (index / seqlen_k % shape[2], index % seqlen_k);
        if (7 * i + 3 * j) % 11 == 0 || (index < shape[2] * seqlen_k && i == 5) {
            *x = f32::NEG_INFINITY;
        }
    }
    values
}

/// An additive bias (`Bias`, with its gradient dBias) in every flash family, forward and
/// backward: the `f32` kernels and the tensor-core kernels (f16, bf16; a wide head whose warps
/// share each slice) in both dQ modes; a bias of every broadcast (none, over the batch, over the
/// heads, both), with GQA, causal masks of both alignments, a window, ALiBi and sinks, ragged
/// lengths, −∞ entries and a row hidden by its bias alone. Then what refuses a bias, before any
/// launch, and the one-call API carrying it to the backward.
#[test]
fn emulated_bias_in_every_family() {
    use attn_host::{Alibi, AttentionOptions, Error, SlidingWindow};
    let ctx = emulator();
    let sinks = [0.5f32, -1.0, 2.0];
    let cases = [
        (AttentionOptions::default(), [2, 3], None, 45, 70),
        (AttentionOptions::causal(Causal::BottomRight), [1, 3], None, 70, 45),
        (AttentionOptions::default().with_alibi(Alibi::standard()), [2, 1], None, 33, 33),
        (
            AttentionOptions::causal(Causal::TopLeft).with_window(SlidingWindow::new(Some(9), Some(4))),
            [1, 1],
            Some(&sinks[..]),
            40,
            52,
        ),
    ];
    let mut count = 0;
    for (i, &(options, [bias_batch, bias_heads], sinks, seqlen_q, seqlen_k)) in cases.iter().enumerate() {
        let shape = AttentionShape { batch: 2, num_heads_q: 3, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim: 32 };
        let bias_shape = [bias_batch, bias_heads, seqlen_q, seqlen_k];
        let values = bias_values(bias_shape, 900 + i as u64);
        let extras = Extras { sinks, bias: Some(cpu::BiasValues { values: &values, shape: bias_shape }) };
        let mode = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        check_with_extras(ctx, shape, Kernel::Flash(TileConfig::new(16, 16), mode), options, extras, 900 + count, true);
        count += 1;
        let shape = AttentionShape { head_dim: 64, ..shape };
        let dtype = if i % 2 == 0 { attn_host::DType::F16 } else { attn_host::DType::Bf16 };
        let tiles = (TileConfig::default_for_dtype(dtype, 64), TileConfig::default_backward_for_dtype(dtype, 64));
        let run =
            if i % 2 == 0 { check16_with_extras::<attn_host::f16> } else { check16_with_extras::<attn_host::bf16> };
        run(ctx, shape, tiles.0, Some((tiles.1, mode)), options, extras, 900 + count, Inputs::Normal);
        count += 1;
    }
    // A wide head (two warps share each 16-row slice's columns; only the first adds dBias).
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 33, seqlen_k: 40, head_dim: 192 };
    let bias_shape = [1, 2, 33, 40];
    let values = bias_values(bias_shape, 950);
    let extras = Extras { sinks: None, bias: Some(cpu::BiasValues { values: &values, shape: bias_shape }) };
    let dtype = attn_host::DType::Bf16;
    let tiles = (TileConfig::default_for_dtype(dtype, 192), TileConfig::default_backward_for_dtype(dtype, 192));
    let causal = options(Causal::BottomRight);
    check16_with_extras::<attn_host::bf16>(
        ctx,
        shape,
        tiles.0,
        Some((tiles.1, DqAccumulation::Atomic)),
        causal,
        extras,
        950,
        Inputs::Normal,
    );
    count += 1;

    // What refuses a bias, before any launch.
    let shape = AttentionShape { batch: 1, num_heads_q: 3, num_heads_kv: 3, seqlen_q: 8, seqlen_k: 8, head_dim: 32 };
    let n = shape.q_shape().iter().product();
    let [q, k, v] = [1, 2, 3].map(|seed| ctx.upload(&random_normal(n, seed), &shape.q_shape()).unwrap());
    let bias = ctx.upload(&random_normal(3 * 64, 4), &[1, 3, 8, 8]).unwrap();
    let options = AttentionOptions::default().with_bias(&bias);
    let refused = |result: attn_host::Result<()>, what: &str| {
        assert!(matches!(result, Err(Error::Bias(_))), "{what}: {result:?}");
    };
    refused(ctx.attention_naive(&q, &k, &v, &options).map(|_| ()), "naive");
    refused(ctx.attention(&q, &k, &v, &options.with_softcap(5.0)).map(|_| ()), "softcap");
    let wrong = ctx.upload(&random_normal(128, 5), &[2, 1, 8, 8]).unwrap();
    refused(ctx.attention(&q, &k, &v, &AttentionOptions::default().with_bias(&wrong)).map(|_| ()), "wrong batch");
    let forward = ctx.attention(&q, &k, &v, &options).unwrap();
    let mut grads = plain_gradients(ctx, &shape);
    let (o, lse, tile) = (forward.o(), forward.lse(), TileConfig::new(16, 16));
    let atomic = DqAccumulation::Atomic;
    refused(ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &q, &mut grads, &options, tile, atomic), "no dBias");
    grads.d_bias = Some(ctx.full(&[3, 8, 8], 0.0).unwrap());
    refused(
        ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &q, &mut grads, &options, tile, atomic),
        "dBias shape",
    );
    // The one-call API carries the bias to the backward, which returns its gradient.
    let grads = ctx.attention_backward(&forward, &q).unwrap();
    assert_eq!(grads.d_bias.map(|t| t.shape().to_vec()), Some(vec![1, 3, 8, 8]));
    report("emulated_bias_in_every_family", count);
}

/// Masks given per token ([`attn_host::MaskTable`]) in every family: document masks from
/// per-token ids (different documents in each batch entry, a one-token document, edges inside
/// the tiles) and from `cu_seqlens` (with an empty document), prefix-LM (a prefix of 0 and one
/// that ends inside a tile), alone and with a causal mask, a window, softcapping and sinks; the
/// `f32` flash kernels and the tensor cores (f16 and bf16) in both dQ modes, and the naive
/// kernels. A table made for another shape or context, or on a problem run in chunks, is a
/// typed error.
#[test]
fn emulated_mask_tables_in_every_family() {
    use attn_host::{AttentionOptions, Error, SlidingWindow};
    let ctx = emulator();
    let seqlen = 70;
    // Batch entry 0: documents of 1, 20, 33 and 16 tokens; entry 1: 45 and 25 (ids need not
    // be sorted, only consecutive).
    let lengths: [&[usize]; 2] = [&[1, 20, 33, 16], &[45, 25]];
    let ids: Vec<i32> = lengths
        .iter()
        .flat_map(|row| row.iter().enumerate().flat_map(|(d, &n)| std::iter::repeat_n(90 - 7 * d as i32, n)))
        .collect();
    let docs = ctx.document_mask(&ids, [2, seqlen]).unwrap();
    let prefix = ctx.prefix_lm_mask(&[0, 29], seqlen).unwrap();
    let window = SlidingWindow::new(Some(9), None);
    let cases = [
        AttentionOptions::default().with_mask_table(&docs),
        AttentionOptions::causal(Causal::TopLeft).with_mask_table(&docs),
        AttentionOptions::causal(Causal::TopLeft).with_window(window).with_softcap(3.0).with_mask_table(&docs),
        AttentionOptions::default().with_mask_table(&prefix),
    ];
    let mut count = 0;
    for (i, &options) in cases.iter().enumerate() {
        let shape = AttentionShape {
            batch: 2,
            num_heads_q: 2,
            num_heads_kv: 1,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim: 32,
        };
        let mode = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        check(ctx, shape, Kernel::Flash(TileConfig::new(16, 16), mode), options, 800 + count, true);
        count += 1;
        let shape = AttentionShape { head_dim: 64, ..shape };
        let dtype = if i % 2 == 0 { attn_host::DType::F16 } else { attn_host::DType::Bf16 };
        let tiles = (TileConfig::default_for_dtype(dtype, 64), TileConfig::default_backward_for_dtype(dtype, 64));
        let run = if i % 2 == 0 { check16::<attn_host::f16> } else { check16::<attn_host::bf16> };
        run(ctx, shape, tiles.0, Some((tiles.1, mode)), options, 800 + count, Inputs::Normal);
        count += 1;
    }
    // Sinks with documents; the naive kernels; a packed row from cu_seqlens (an empty document).
    let shape =
        AttentionShape { batch: 2, num_heads_q: 2, num_heads_kv: 2, seqlen_q: seqlen, seqlen_k: seqlen, head_dim: 24 };
    let kernel = Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Atomic);
    check_with_sinks(ctx, shape, kernel, cases[1], Some(&[0.5, -1.0]), 820, true);
    check(ctx, shape, Kernel::Naive, cases[1], 821, true);
    check(ctx, shape, Kernel::Naive, cases[3], 822, false);
    let packed = ctx.document_mask_from_cu_seqlens(&[0, 10, 10, 50, 70]).unwrap();
    let one_row = AttentionShape { batch: 1, ..shape };
    check(ctx, one_row, kernel, AttentionOptions::causal(Causal::TopLeft).with_mask_table(&packed), 823, true);
    count += 4;
    // What refuses a table, before any launch.
    let n = one_row.q_shape().iter().product();
    let [q, k, v] = [1, 2, 3].map(|seed| ctx.upload(&random_normal(n, seed), &one_row.q_shape()).unwrap());
    let wrong_shape = ctx.attention(&q, &k, &v, &AttentionOptions::default().with_mask_table(&docs));
    assert!(matches!(wrong_shape, Err(Error::MaskTable(_))), "{:?}", wrong_shape.map(|_| ()));
    let prefix_one = ctx.prefix_lm_mask(&[10], seqlen).unwrap();
    let undone = ctx.attention(&q, &k, &v, &AttentionOptions::causal(Causal::TopLeft).with_mask_table(&prefix_one));
    assert!(matches!(undone, Err(Error::MaskTable(_))), "{:?}", undone.map(|_| ()));
    let naive = ctx.attention_naive(&q, &k, &v, &AttentionOptions::default().with_mask_table(&docs));
    assert!(matches!(naive, Err(Error::MaskTable(_))), "{naive:?}");
    let other = Context::cpu_emulated().with_grid_limit(1);
    let foreign_table = other.document_mask_from_cu_seqlens(&[0, 70]).unwrap();
    let foreign = ctx.attention(&q, &k, &v, &AttentionOptions::default().with_mask_table(&foreign_table));
    assert!(matches!(foreign, Err(Error::MaskTable(_))), "{:?}", foreign.map(|_| ()));
    let [q1, k1, v1] = [1, 2, 3].map(|seed| other.upload(&random_normal(n, seed), &one_row.q_shape()).unwrap());
    let chunked = other.attention(&q1, &k1, &v1, &AttentionOptions::default().with_mask_table(&foreign_table));
    assert!(matches!(chunked, Err(Error::MaskTable(_))), "{:?}", chunked.map(|_| ()));
    report("emulated_mask_tables_in_every_family", count);
}

/// Packed batches whose sequences have query and key lengths of their own
/// ([`Context::varlen_mask`]): chunked prefill (fewer new queries than keys, bottom-right causal,
/// with and without a window) and cross-attention (no mask, one sequence with more queries than
/// keys), in the `f32` flash kernels in both dQ modes, the tensor cores (f16 and bf16) and the
/// naive kernels; a mask of the call's own beside a varlen table is a typed error.
#[test]
fn emulated_varlen_batches_with_their_own_lengths() {
    use attn_host::{AttentionOptions, Error, SlidingWindow};
    let ctx = emulator();
    // Four sequences: new queries 5, 17, 1, 20 against keys 30, 17, 40, 21.
    let (cu_q, cu_k) = ([0, 5, 22, 23, 43], [0, 30, 47, 87, 108]);
    let prefill = ctx.varlen_mask(&cu_q, &cu_k, Causal::BottomRight, None).unwrap();
    let local = ctx.varlen_mask(&cu_q, &cu_k, Causal::BottomRight, Some(SlidingWindow::left(6))).unwrap();
    // Cross-attention: 12 queries against 7 keys in the second sequence.
    let cross = ctx.varlen_mask(&[0, 9, 21, 30], &[0, 25, 32, 60], Causal::None, None).unwrap();
    let shape = |table: &attn_host::MaskTable, head_dim| {
        let [batch, seqlen_q, seqlen_k] = table.dims();
        AttentionShape { batch, num_heads_q: 2, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim }
    };
    let mut count = 0;
    for (i, table) in [&prefill, &local, &cross].into_iter().enumerate() {
        let options = AttentionOptions::default().with_mask_table(table);
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            check(ctx, shape(table, 32), Kernel::Flash(TileConfig::new(16, 16), mode), options, 900 + count, true);
            count += 1;
        }
        let dtype = if i % 2 == 0 { attn_host::DType::F16 } else { attn_host::DType::Bf16 };
        let tiles = (TileConfig::default_for_dtype(dtype, 64), TileConfig::default_backward_for_dtype(dtype, 64));
        let run = if i % 2 == 0 { check16::<attn_host::f16> } else { check16::<attn_host::bf16> };
        let mode = if i % 2 == 0 { DqAccumulation::Deterministic } else { DqAccumulation::Atomic };
        run(ctx, shape(table, 64), tiles.0, Some((tiles.1, mode)), options, 900 + count, Inputs::Normal);
        count += 1;
    }
    check(ctx, shape(&prefill, 24), Kernel::Naive, AttentionOptions::default().with_mask_table(&prefill), 950, true);
    count += 1;
    let s = shape(&prefill, 16);
    let [q, k, v] = [(s.q_shape(), 1), (s.kv_shape(), 2), (s.kv_shape(), 3)]
        .map(|(dims, seed)| ctx.upload(&random_normal(dims.iter().product(), seed), &dims).unwrap());
    let causal = ctx.attention(&q, &k, &v, &AttentionOptions::causal(Causal::BottomRight).with_mask_table(&prefill));
    assert!(matches!(causal, Err(Error::MaskTable(_))), "{:?}", causal.map(|_| ()));
    report("emulated_varlen_batches_with_their_own_lengths", count);
}

/// Right-edge-only windows over more keys than queries: key blocks past every query's right edge
/// must write zero dK and dV (found on the H200 by the tensor-core proptest).
#[test]
fn emulated_right_edge_windows_past_the_last_query() {
    use attn_host::{AttentionOptions, SlidingWindow};
    let ctx = emulator();
    let cases = [
        (
            AttentionOptions::causal(Causal::TopLeft).with_window(SlidingWindow::new(None, Some(42)).top_left()),
            113,
            341,
            128,
            (64, 32, 3),
            (32, 64, 2),
        ),
        (
            AttentionOptions::default().with_window(SlidingWindow::new(None, Some(82)).top_left()),
            103,
            341,
            64,
            (64, 32, 2),
            (64, 64, 2),
        ),
        (AttentionOptions::causal(Causal::TopLeft), 113, 341, 128, (64, 32, 3), (32, 64, 2)),
    ];
    for (i, &(options, seqlen_q, seqlen_k, head_dim, f, b)) in cases.iter().enumerate() {
        let shape = AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q, seqlen_k, head_dim };
        let fwd = TileConfig::new(f.0, f.1).with_stages(f.2);
        let bwd = TileConfig::new(b.0, b.1).with_stages(b.2);
        check16::<attn_host::f16>(
            ctx,
            shape,
            fwd,
            Some((bwd, DqAccumulation::Atomic)),
            options,
            500 + i as u64,
            Inputs::Normal,
        );
    }
    report("emulated_right_edge_windows_past_the_last_query", cases.len() as u64);
}

/// Borrowed tensors (`Context::tensor_from_raw_parts`, what the PyTorch bridge passes): the
/// kernels read and write the caller's memory in place, dropping the tensors frees nothing, and a
/// misaligned address is refused with the reason.
#[test]
fn emulated_borrowed_tensors_read_and_write_the_callers_memory() {
    use attn_host::{AttentionOptions, AttentionOutput};
    let ctx = emulator();
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 20, seqlen_k: 27, head_dim: 32 };
    let (q_len, kv_len) = (shape.q_shape().iter().product::<usize>(), shape.kv_shape().iter().product::<usize>());
    // Caller-owned buffers (16-byte aligned: a Vec of u128 holds them).
    let buffer = |len: usize, seed: u64| {
        let mut words = vec![0u128; len.div_ceil(4)];
        let values = random_normal(len, seed);
        // SAFETY: `words` holds at least `len` f32s.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), words.as_mut_ptr() as *mut f32, len) };
        words
    };
    let (q, k, v) = (buffer(q_len, 1), buffer(kv_len, 2), buffer(kv_len, 3));
    let (mut o, mut lse) = (vec![u128::MAX; q_len.div_ceil(4)], vec![u128::MAX; (q_len / 32).div_ceil(4)]);
    let address = |words: &[u128]| words.as_ptr() as u64;
    let options = AttentionOptions::causal(Causal::BottomRight);
    {
        // SAFETY: each buffer holds its shape's f32s and outlives the tensors.
        let tensor =
            |words: &[u128], dims: &[usize]| unsafe { ctx.tensor_from_raw_parts::<f32>(address(words), dims) }.unwrap();
        let (qt, kt, vt) = (tensor(&q, &shape.q_shape()), tensor(&k, &shape.kv_shape()), tensor(&v, &shape.kv_shape()));
        let mut out = AttentionOutput { o: tensor(&o, &shape.q_shape()), lse: tensor(&lse, &shape.lse_shape()) };
        assert!(qt.is_borrowed() && out.o.is_borrowed());
        ctx.flash_attention_forward_into(&qt, &kt, &vt, &mut out, &options, TileConfig::default_for(32)).unwrap();
    } // the tensors are dropped here: the buffers must stay ours, and hold the results
    let floats = |words: &[u128], len: usize| {
        // SAFETY: `words` holds at least `len` initialised f32s.
        unsafe { std::slice::from_raw_parts(words.as_ptr() as *const f32, len) }.to_vec()
    };
    let reference = cpu::attention(
        &floats(&q, q_len),
        &floats(&k, kv_len),
        &floats(&v, kv_len),
        &shape,
        cpu::Params::of(&options, 32),
    )
    .unwrap();
    assert!(relative_l2_error(&floats(&o, q_len), &reference.o) < 1e-5);
    assert!(relative_l2_error(&floats(&lse, q_len / 32), &reference.lse) < 1e-5);
    o[0] = 0;
    lse[0] = 0; // still ours to write
    // SAFETY: not dereferenced: the address is refused first.
    let misaligned = unsafe { ctx.tensor_from_raw_parts::<f32>(address(&q) + 4, &[4]) };
    assert!(misaligned.unwrap_err().to_string().contains("16-byte aligned"));
}

/// Problems with more heads or batch entries than one grid holds run in chunks of the folded
/// batch (`ops/chunks.rs`): here with the grid limit lowered to 3, a batch of 5 with 4 query and
/// 2 key/value heads (10 folded sequences, 4 chunks), forward and backward in both dQ modes, in
/// `f32` and `bf16`, against the float64 reference; a group larger than the limit is refused.
#[test]
fn emulated_problems_beyond_the_grid_limit_run_in_chunks() {
    use attn_host::AttentionOptions;
    let ctx = Context::cpu_emulated().with_grid_limit(3);
    let shape = AttentionShape { batch: 5, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 19, seqlen_k: 23, head_dim: 32 };
    let options = AttentionOptions::causal(Causal::BottomRight);
    check(&ctx, shape, Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Atomic), options, 700, true);
    check(&ctx, shape, Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Deterministic), options, 701, true);
    let shape16 = AttentionShape { head_dim: 64, ..shape };
    let (fwd, bwd) = (
        TileConfig::default_for_dtype(attn_host::DType::Bf16, 64),
        TileConfig::default_backward_for_dtype(attn_host::DType::Bf16, 64),
    );
    check16::<attn_host::bf16>(&ctx, shape16, fwd, Some((bwd, DqAccumulation::Atomic)), options, 702, Inputs::Normal);
    let wide_group = AttentionShape { num_heads_q: 8, num_heads_kv: 1, ..shape };
    let n = |dims: [usize; 4]| dims.iter().product::<usize>();
    let q = ctx.upload(&random_normal(n(wide_group.q_shape()), 1), &wide_group.q_shape()).unwrap();
    let k = ctx.upload(&random_normal(n(wide_group.kv_shape()), 2), &wide_group.kv_shape()).unwrap();
    let error = ctx.flash_attention_forward(&q, &k, &k, &options, TileConfig::new(16, 16)).unwrap_err();
    assert!(error.to_string().contains("query heads per key/value head"), "{error}");
    report("emulated_problems_beyond_the_grid_limit_run_in_chunks", 3);
}

/// Empty problems (a batch, head count or sequence length of 0) follow the empty-row convention
/// with no kernel: O = 0 and LSE = −∞ for the rows of 0 keys, zero gradients, as the float64
/// reference says, on every entry point (flash in each element type, both dQ modes, naive, the
/// one-call API); outputs are poisoned first. num_heads_kv and head_dim of 0 stay errors.
#[test]
fn emulated_empty_problems_follow_the_empty_row_convention() {
    use attn_host::AttentionOptions;
    let ctx = emulator();
    let base = AttentionShape { batch: 2, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 9, seqlen_k: 11, head_dim: 32 };
    let empties = [
        AttentionShape { seqlen_k: 0, ..base },
        AttentionShape { seqlen_q: 0, ..base },
        AttentionShape { batch: 0, ..base },
        AttentionShape { num_heads_q: 0, ..base },
        AttentionShape { seqlen_q: 0, seqlen_k: 0, ..base },
    ];
    let mut cases = 0;
    for (i, &shape) in empties.iter().enumerate() {
        let options =
            if i % 2 == 0 { AttentionOptions::causal(Causal::BottomRight) } else { AttentionOptions::default() };
        let mode = if i % 2 == 0 { DqAccumulation::Atomic } else { DqAccumulation::Deterministic };
        check(ctx, shape, Kernel::Flash(TileConfig::new(16, 16), mode), options, 800 + i as u64, true);
        check(ctx, shape, Kernel::Naive, options, 810 + i as u64, true);
        let shape16 = AttentionShape { head_dim: 64, ..shape };
        let (fwd, bwd) = (
            TileConfig::default_for_dtype(attn_host::DType::F16, 64),
            TileConfig::default_backward_for_dtype(attn_host::DType::F16, 64),
        );
        check16::<attn_host::f16>(ctx, shape16, fwd, Some((bwd, mode)), options, 820 + i as u64, Inputs::Normal);
        cases += 3;
    }
    // The one-call API on seqlen_k = 0: O = 0, LSE = −∞, dQ = 0.
    let shape = empties[0];
    let n = |dims: [usize; 4]| dims.iter().product::<usize>();
    let q = ctx.upload(&random_normal(n(shape.q_shape()), 1), &shape.q_shape()).unwrap();
    let kv = ctx.upload(&[], &shape.kv_shape()).unwrap();
    let forward = ctx.attention(&q, &kv, &kv, &AttentionOptions::default()).unwrap();
    assert!(forward.o().to_host().unwrap().iter().all(|&x| x == 0.0));
    assert!(forward.lse().to_host().unwrap().iter().all(|&x| x == f32::NEG_INFINITY));
    let grads = ctx.attention_backward(&forward, &q).unwrap();
    assert!(grads.dq.to_host().unwrap().iter().all(|&x| x == 0.0) && grads.dk.is_empty());
    // What must not be 0.
    for (q_shape, kv_shape) in [([2, 4, 9, 32], [2, 0, 11, 32]), ([2, 4, 9, 0], [2, 2, 11, 0])] {
        let (q, kv) = (
            ctx.upload(&vec![0.0; n(q_shape)], &q_shape).unwrap(),
            ctx.upload(&vec![0.0; n(kv_shape)], &kv_shape).unwrap(),
        );
        let error = ctx.attention(&q, &kv, &kv, &AttentionOptions::default()).unwrap_err();
        assert!(error.to_string().contains("num_heads_kv and head_dim must be at least 1"), "{error}");
    }
    report("emulated_empty_problems_follow_the_empty_row_convention", cases + 1);
}

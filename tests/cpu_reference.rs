//! Tests that need no GPU: the CPU references, shape and tile validation.

mod common;

use attn_host::check::{CPU_TILED_TOLERANCE, random_normal, relative_l2_error};
use attn_host::{
    Alibi, AttentionOptions, AttentionShape, Causal, DType, DeviceInfo, Error, FlashKernel, ScoreMod, TileConfig, cpu,
};
use proptest::prelude::*;

use common::gqa as shape;

fn params(scale: f64, causal: Causal) -> cpu::Params<'static> {
    cpu::Params { scale, causal, window: None, score: Default::default(), sinks: None, mask_table: None, bias: None }
}

fn masks() -> impl Strategy<Value = Causal> {
    prop::sample::select(vec![Causal::None, Causal::TopLeft, Causal::BottomRight])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// The tiled online-softmax algorithm computes the same function as the plain formula, for
    /// any tile sizes (not only the compiled ones), ragged lengths and every mask.
    #[test]
    fn tiled_cpu_flash_matches_plain_formula(
        batch in 1usize..=2, heads_kv in 1usize..=2, group in 1usize..=3,
        seqlen_q in 1usize..=90, seqlen_k in 1usize..=90, head_dim in 1usize..=40,
        block_m in 1usize..=40, block_n in 1usize..=40, seed in any::<u32>(), scale in 0.0f64..3.0,
        causal in masks(),
    ) {
        let s = shape(batch, heads_kv * group, heads_kv, seqlen_q, seqlen_k, head_dim);
        let q = random_normal(s.q_shape().iter().product(), seed as u64);
        let k = random_normal(s.kv_shape().iter().product(), seed as u64 + 1);
        let v = random_normal(s.kv_shape().iter().product(), seed as u64 + 2);
        let plain = cpu::attention(&q, &k, &v, &s, params(scale, causal)).unwrap();
        let tiled = cpu::flash_attention(&q, &k, &v, &s, params(scale, causal), TileConfig::new(block_m, block_n)).unwrap();
        for (a, b) in plain.o.iter().zip(&tiled.o) {
            prop_assert!((a - b).abs() <= CPU_TILED_TOLERANCE * (1.0 + a.abs()), "O: {a} vs {b}");
        }
        for (a, b) in plain.lse.iter().zip(&tiled.lse) {
            prop_assert!(a == b || (a - b).abs() <= CPU_TILED_TOLERANCE * (1.0 + a.abs()), "LSE: {a} vs {b}");
        }
    }
}

/// loss(Q, K, V) = Σ O ∘ W: its gradient is what `attention_backward` computes with dO = W.
fn loss(q: &[f32], k: &[f32], v: &[f32], w: &[f32], s: &AttentionShape, p: cpu::Params) -> f64 {
    cpu::attention(q, k, v, s, p).unwrap().o.iter().zip(w).map(|(o, &w)| o * w as f64).sum()
}

/// The CPU backward against central finite differences of the CPU forward, on tiny shapes with
/// every mask, cross-attention lengths and a GQA group.
#[test]
fn cpu_backward_matches_finite_differences() {
    let cases = [
        (shape(1, 2, 1, 3, 5, 4), Causal::None),
        (shape(1, 2, 1, 5, 3, 4), Causal::TopLeft),
        (shape(2, 1, 1, 5, 3, 3), Causal::BottomRight),
        (shape(1, 4, 2, 4, 4, 2), Causal::TopLeft),
        (shape(1, 3, 3, 4, 6, 3), Causal::None),
    ];
    // Each case once plain, once softcapped (a cap small enough that tanh bends) and once with
    // ALiBi (3 heads in case 1 and 4: slopes off the power-of-two sequence).
    let scores = [ScoreMod::default(), ScoreMod::softcap(0.8), ScoreMod::alibi(Alibi::standard())];
    let cases = cases.into_iter().flat_map(|case| scores.map(|score| (case, score)));
    for (case, ((s, causal), score)) in cases.enumerate() {
        let p = cpu::Params { score, ..params(0.7, causal) };
        let seed = 10 * case as u64;
        let mut inputs = [
            random_normal(s.q_shape().iter().product(), seed),
            random_normal(s.kv_shape().iter().product(), seed + 1),
            random_normal(s.kv_shape().iter().product(), seed + 2),
        ];
        let w = random_normal(s.q_shape().iter().product(), seed + 3);
        let grads = cpu::attention_backward(&inputs[0], &inputs[1], &inputs[2], &w, &s, p).unwrap();
        for (which, analytic) in [(0, &grads.dq), (1, &grads.dk), (2, &grads.dv)] {
            for index in 0..inputs[which].len() {
                let original = inputs[which][index];
                let h = 1e-3f32;
                inputs[which][index] = original + h;
                let up = loss(&inputs[0], &inputs[1], &inputs[2], &w, &s, p);
                let plus = inputs[which][index] as f64;
                inputs[which][index] = original - h;
                let down = loss(&inputs[0], &inputs[1], &inputs[2], &w, &s, p);
                // The perturbed inputs are f32: divide by the step actually taken.
                let numeric = (up - down) / (plus - inputs[which][index] as f64);
                inputs[which][index] = original;
                let exact = analytic[index];
                assert!(
                    (numeric - exact).abs() <= 1e-5 + 1e-4 * exact.abs(),
                    "case {case} ({causal:?}, {score:?}), input {which}, element {index}: finite difference {numeric}, backward {exact}"
                );
            }
        }
    }
}

#[test]
fn causal_masks_follow_their_definitions() {
    // seqlen_q = 3 > seqlen_k = 2: top-left hides key 1 from query 0; bottom-right (offset −1)
    // hides every key from query 0 and key 1 from query 1.
    let visible =
        |c: Causal| -> Vec<Vec<bool>> { (0..3).map(|i| (0..2).map(|j| c.visible(i, j, 3, 2)).collect()).collect() };
    assert_eq!(visible(Causal::None), vec![vec![true, true]; 3]);
    assert_eq!(visible(Causal::TopLeft), vec![vec![true, false], vec![true, true], vec![true, true]]);
    assert_eq!(visible(Causal::BottomRight), vec![vec![false, false], vec![true, false], vec![true, true]]);
    // And the reference turns a row with no key into O = 0, LSE = −∞.
    let s = shape(1, 1, 1, 3, 2, 2);
    let r = cpu::attention(&[1.0; 6], &[1.0; 4], &[1.0; 4], &s, params(1.0, Causal::BottomRight)).unwrap();
    assert_eq!((&r.o[..2], r.lse[0]), (&[0.0, 0.0][..], f64::NEG_INFINITY));
}

#[test]
fn attention_of_one_key_is_that_value() {
    // With a single key, softmax is 1 and O is V's row, whatever Q; LSE is the one score.
    let s = shape(1, 1, 1, 3, 1, 4);
    let q = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5];
    let k = [2.0, 0.0, 0.0, 0.0];
    let v = [1.0, 2.0, 3.0, 4.0];
    let r = cpu::attention(&q, &k, &v, &s, params(1.0, Causal::None)).unwrap();
    for row in r.o.chunks(4) {
        assert_eq!(row, [1.0, 2.0, 3.0, 4.0]);
    }
    assert_eq!(r.lse, [2.0, 0.0, 1.0]);
}

#[test]
fn attention_head_matches_full_reference() {
    let s = shape(2, 4, 2, 33, 21, 8);
    let q = random_normal(s.q_shape().iter().product(), 1);
    let k = random_normal(s.kv_shape().iter().product(), 2);
    let v = random_normal(s.kv_shape().iter().product(), 3);
    let full = cpu::attention(&q, &k, &v, &s, params(0.3, Causal::TopLeft)).unwrap();
    let one = cpu::attention_head(&q, &k, &v, &s, params(0.3, Causal::TopLeft), 1, 3).unwrap();
    let start = s.q_head_offset(1, 3);
    assert_eq!(&full.o[start..start + 33 * 8], &one.o[..]);
}

#[test]
fn relative_error_catches_nan() {
    assert!(relative_l2_error(&[1.0, f32::NAN], &[1.0, 1.0]).is_nan());
}

#[test]
fn shape_errors_name_the_problem() {
    let ok = [2, 4, 10, 64];
    type Case<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a str);
    let cases: [Case; 6] = [
        (&[2, 4, 10], &ok, &ok, "4 dimensions"),
        (&ok, &[2, 4, 0, 64], &[2, 4, 0, 64], "at least 1"),
        (&ok, &[2, 4, 10, 64], &[2, 4, 11, 64], "same shape"),
        (&ok, &[3, 4, 10, 64], &[3, 4, 10, 64], "batch"),
        (&ok, &[2, 4, 10, 32], &[2, 4, 10, 32], "head_dim"),
        (&ok, &[2, 3, 10, 64], &[2, 3, 10, 64], "not a multiple"),
    ];
    for (q, k, v, expected) in cases {
        match AttentionShape::from_qkv(q, k, v).map_err(Error::from) {
            Err(Error::Shape(message)) => assert!(message.contains(expected), "{message:?} lacks {expected:?}"),
            other => panic!("q {q:?} k {k:?} v {v:?}: expected a shape error, got {other:?}"),
        }
    }
    let s = AttentionShape::from_qkv(&[2, 8, 10, 64], &[2, 2, 12, 64], &[2, 2, 12, 64]).unwrap();
    assert_eq!((s.group_size(), s.seqlen_k), (4, 12));
}

fn device_with_shared_memory(bytes: usize) -> DeviceInfo {
    DeviceInfo {
        ordinal: 0,
        name: "test device".into(),
        compute_capability: (8, 6),
        sm_count: 1,
        max_shared_memory_per_block: bytes,
        total_memory: 1 << 30,
    }
}

#[test]
fn tile_validation_lists_allowed_values() {
    let big = device_with_shared_memory(227 * 1024);
    for head_dim in [32, 64, 128, 256] {
        for tile in TileConfig::compiled(head_dim) {
            assert!(tile.validate(head_dim, &big).is_ok(), "{tile:?} d{head_dim} should fit 227 KiB");
        }
        assert!(TileConfig::compiled(head_dim).contains(&TileConfig::default_for(head_dim)));
        assert!(TileConfig::compiled(head_dim).contains(&TileConfig::default_backward_for(head_dim)));
    }
    let err = TileConfig::new(48, 64).validate(64, &big).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("block_m ∈ {16, 32, 64}") && message.contains("head_dim ∈ {32, 64, 128, 256}"),
        "{message}"
    );
    // Between the compiled head dims a tile runs on the next one (the f32 instances are all
    // padded); above the largest, nothing does.
    assert!(TileConfig::new(64, 64).validate(96, &big).is_ok());
    assert!(TileConfig::new(16, 16).validate(300, &big).is_err());
}

#[test]
fn tile_validation_checks_shared_memory() {
    // 99 KiB: a consumer Ampere/Ada GPU. 64×64 at head_dim 128 needs ~114 KiB.
    let small = device_with_shared_memory(99 * 1024);
    let err = TileConfig::new(64, 64).validate(128, &small).unwrap_err();
    let backward = TileConfig::new(32, 32).validate_for(FlashKernel::Backward, 128, &small);
    assert!(TileConfig::new(32, 32).validate(128, &small).is_ok() && backward.is_ok(), "{backward:?}");
    match &err {
        Error::SharedMemory { needed, available, fitting, .. } => {
            assert!(needed > available);
            assert!(fitting.contains("(16, 16)"), "{err}");
        }
        other => panic!("expected a shared-memory error, got {other:?}"),
    }
}

#[test]
fn cpu_references_reject_inputs_that_do_not_match_the_shape() {
    let s = shape(1, 2, 1, 5, 3, 4);
    let (q, kv) = (vec![1.0; 40], vec![1.0; 12]);
    let p = params(1.0, Causal::None);
    assert!(matches!(cpu::attention(&q[..20], &kv, &kv, &s, p), Err(Error::Length { expected: 40, got: 20 })));
    assert!(matches!(cpu::attention_backward(&q, &kv, &kv, &q[..1], &s, p), Err(Error::Length { .. })));
    assert!(matches!(cpu::attention_head(&q, &kv, &kv, &s, p, 0, 2), Err(Error::Shape(_))));
    assert!(matches!(cpu::flash_attention(&q, &kv, &kv, &s, p, TileConfig::new(0, 4)), Err(Error::Shape(_))));
    assert!(matches!(cpu::attention(&q, &kv, &kv, &shape(1, 2, 0, 5, 3, 4), p), Err(Error::Shape(_))));
    assert!(matches!(cpu::vector_add(&[1.0], &[1.0, 2.0]), Err(Error::Length { .. })));
}

#[test]
fn uncompiled_head_dim_is_reported_before_the_tile() {
    let big = device_with_shared_memory(227 * 1024);
    let err = TileConfig::default_for(300).validate(300, &big).unwrap_err();
    assert!(matches!(err, Error::HeadDimNotCompiled { head_dim: 300, .. }), "{err}");
    assert!(err.to_string().contains("1 to 256"), "{err}");
    // Between the compiled ones, a head_dim runs on the next one.
    assert_eq!(TileConfig::padded_head_dim(FlashKernel::Forward, DType::F32, 96).unwrap(), 128);
    assert_eq!(TileConfig::padded_head_dim(FlashKernel::Forward, DType::F16, 72).unwrap(), 96);
    assert_eq!(TileConfig::padded_head_dim(FlashKernel::Backward, DType::Bf16, 1).unwrap(), 32);
    assert_eq!(TileConfig::padded_head_dim(FlashKernel::Backward, DType::F16, 160).unwrap(), 192);
    assert!(TileConfig::padded_head_dim(FlashKernel::Backward, DType::F16, 257).is_err());
    assert!(TileConfig::padded_head_dim(FlashKernel::Forward, DType::F16, 0).is_err());
}

#[test]
fn hidden_keys_do_not_reach_rows_even_when_infinite() {
    // Causal top-left over 3 keys: row 0 sees only key 0, so an ∞ in V's row 2 must leave it
    // finite, while rows 2.. (which see key 2) become infinite.
    let s = shape(1, 1, 1, 3, 3, 2);
    let q = random_normal(6, 1);
    let k = random_normal(6, 2);
    let mut v = random_normal(6, 3);
    v[2 * 2] = f32::INFINITY;
    let r = cpu::attention(&q, &k, &v, &s, params(1.0, Causal::TopLeft)).unwrap();
    assert!(r.o[..4].iter().all(|x| x.is_finite()), "{:?}", r.o);
    assert!(!r.o[4..].iter().all(|x| x.is_finite()), "{:?}", r.o);
}

/// ALiBi's slopes as the kernels compute them (`attention::score::alibi_slope`, in `f32` with
/// the hardware's `exp2`) are the definition's (`Alibi::slope`): the paper's sequence for 8 heads
/// (1/2, 1/4, …, 1/256), BLOOM's completion for 12.
#[test]
fn alibi_slopes_follow_the_paper() {
    let alibi = Alibi::standard();
    for h in 0..8 {
        assert_eq!(alibi.slope(h, 8), 0.5f64.powi(h as i32 + 1));
    }
    // 12 heads: the 8-head sequence, then the odd terms of the 16-head one (2^-0.5, 2^-1.5, …).
    assert_eq!(alibi.slope(8, 12), 2f64.powf(-0.5));
    assert_eq!(alibi.slope(11, 12), 2f64.powf(-3.5));
    for num_heads in [1, 2, 3, 5, 12, 16, 40, 64, 71] {
        for head in 0..num_heads {
            let kernel = attn_kernels::attention::score::alibi_slope(8.0, head, num_heads) as f64;
            let host = alibi.slope(head, num_heads);
            assert!((kernel - host).abs() <= 1e-6 * host, "{head} of {num_heads}: {kernel} vs {host}");
        }
    }
}

/// A softcap bounds every logit: with a small cap the softmax flattens toward uniform, with a
/// cap far above the logits it changes nothing; ALiBi of a head with slope s makes row i's
/// weights fall by e^(−s) per key of distance.
#[test]
fn score_mods_follow_their_definitions() {
    let s = shape(1, 1, 1, 1, 6, 4);
    let q = random_normal(4, 1);
    let k = random_normal(24, 2);
    let v: Vec<f32> = (0..24).map(|i| (i / 4) as f32).collect(); // value j = j in every column
    let run =
        |score: ScoreMod| cpu::attention(&q, &k, &v, &s, cpu::Params { score, ..params(1.0, Causal::None) }).unwrap();
    let plain = run(ScoreMod::default());
    let wide = run(ScoreMod::softcap(1e6));
    assert!(plain.o.iter().zip(&wide.o).all(|(a, b)| (a - b).abs() < 1e-9));
    let tight = run(ScoreMod::softcap(1e-6));
    assert!(tight.o.iter().all(|o| (o - 2.5).abs() < 1e-4), "{:?}", tight.o); // uniform: mean of 0..6
    // Zero queries: only ALiBi's bias is left, −slope · |0 + 6 − 1 − j| (one head: slope 2^−8).
    let zero_q = vec![0.0; 4];
    let params = cpu::Params { score: ScoreMod::alibi(Alibi::standard()), ..params(1.0, Causal::None) };
    let alibi = cpu::attention(&zero_q, &k, &v, &s, params).unwrap();
    let slope = Alibi::standard().slope(0, 1);
    assert_eq!(slope, 1.0 / 256.0);
    let weights: Vec<f64> = (0..6).map(|j| (-slope * (5.0 - j as f64)).exp()).collect();
    let expected = weights.iter().enumerate().map(|(j, w)| j as f64 * w).sum::<f64>() / weights.iter().sum::<f64>();
    assert!((alibi.o[0] - expected).abs() < 1e-12, "{} vs {expected}", alibi.o[0]);
}

/// Bad score modifications are typed errors, before any launch.
#[test]
fn bad_score_mods_are_refused() {
    for score in [
        ScoreMod::softcap(0.0),
        ScoreMod::softcap(-1.0),
        ScoreMod::softcap(f32::NAN),
        ScoreMod::alibi(Alibi { max_bias: f32::INFINITY }),
        ScoreMod { softcap: Some(30.0), alibi: Some(Alibi::standard()) },
    ] {
        let options = AttentionOptions { score, ..Default::default() };
        assert!(matches!(options.checked_scale(64), Err(Error::ScoreMod(_))), "{score:?}");
    }
    assert!(AttentionOptions::default().with_softcap(50.0).checked_scale(64).is_ok());
}

/// Attention sinks by their definition: a sink of −∞ changes nothing; a row's LSE is
/// ln(e^sink + Σ e^ℓ) and its O the plain one scaled by e^(LSE_plain − LSE); a row that sees no
/// key has O = 0 and LSE = the sink; a wrong number of sinks is a typed error.
#[test]
fn sinks_follow_their_definition() {
    let s = shape(1, 3, 1, 4, 5, 4);
    let [q, k, v] = [0, 1, 2].map(|i| random_normal(if i == 0 { 48 } else { 20 }, 40 + i));
    let plain = cpu::attention(&q, &k, &v, &s, params(0.7, Causal::BottomRight)).unwrap();
    let none = [f32::NEG_INFINITY; 3];
    let with_none =
        cpu::attention(&q, &k, &v, &s, cpu::Params { sinks: Some(&none), ..params(0.7, Causal::BottomRight) });
    assert_eq!(with_none.unwrap().o, plain.o);
    let sinks = [0.5f32, -2.0, 3.0];
    let p = cpu::Params { sinks: Some(&sinks), ..params(0.7, Causal::BottomRight) };
    let sunk = cpu::attention(&q, &k, &v, &s, p).unwrap();
    for row in 0..12 {
        let sink = sinks[row / 4] as f64;
        let lse = (sink.exp() + plain.lse[row].exp()).ln();
        assert!((sunk.lse[row] - lse).abs() < 1e-12, "row {row}: {} vs {lse}", sunk.lse[row]);
        let factor = (plain.lse[row] - lse).exp();
        for c in 0..4 {
            let want = plain.o[row * 4 + c] * factor;
            assert!((sunk.o[row * 4 + c] - want).abs() < 1e-12, "row {row}");
        }
    }
    // Bottom-right with 7 queries for 5 keys: the first 2 rows of each head see no key.
    let s = shape(1, 3, 1, 7, 5, 4);
    let q = random_normal(84, 44);
    let sunk = cpu::attention(&q, &k, &v, &s, cpu::Params { sinks: Some(&sinks), ..params(0.7, Causal::BottomRight) });
    let sunk = sunk.unwrap();
    for (h, &sink) in sinks.iter().enumerate() {
        for i in 0..2 {
            let row = h * 7 + i;
            assert_eq!(sunk.lse[row], sink as f64, "an empty row's LSE is its sink");
            assert!(sunk.o[row * 4..row * 4 + 4].iter().all(|&x| x == 0.0));
        }
    }
    let short = [1.0f32; 2];
    let wrong = cpu::attention(&q, &k, &v, &s, cpu::Params { sinks: Some(&short), ..params(0.7, Causal::None) });
    assert!(matches!(wrong, Err(Error::Sinks(_))), "{wrong:?}");
}

/// The backward with sinks (dQ, dK, dV and dSinks) against central finite differences of the
/// forward, with GQA, every mask and the score modifications.
#[test]
fn sink_gradients_match_finite_differences() {
    let cases = [
        (shape(1, 2, 1, 3, 5, 4), Causal::None, ScoreMod::default()),
        (shape(2, 2, 1, 5, 3, 3), Causal::BottomRight, ScoreMod::softcap(0.8)),
        (shape(1, 4, 2, 4, 4, 2), Causal::TopLeft, ScoreMod::alibi(Alibi::standard())),
    ];
    for (case, (s, causal, score)) in cases.into_iter().enumerate() {
        let seed = 70 + 10 * case as u64;
        let mut sinks: Vec<f32> = random_normal(s.num_heads_q, seed + 5).iter().map(|x| 1.0 + x).collect();
        let inputs = [
            random_normal(s.q_shape().iter().product(), seed),
            random_normal(s.kv_shape().iter().product(), seed + 1),
            random_normal(s.kv_shape().iter().product(), seed + 2),
        ];
        let w = random_normal(s.q_shape().iter().product(), seed + 3);
        let base = cpu::Params { score, ..params(0.7, causal) };
        let grads = cpu::attention_backward(
            &inputs[0],
            &inputs[1],
            &inputs[2],
            &w,
            &s,
            cpu::Params { sinks: Some(&sinks), ..base },
        )
        .unwrap();
        let loss_at = |sinks: &[f32], inputs: &[Vec<f32>; 3]| {
            loss(&inputs[0], &inputs[1], &inputs[2], &w, &s, cpu::Params { sinks: Some(sinks), ..base })
        };
        for h in 0..s.num_heads_q {
            let original = sinks[h];
            sinks[h] = original + 1e-3;
            let (up, plus) = (loss_at(&sinks, &inputs), sinks[h] as f64);
            sinks[h] = original - 1e-3;
            let down = loss_at(&sinks, &inputs);
            let numeric = (up - down) / (plus - sinks[h] as f64);
            sinks[h] = original;
            let exact = grads.d_sinks[h];
            assert!(
                (numeric - exact).abs() <= 1e-5 + 1e-4 * exact.abs(),
                "case {case}, sink {h}: {numeric} vs {exact}"
            );
        }
        let mut inputs = inputs;
        for (which, analytic) in [(0, &grads.dq), (1, &grads.dk), (2, &grads.dv)] {
            for index in 0..inputs[which].len() {
                let original = inputs[which][index];
                inputs[which][index] = original + 1e-3;
                let (up, plus) = (loss_at(&sinks, &inputs), inputs[which][index] as f64);
                inputs[which][index] = original - 1e-3;
                let down = loss_at(&sinks, &inputs);
                let numeric = (up - down) / (plus - inputs[which][index] as f64);
                inputs[which][index] = original;
                let exact = analytic[index];
                assert!(
                    (numeric - exact).abs() <= 1e-5 + 1e-4 * exact.abs(),
                    "case {case}, input {which}, element {index}: {numeric} vs {exact}"
                );
            }
        }
    }
}

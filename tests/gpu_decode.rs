//! The KV-cache decoder (level 10, `Context::attention_with_kv_cache`) on the GPU, against the
//! float64 reference: the issue's decoding shapes, every compiled head_dim and the ones between,
//! paged and contiguous caches in both layouts, appends, bottom-right causal with several queries,
//! empty and over-long sequences, forced and chosen split counts, sliding windows, softcapping,
//! ALiBi and attention sinks; and random cases.

mod common;

use attn_host::{Alibi, Causal, Layout, ScoreMod, SlidingWindow, bf16, f16};
use common::decode::{DecodeCase, check_decode};
use common::{gpu, gpu_proptest_config};
use proptest::prelude::*;

/// The decoding rows of issue 22 (GQA 32/8 over 8192 keys, MHA over 32768), and the splits the
/// heuristic picks for them on this GPU.
#[test]
fn decoder_runs_the_issue_rows() {
    let Some(ctx) = gpu("decoder_runs_the_issue_rows") else { return };
    let gqa = DecodeCase::simple(8, (32, 8), 1, 128, 8192);
    let mha = DecodeCase::simple(1, (32, 32), 1, 128, 32768);
    check_decode::<bf16>(ctx, &gqa, 1);
    check_decode::<bf16>(ctx, &mha, 2);
    check_decode::<f16>(ctx, &gqa, 3);
}

/// Every compiled head_dim and the ones between (not multiples of 8 included), both types,
/// GQA groups from 1 to 8 with 1 to 8 queries (packed rows from 1 to 64: one to four row
/// blocks), paged and contiguous, both layouts.
#[test]
fn decoder_covers_head_dims_groups_and_layouts() {
    let Some(ctx) = gpu("decoder_covers_head_dims_groups_and_layouts") else { return };
    let mut seed = 100;
    for &d in &[17, 32, 40, 64, 72, 80, 96, 100, 112, 128, 160, 192, 256] {
        for &(hq, hkv, sq) in &[(8, 8, 1), (8, 2, 3), (16, 2, 8)] {
            let mut case = DecodeCase::simple(3, (hq, hkv), sq, d, 0);
            case.cached = vec![1000, 1, 333];
            case.capacity = 1024;
            case.causal = if sq > 1 { Causal::BottomRight } else { Causal::None };
            for (paged, layout) in [(false, Layout::Bshd), (true, Layout::Bhsd)] {
                case.layout = layout;
                case.page_size = paged.then_some(64);
                seed += 1;
                if seed % 2 == 0 {
                    check_decode::<bf16>(ctx, &case, seed);
                } else {
                    check_decode::<f16>(ctx, &case, seed);
                }
            }
        }
    }
}

/// Appends of 1 and 7 rows (into pages of 16, crossing a page), empty sequences (O = 0,
/// LSE = −∞), a sequence whose new rows run past the capacity (dropped), split counts from 1
/// to more than the key tiles, and a cache without lengths.
#[test]
fn decoder_appends_and_meets_the_edges() {
    let Some(ctx) = gpu("decoder_appends_and_meets_the_edges") else { return };
    let mut seed = 300;
    for &new_keys in &[1, 7] {
        for &page in &[None, Some(16), Some(256)] {
            let mut case = DecodeCase::simple(4, (12, 4), 2, 128, 0);
            case.cached = vec![0, 15, 500, 1019];
            case.capacity = 1024;
            case.page_size = page;
            case.new_keys = new_keys;
            case.causal = Causal::BottomRight;
            for splits in [Some(1), Some(5), None] {
                case.num_splits = splits;
                seed += 1;
                check_decode::<bf16>(ctx, &case, seed);
            }
        }
    }
    // Every sequence empty.
    let mut empty = DecodeCase::simple(2, (4, 4), 1, 64, 0);
    empty.capacity = 64;
    check_decode::<f16>(ctx, &empty, 400);
    // Without lengths: the whole capacity.
    let mut full = DecodeCase::simple(2, (8, 1), 4, 64, 777);
    full.with_seqlens = false;
    full.num_splits = Some(300);
    check_decode::<f16>(ctx, &full, 401);
}

/// What models' decoding layers add, at their sizes: GPT-OSS (64 query heads over 8 K/V heads,
/// a 128-token window and sinks on alternate layers), Gemma 2 (softcap 50, a 4096-token window,
/// 16 over 8 heads at head_dim 256), Mistral (a 4096-token window over 8192 keys), BLOOM's ALiBi;
/// split by the heuristic and by hand.
#[test]
fn decoder_runs_model_layers_with_windows_mods_and_sinks() {
    let Some(ctx) = gpu("decoder_runs_model_layers_with_windows_mods_and_sinks") else { return };
    let mut gpt_oss = DecodeCase::simple(4, (64, 8), 1, 64, 0);
    gpt_oss.cached = vec![5000, 127, 3, 9000];
    gpt_oss.capacity = 9216;
    gpt_oss.page_size = Some(64);
    gpt_oss.sinks = true;
    check_decode::<bf16>(ctx, &gpt_oss, 501);
    gpt_oss.window = Some(SlidingWindow::left(127));
    check_decode::<bf16>(ctx, &gpt_oss, 502);
    let mut gemma = DecodeCase::simple(2, (16, 8), 2, 256, 8192);
    gemma.causal = Causal::BottomRight;
    gemma.window = Some(SlidingWindow::left(4095));
    gemma.score = ScoreMod::softcap(50.0);
    check_decode::<bf16>(ctx, &gemma, 503);
    let mut mistral = DecodeCase::simple(8, (32, 8), 1, 128, 8192);
    mistral.window = Some(SlidingWindow::left(4095));
    for splits in [None, Some(1), Some(16)] {
        mistral.num_splits = splits;
        check_decode::<f16>(ctx, &mistral, 504);
    }
    let mut bloom = DecodeCase::simple(2, (14, 14), 1, 64, 2000);
    bloom.score = ScoreMod::alibi(Alibi::standard());
    check_decode::<f16>(ctx, &bloom, 505);
}

prop_compose! {
    fn cases()(
        batch in 1usize..5,
        group in prop::sample::select(vec![1usize, 2, 4, 5, 8]),
        hkv in 1usize..4,
        sq in 1usize..9,
        d in prop::sample::select(vec![8usize, 24, 64, 80, 96, 128, 136, 192, 256]),
        capacity in 1usize..3000,
        paged in prop::sample::select(vec![None, Some(16usize), Some(32), Some(128)]),
        bshd in any::<bool>(),
        causal in any::<bool>(),
        new_keys in 0usize..4,
        splits in prop::sample::select(vec![None, Some(1usize), Some(2), Some(7), Some(64)]),
        lengths in prop::collection::vec(0.0f64..=1.0, 4),
        window in prop::option::of((0usize..300, prop::option::of(0usize..4))),
        modification in 0u8..3,
        sinks in any::<bool>(),
    ) -> DecodeCase {
        let mut case = DecodeCase::simple(batch, (group * hkv, hkv), sq, d, 0);
        case.cached = (0..batch).map(|b| (lengths[b] * capacity as f64) as usize).collect();
        case.capacity = capacity;
        case.page_size = paged;
        case.layout = if bshd { Layout::Bshd } else { Layout::Bhsd };
        case.causal = if causal { Causal::BottomRight } else { Causal::None };
        case.new_keys = new_keys;
        case.num_splits = splits;
        case.window = window.map(|(left, right)| SlidingWindow::new(Some(left), right));
        case.score = match modification {
            0 => ScoreMod::default(),
            1 => ScoreMod::softcap(20.0),
            _ => ScoreMod::alibi(Alibi::standard()),
        };
        case.sinks = sinks;
        case
    }
}

#[test]
fn decoder_matches_the_reference_on_random_cases() {
    let Some(ctx) = gpu("decoder_matches_the_reference_on_random_cases") else { return };
    proptest!(gpu_proptest_config(40), |(case in cases(), bf in any::<bool>(), seed in any::<u32>())| {
        if bf {
            check_decode::<bf16>(ctx, &case, seed as u64);
        } else {
            check_decode::<f16>(ctx, &case, seed as u64);
        }
    });
}

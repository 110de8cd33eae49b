//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod attention;
pub mod decode;
pub mod files;
pub mod tensor_cores;

use std::collections::{BTreeSet, HashSet};
use std::io::Write;
use std::sync::{Mutex, Once, OnceLock};

use attn_host::{AttentionShape, Context, DType, DqAccumulation, Error, FlashKernel, TileConfig};
use proptest::test_runner::Config;

/// The kernels of a pass (`dq`: the backward in that dQ mode, `None`: the forward).
fn pass_kernels(dq: Option<DqAccumulation>) -> &'static [FlashKernel] {
    match dq {
        None => &[FlashKernel::Forward],
        Some(DqAccumulation::Atomic) => &[FlashKernel::Backward],
        Some(DqAccumulation::Deterministic) => &[FlashKernel::BackwardDkDv, FlashKernel::BackwardDq],
    }
}

/// The pass's name in the lines the helpers print.
fn pass_name(dq: Option<DqAccumulation>) -> String {
    dq.map_or("forward".to_string(), |mode| format!("{mode:?} backward"))
}

/// Whether the device's shared memory holds every kernel of the pass at `tile`.
fn tile_fits(ctx: &Context, tile: TileConfig, dtype: DType, head_dim: usize, dq: Option<DqAccumulation>) -> bool {
    pass_kernels(dq).iter().all(|&kernel| {
        !matches!(tile.validate_kernel(kernel, dtype, head_dim, ctx.device()), Err(Error::SharedMemory { .. }))
    })
}

/// The tile the context picks for the pass (`Context::default_tile`, `default_backward_tile`).
fn default_tile(ctx: &Context, dtype: DType, head_dim: usize, dq: Option<DqAccumulation>) -> TileConfig {
    match dq {
        None => ctx.default_tile(dtype, head_dim),
        Some(mode) => ctx.default_backward_tile(dtype, head_dim, mode),
    }
}

/// The tile a test runs: `tile` where the device's shared memory holds the pass's kernels at
/// `dtype` and `head_dim` (`dq`: the backward in that dQ mode, `None`: the forward), else the
/// tile the context picks for that pass (`Context::default_tile`, `default_backward_tile`), with
/// a line on stderr. The tests' tiles are an H200's; under a smaller GPU's profile
/// (`RUST_ATTENTION_GPU_PROFILE`) some do not fit, and the test then checks what that GPU runs.
pub fn on_device(
    ctx: &Context,
    tile: TileConfig,
    dtype: DType,
    head_dim: usize,
    dq: Option<DqAccumulation>,
) -> TileConfig {
    if tile_fits(ctx, tile, dtype, head_dim, dq) {
        return tile;
    }
    let fitting = default_tile(ctx, dtype, head_dim, dq);
    let line = format!(
        "{dtype} {} at head_dim {head_dim}: {tile} does not fit {}; running {fitting}\n",
        pass_name(dq),
        ctx.device().name
    );
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    fitting
}

/// Whether `ctx` runs kernels of `dtype` ([`attn_host::DeviceInfo::supports`]): not `bf16` on a
/// Turing GPU (or a GPU context under the T4 profile; the emulator runs every type). A check of
/// a type the device lacks is left out, with a line on stderr (once per type), and the test goes
/// on with the others.
pub fn runs(ctx: &Context, dtype: DType) -> bool {
    if ctx.device().supports(dtype) {
        return true;
    }
    static REPORTED: Mutex<Option<HashSet<DType>>> = Mutex::new(None);
    if REPORTED.lock().unwrap().get_or_insert_default().insert(dtype) {
        let line = format!("{dtype} checks left out: {} has no {dtype} kernels\n", ctx.device().name);
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
    false
}

/// Whether `ctx` has a tile for the pass at `dtype` and `head_dim` (`dq`: the backward in that
/// dQ mode, `None`: the forward) within its shared memory: the default one fits
/// ([`on_device`]'s fallback). On every GPU from compute capability 8.0 it does; a T4's 64 KiB
/// hold no `f16` tile above head_dim 192 nor an `f32` backward tile above 128, and a check there
/// is left out with a line on stderr (once per case).
pub fn fits(ctx: &Context, dtype: DType, head_dim: usize, dq: Option<DqAccumulation>) -> bool {
    let fits = tile_fits(ctx, default_tile(ctx, dtype, head_dim, dq), dtype, head_dim, dq);
    if !fits {
        static REPORTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let case = format!("{dtype} {} at head_dim {head_dim}", pass_name(dq));
        if REPORTED.lock().unwrap().get_or_insert_default().insert(case.clone()) {
            let line = format!("{case} left out: no compiled tile fits {}\n", ctx.device().name);
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
    }
    fits
}

/// The GPU context for this test binary, created once. Without a GPU it prints a visible skip
/// line and returns `None`, unless `REQUIRE_GPU=1` is set, in which case the test fails. Either
/// way the test is counted for the line the binary prints when it exits ([`tally`]).
pub fn gpu(test: &str) -> Option<&'static Context> {
    static CONTEXT: OnceLock<Result<Context, String>> = OnceLock::new();
    let context = CONTEXT.get_or_init(|| match Context::new(0) {
        Ok(ctx) => Ok(ctx),
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => Err(e.to_string()),
        Err(e) => panic!("a CUDA device is present but could not be used: {e}"),
    });
    match context {
        Ok(ctx) => {
            tally(test, None);
            Some(ctx)
        }
        Err(reason) if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test}: REQUIRE_GPU=1 but no CUDA device: {reason}")
        }
        Err(reason) => {
            tally(test, Some("no CUDA device; REQUIRE_GPU=1 makes this fail"));
            // Once per test, straight to stderr: the test harness captures `println!`, and a
            // skip must be visible in a normal `cargo test` run.
            static REPORTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
            if REPORTED.lock().unwrap().get_or_insert_default().insert(test.to_string()) {
                // One write call, so lines of tests running in parallel do not interleave.
                let line = format!("{test}: skipped: no CUDA device ({reason})\n");
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
            None
        }
    }
}

/// Counts `test` as run (`skipped: None`) or as skipped for the given reason, for the line
/// `gpu tests: R run, S skipped (…)` that the test binary prints on stderr as it exits, after the
/// harness's own `test result` line (whose "passed" includes the skipped tests). A test counts
/// once, and a skip wins over a run (a test that found a GPU but not the one it needs).
///
/// The line comes from a C `atexit` handler, registered by the first GPU test: the harness runs a
/// binary's tests on parallel threads and no test knows it is the last, a static's destructor
/// never runs, and `atexit` handlers run when `main` returns or calls `exit`, which the harness
/// does whether the tests passed or failed. (A binary whose GPU tests were all filtered out
/// prints no line; a test binary killed by a signal prints none either.)
pub fn tally(test: &str, skipped: Option<&'static str>) {
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: `atexit` is the C library's, called with a function that takes no arguments,
        // never unwinds (it only formats and writes) and may run on any thread.
        let _ = unsafe { atexit(print_tally) };
    });
    let mut guard = TALLY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let tally = guard.get_or_insert_default();
    match skipped {
        Some(reason) => {
            tally.run.remove(test);
            tally.skipped.insert(test.to_string());
            tally.reasons.insert(reason);
        }
        None if !tally.skipped.contains(test) => {
            tally.run.insert(test.to_string());
        }
        None => {}
    }
}

/// The GPU tests of this binary that ran and that skipped, and why they skipped.
#[derive(Default)]
struct Tally {
    run: HashSet<String>,
    skipped: HashSet<String>,
    reasons: BTreeSet<&'static str>,
}

static TALLY: Mutex<Option<Tally>> = Mutex::new(None);

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

/// Prints `gpu tests: R run, S skipped (reason)` on stderr (see [`tally`]).
extern "C" fn print_tally() {
    // `try_lock`: every test has finished by now, but a handler must not wait on anything.
    let Ok(guard) = TALLY.try_lock() else { return };
    let Some(tally) = guard.as_ref() else { return };
    let reasons = tally.reasons.iter().copied().collect::<Vec<_>>().join("; ");
    let why = if tally.skipped.is_empty() { String::new() } else { format!(" ({reasons})") };
    let line = format!("gpu tests: {} run, {} skipped{why}\n", tally.run.len(), tally.skipped.len());
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// A head_dim from the whole range the flash forward takes (1 to 256): half the time one that
/// models run or that sits awkwardly between the compiled ones (odd, not a multiple of 8, just
/// past a compiled one), otherwise any.
#[allow(dead_code)] // not every test binary draws head dims
pub fn head_dims() -> impl proptest::strategy::Strategy<Value = usize> {
    use proptest::prelude::*;
    prop_oneof![
        prop::sample::select(vec![1usize, 8, 17, 40, 64, 65, 72, 80, 96, 100, 112, 128, 160, 192, 200, 256]),
        1usize..=256,
    ]
}

/// A sliding window for property tests: none half the time; otherwise each side open or 0 to
/// 300 keys (windows narrower than a tile and wider than several), either alignment.
#[allow(dead_code)] // not every test binary draws windows
pub fn windows() -> impl proptest::strategy::Strategy<Value = Option<attn_host::SlidingWindow>> {
    use proptest::prelude::*;
    let side = prop_oneof![Just(None), (0usize..=300).prop_map(Some)];
    prop_oneof![
        Just(None),
        (side.clone(), side, any::<bool>()).prop_map(|(left, right, bottom_right)| Some(attn_host::SlidingWindow {
            left,
            right,
            bottom_right
        })),
    ]
}

/// proptest settings for GPU tests: enough cases to cover the shape space, no regression files
/// written next to the sources (the bundled binaries run far from them).
pub fn gpu_proptest_config(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

/// Grouped-query attention shape helper: `heads_q` query heads sharing `heads_kv` key/value heads.
pub fn gqa(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
) -> AttentionShape {
    AttentionShape { batch, num_heads_q: heads_q, num_heads_kv: heads_kv, seqlen_q, seqlen_k, head_dim }
}

/// Multi-head attention shape helper.
pub fn mha(batch: usize, heads: usize, seqlen: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { batch, num_heads_q: heads, num_heads_kv: heads, seqlen_q: seqlen, seqlen_k: seqlen, head_dim }
}

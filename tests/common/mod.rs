//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod attention;
pub mod files;
pub mod tensor_cores;

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

use attn_host::{AttentionShape, Context, Error};
use proptest::test_runner::Config;

/// The GPU context for this test binary, created once. Without a GPU it prints a visible skip
/// line and returns `None`, unless `REQUIRE_GPU=1` is set, in which case the test fails.
pub fn gpu(test: &str) -> Option<&'static Context> {
    static CONTEXT: OnceLock<Result<Context, String>> = OnceLock::new();
    let context = CONTEXT.get_or_init(|| match Context::new(0) {
        Ok(ctx) => Ok(ctx),
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => Err(e.to_string()),
        Err(e) => panic!("a CUDA device is present but could not be used: {e}"),
    });
    match context {
        Ok(ctx) => Some(ctx),
        Err(reason) if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test}: REQUIRE_GPU=1 but no CUDA device: {reason}")
        }
        Err(reason) => {
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

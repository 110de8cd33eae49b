//! The examples (`examples/`), run on the CPU emulator at tiny sizes, so that CI keeps them
//! working: each example's `run` is included here as a module and called with the arguments a
//! learner would type (`cargo run --example` would rebuild and start a process per example).

// Each example is a crate of its own with its own `mod common;`; included here as modules of one
// crate, they load `examples/common/mod.rs` once each, which is what they need.
#![allow(clippy::duplicate_mod)]

use attn_host::Context;
use clap::Parser;

macro_rules! example {
    ($name:ident, $file:literal) => {
        #[allow(dead_code)] // the examples' `main`s
        #[path = $file]
        mod $name;
    };
}

example!(vector_add, "../examples/01_vector_add.rs");
example!(naive_attention, "../examples/02_naive_attention.rs");
example!(flash_forward, "../examples/03_flash_forward.rs");
example!(flash_backward, "../examples/04_flash_backward.rs");
example!(tensor_core_forward, "../examples/05_tensor_core_forward.rs");
example!(tensor_core_backward, "../examples/06_tensor_core_backward.rs");
example!(hopper_forward, "../examples/08_hopper_forward.rs");

/// Runs `$module::run` on the emulator with the command line `$args`; every check must pass.
macro_rules! check_example {
    ($test:ident, $module:ident, [$($arg:literal),*]) => {
        #[test]
        fn $test() {
            let args = $module::Args::parse_from(["example", "--device", "cpu-emulated", $($arg),*]);
            let checks = $module::run(&Context::cpu_emulated(), &args).unwrap();
            for c in &checks {
                assert!(c.passed(), "{}: {}: relative L2 error {:.2e} > {:.0e}", stringify!($module), c.name, c.error, c.tolerance);
            }
        }
    };
}

check_example!(example_01_vector_add, vector_add, ["--n", "1001"]);
check_example!(
    example_02_naive_attention,
    naive_attention,
    ["--seqlen", "19", "--seqlen-k", "23", "--causal", "bottom-right"]
);
check_example!(
    example_03_flash_forward,
    flash_forward,
    ["--seqlen", "37", "--head-dim", "32", "--causal", "top-left", "--block-m", "16", "--block-n", "16"]
);
check_example!(
    example_04_flash_backward,
    flash_backward,
    ["--seqlen", "37", "--head-dim", "32", "--causal", "top-left"]
);
check_example!(example_05_tensor_core_forward, tensor_core_forward, ["--seqlen", "40", "--causal", "bottom-right"]);
check_example!(example_06_tensor_core_backward, tensor_core_backward, ["--seqlen", "40"]);
check_example!(example_08_hopper_forward, hopper_forward, []);

//! # Exercises: write the kernels of the guide yourself
//!
//! Each `exNN_*.rs` file here is a stub: it compiles, but the part you are to write does
//! nothing useful yet, so its test fails with a message that says what is wrong and where to
//! look. Fill it in and run its test on the CPU emulator (no GPU needed):
//!
//! ```sh
//! cargo test --release --manifest-path exercises/Cargo.toml ex01
//! ```
//!
//! | exercise | you write | guide chapter |
//! |---|---|---|
//! | [`ex01_vector_add`] | the vector add kernel: a grid-stride loop | Level 1 |
//! | [`ex02_softmax`] | the softmax of one row: max, sum of exp2, normalise | Level 2 |
//! | [`ex03_online_softmax`] | the online-softmax update: new max, rescale, add the tile | The online softmax, derived |
//! | [`ex04_causal_mask`] | the causal mask: `key_limit` and `visible`, both alignments | Level 3 |
//! | [`ex05_tile_loop`] | the key-tile loop of a small flash forward | Level 3 |
//!
//! The solutions are in `exercises/solutions/`; `--features solutions` builds them in place of
//! your files (CI runs the tests that way, so the tests stay honest). Read them after you pass.

// `${concat(..)}` in the `kernel!` macro below, as in the device crate.
#![feature(macro_metavar_expr_concat)]
// The stubs leave their arguments unused on purpose; the solutions must compile without these.
#![cfg_attr(not(feature = "solutions"), allow(unused_variables, unused_mut, unused_imports, unused_assignments))]
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

/// The host half of the device crate's `kernel!` macro (`kernels/src/lib.rs`, explained in the
/// guide's level 0): the kernel as a plain `unsafe fn`, plus a constant `emu_<name>` through
/// which the emulator (`attn_kernels::emu::launch`) calls it with the launch's arguments. The
/// exercises only run on the emulator, so the nvptx half (`extern "gpu-kernel"`) is left out;
/// the kernel's body is written exactly as in the device crate.
macro_rules! kernel {
    ($(#[$attr:meta])* pub unsafe fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) $body

        /// The CPU emulator's entry for the kernel of the same name.
        #[allow(non_upper_case_globals)]
        pub const ${concat(emu_, $name)}: attn_kernels::emu::HostKernel = attn_kernels::emu::HostKernel {
            name: stringify!($name),
            run: |args| {
                let expected = [$(stringify!($arg)),*].len();
                if args.len() != expected {
                    return Err(format!("{} arguments given, {} expected", args.len(), expected));
                }
                let mut args = args.iter();
                $(
                    let $arg = args
                        .next()
                        .and_then(<$ty as attn_kernels::emu::FromArg>::from_arg)
                        .ok_or_else(|| format!("argument `{}` has the wrong type", stringify!($arg)))?;
                )*
                // SAFETY: the caller of `emu::launch` guarantees the pointers.
                unsafe { $name($($arg),*) };
                Ok(())
            },
        };
    };
}

#[cfg_attr(feature = "solutions", path = "../solutions/ex01_vector_add.rs")]
pub mod ex01_vector_add;
#[cfg_attr(feature = "solutions", path = "../solutions/ex02_softmax.rs")]
pub mod ex02_softmax;
#[cfg_attr(feature = "solutions", path = "../solutions/ex03_online_softmax.rs")]
pub mod ex03_online_softmax;
#[cfg_attr(feature = "solutions", path = "../solutions/ex04_causal_mask.rs")]
pub mod ex04_causal_mask;
#[cfg_attr(feature = "solutions", path = "../solutions/ex05_tile_loop.rs")]
pub mod ex05_tile_loop;

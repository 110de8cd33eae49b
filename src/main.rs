//! `cargo run --release`: the main job. See `attn_host::cli` for what it does and its flags.

fn main() -> std::process::ExitCode {
    attn_host::cli::main()
}

//! Launches every kernel of the PTX module once, at small shapes chosen to be awkward (ragged
//! tails in both sequence lengths, a causal mask with seqlen_q ≠ seqlen_k, a GQA group), and
//! checks every result against the CPU reference. It is the workload of `scripts/sanitize`
//! (compute-sanitizer's memcheck, racecheck, synccheck and initcheck), and a quick smoke test for
//! a new GPU. It fails unless it has launched every kernel the registry lists.
//!
//! `every-kernel [cpu-emulated]`: the GPU (device 0) by default, or the CPU emulator.

use std::collections::BTreeSet;
use std::process::ExitCode;

use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::kernels::{FLASH_INSTANCES, entry};
use attn_host::{
    AttentionOptions, AttentionShape, Causal, Context, DqAccumulation, FlashKernel as Family, Result, TileConfig, cpu,
};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("every-kernel: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Fails with a message when `err` exceeds `tolerance` (or is NaN).
fn within(what: &str, err: f64, tolerance: f64) -> Result<()> {
    if err <= tolerance {
        Ok(())
    } else {
        Err(attn_host::Error::Shape(format!("{what}: relative error {err:.2e} above {tolerance:.0e}")))
    }
}

fn run() -> Result<()> {
    let ctx = match std::env::args().nth(1).as_deref() {
        Some("cpu-emulated") => Context::cpu_emulated(),
        _ => Context::new(0)?,
    };
    println!("every-kernel on {}", ctx.device().name);
    let mut launched: BTreeSet<&'static str> = BTreeSet::new();

    // Vector add, with a ragged tail.
    let n = 1003;
    let (a, b) = (random_normal(n, 1), random_normal(n, 2));
    let c = ctx.vector_add(&ctx.upload(&a, &[n])?, &ctx.upload(&b, &[n])?)?.to_host()?;
    within("vector_add", relative_l2_error(&c, &cpu::vector_add(&a, &b)?), 1e-7)?;
    launched.insert(entry::VECTOR_ADD_F32);

    for head_dim in TileConfig::compiled_head_dims() {
        let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 37, seqlen_k: 45, head_dim };
        let options = AttentionOptions::causal(Causal::BottomRight);
        let host = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()]
            .iter()
            .enumerate()
            .map(|(i, s)| random_normal(s.iter().product(), 10 * head_dim as u64 + i as u64))
            .collect::<Vec<_>>();
        let [q, k, v, d_o] = [&host[0], &host[1], &host[2], &host[3]];
        let (dq, dk, dv, ddo) = (
            ctx.upload(q, &shape.q_shape())?,
            ctx.upload(k, &shape.kv_shape())?,
            ctx.upload(v, &shape.kv_shape())?,
            ctx.upload(d_o, &shape.q_shape())?,
        );
        let params = cpu::Params { scale: options.scale_for(head_dim) as f64, causal: options.causal };
        let forward = cpu::attention(q, k, v, &shape, params)?;
        let backward = cpu::attention_backward(q, k, v, d_o, &shape, params)?;
        let check_forward = |what: &str, out: &attn_host::AttentionOutput| -> Result<()> {
            within(&format!("{what} O"), relative_l2_error(&out.o.to_host()?, &forward.o), 1e-5)?;
            within(&format!("{what} LSE"), lse_error(&out.lse.to_host()?, &forward.lse), 1e-5)
        };
        let check_backward = |what: &str, g: &attn_host::Gradients| -> Result<()> {
            within(&format!("{what} dQ"), relative_l2_error(&g.dq.to_host()?, &backward.dq), 1e-4)?;
            within(&format!("{what} dK"), relative_l2_error(&g.dk.to_host()?, &backward.dk), 1e-4)?;
            within(&format!("{what} dV"), relative_l2_error(&g.dv.to_host()?, &backward.dv), 1e-4)
        };

        if head_dim == TileConfig::compiled_head_dims()[0] {
            let out = ctx.attention_naive(&dq, &dk, &dv, &options)?;
            check_forward("naive forward", &out)?;
            check_backward("naive backward", &ctx.attention_naive_backward(&dq, &dk, &dv, &out.o, &ddo, &options)?)?;
            launched.extend([
                entry::NAIVE_SCORES_F32,
                entry::NAIVE_SOFTMAX_F32,
                entry::NAIVE_PV_F32,
                entry::FLASH_BWD_PREPROCESS_F32,
                entry::NAIVE_PT_X_F32,
                entry::NAIVE_DS_F32,
            ]);
        }

        for tile in TileConfig::compiled(head_dim) {
            let name = format!("d{head_dim} m{} n{}", tile.block_m, tile.block_n);
            let out = ctx.flash_attention_forward(&dq, &dk, &dv, &options, tile)?;
            check_forward(&format!("flash forward {name}"), &out)?;
            for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                let grads =
                    ctx.flash_attention_backward(&dq, &dk, &dv, &out.o, &out.lse, &ddo, &options, tile, mode)?;
                check_backward(&format!("flash backward {mode:?} {name}"), &grads)?;
            }
            for family in [Family::Forward, Family::Backward, Family::BackwardDkDv, Family::BackwardDq] {
                launched.insert(tile.compiled_entry(family, head_dim)?);
            }
        }
    }

    let all: BTreeSet<&'static str> =
        entry::ALL.iter().copied().chain(FLASH_INSTANCES.iter().map(|i| i.entry)).collect();
    let missed: Vec<_> = all.difference(&launched).collect();
    if !missed.is_empty() {
        return Err(attn_host::Error::Shape(format!("kernels never launched: {missed:?}")));
    }
    println!(
        "every-kernel: {} of {} kernels launched, every result matches the CPU reference",
        launched.len(),
        all.len()
    );
    Ok(())
}

//! The one-call API from a crate on stable Rust: a causal forward and backward on the GPU (on the
//! CPU emulator without one), O and dQ checked against the CPU reference.
use attn_host::{AttentionOptions, AttentionShape, Causal, Context, check, cpu};

fn main() -> attn_host::Result<()> {
    let ctx = Context::new(0).unwrap_or_else(|_| Context::cpu_emulated());
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q: 50, seqlen_k: 50, head_dim: 64 };
    let options = AttentionOptions::causal(Causal::TopLeft);
    let [q, k, v, d_o] = [1, 2, 3, 4].map(|seed| check::random_normal(shape.q_shape().iter().product(), seed));
    let upload = |x: &[f32]| ctx.upload(x, &shape.q_shape());
    let (q_gpu, k_gpu, v_gpu) = (upload(&q)?, upload(&k)?, upload(&v)?);
    let forward = ctx.attention(&q_gpu, &k_gpu, &v_gpu, &options)?;
    let grads = ctx.attention_backward(&forward, &upload(&d_o)?)?;
    let params = cpu::Params::of(&options, shape.head_dim);
    let (o, dq) =
        (cpu::attention(&q, &k, &v, &shape, params)?.o, cpu::attention_backward(&q, &k, &v, &d_o, &shape, params)?.dq);
    let errors =
        (check::relative_l2_error(&forward.o().to_host()?, &o), check::relative_l2_error(&grads.dq.to_host()?, &dq));
    println!("{}: relative error of O {:.1e}, of dQ {:.1e}", ctx.device().name, errors.0, errors.1);
    Ok(())
}

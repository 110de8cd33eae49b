//! A tiny transformer layer trained with candle's autograd, twice from the same seed: once with
//! our kernels (`attn_candle::flash_attn`, forward and backward) and once with attention written
//! in candle's own ops (`attn_candle::plain_attention`). The loss curves should agree to rounding.
//!
//!     cargo run --release --example train                      # CPU tensors: the kernels' emulator (30 steps, ~3 min)
//!     cargo run --release --example train -- --steps 100       # more steps
//!     (GPU: the `cuda` build, see docs/candle.md; there it runs on CUDA, 300 steps by default)
//!
//! The task: predict the token one position back (target t = token t − 1), which one causal
//! attention layer with learned positions solves by attending to the previous position. The loss
//! starts near 4 (random weights) and falls below ln(16) ≈ 2.77, the loss of a uniform guess,
//! towards 0. Exits with an error if the two curves differ by more than 1 % at any printed step.

use attn_candle::{Causal, FlashAttention};
use candle_core::{D, Device, Tensor, Var};

const VOCAB: usize = 16;
const SEQLEN: usize = 24;
const EMBED: usize = 32;
const HEADS: usize = 2;
const HEAD_DIM: usize = EMBED / HEADS;
const BATCH: usize = 16;

/// The layer's weights (all trained).
struct Model {
    tokens: Var,    // [VOCAB, EMBED]
    positions: Var, // [SEQLEN, EMBED]
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,      // [EMBED, EMBED]
    unembed: Var, // [EMBED, VOCAB]
}

impl Model {
    /// Weights drawn from a fixed seed, scaled by 1/√fan_in.
    fn new(device: &Device) -> candle_core::Result<Self> {
        let init = |rows: usize, cols: usize, seed: u64, scale: f64| -> candle_core::Result<Var> {
            let values = attn_host::check::random_normal(rows * cols, seed);
            Var::from_tensor(&(Tensor::from_vec(values, (rows, cols), device)? * scale)?)
        };
        let s = 1.0 / (EMBED as f64).sqrt();
        Ok(Self {
            tokens: init(VOCAB, EMBED, 1, 1.0)?,
            positions: init(SEQLEN, EMBED, 2, 1.0)?,
            wq: init(EMBED, EMBED, 3, s)?,
            wk: init(EMBED, EMBED, 4, s)?,
            wv: init(EMBED, EMBED, 5, s)?,
            wo: init(EMBED, EMBED, 6, s)?,
            unembed: init(EMBED, VOCAB, 7, s)?,
        })
    }

    fn vars(&self) -> [&Var; 7] {
        [&self.tokens, &self.positions, &self.wq, &self.wk, &self.wv, &self.wo, &self.unembed]
    }

    /// Logits `[BATCH, SEQLEN, VOCAB]` for `tokens` `[BATCH, SEQLEN]` (u32).
    fn forward(&self, tokens: &Tensor, flash: bool) -> candle_core::Result<Tensor> {
        let x = self.tokens.as_tensor().embedding(&tokens.flatten_all()?)?.reshape((BATCH, SEQLEN, EMBED))?;
        let x = x.broadcast_add(self.positions.as_tensor())?;
        let project = |w: &Var| x.broadcast_matmul(w.as_tensor())?.reshape((BATCH, SEQLEN, HEADS, HEAD_DIM));
        let (q, k, v) = (project(&self.wq)?, project(&self.wk)?, project(&self.wv)?); // BSHD
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let attended = if flash {
            FlashAttention::new().scale(scale as f32).mask(Causal::TopLeft).forward(&q, &k, &v)?
        } else {
            let bhsd = |t: &Tensor| t.transpose(1, 2)?.contiguous();
            attn_candle::plain_attention(&bhsd(&q)?, &bhsd(&k)?, &bhsd(&v)?, scale, |i, j| j <= i)?.transpose(1, 2)?
        };
        let attended = attended.reshape((BATCH, SEQLEN, EMBED))?.broadcast_matmul(self.wo.as_tensor())?;
        (x + attended)?.broadcast_matmul(self.unembed.as_tensor())
    }
}

/// Mean cross-entropy of the logits at positions 1.. against the previous token.
fn loss(logits: &Tensor, tokens: &[u32], device: &Device) -> candle_core::Result<Tensor> {
    let mut one_hot = vec![0f32; BATCH * (SEQLEN - 1) * VOCAB];
    for b in 0..BATCH {
        for t in 1..SEQLEN {
            one_hot[(b * (SEQLEN - 1) + t - 1) * VOCAB + tokens[b * SEQLEN + t - 1] as usize] = 1.0;
        }
    }
    let one_hot = Tensor::from_vec(one_hot, (BATCH, SEQLEN - 1, VOCAB), device)?;
    let logits = logits.narrow(1, 1, SEQLEN - 1)?;
    let log_probs = logits.broadcast_sub(&logits.log_sum_exp(D::Minus1)?.unsqueeze(D::Minus1)?)?;
    (log_probs * one_hot)?.sum_all()?.neg()? / (BATCH * (SEQLEN - 1)) as f64
}

/// Adam (Kingma & Ba 2015) with its first and second moments per weight.
struct Adam {
    moments: Vec<(Tensor, Tensor)>,
    step: i32,
}

impl Adam {
    const LR: f64 = 1e-2;
    const BETAS: (f64, f64) = (0.9, 0.999);
    const EPS: f64 = 1e-8;

    fn new(vars: &[&Var]) -> candle_core::Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        Ok(Self {
            moments: vars.iter().map(|v| Ok((zeros(v)?, zeros(v)?))).collect::<candle_core::Result<_>>()?,
            step: 0,
        })
    }

    fn update(&mut self, vars: &[&Var], loss: &Tensor) -> candle_core::Result<()> {
        let grads = loss.backward()?;
        self.step += 1;
        let (b1, b2) = Self::BETAS;
        let (c1, c2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
        for (var, (m, v)) in vars.iter().zip(self.moments.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            *m = ((&*m * b1)? + (g * (1.0 - b1))?)?;
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let step = ((&*m / c1)? / ((&*v / c2)?.sqrt()? + Self::EPS)?)?;
            var.set(&(var.as_tensor() - (step * Self::LR)?)?)?;
        }
        Ok(())
    }
}

/// Token batches from a fixed seed (a 64-bit LCG: the same data for both runs).
fn batch(step: usize) -> Vec<u32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ step as u64;
    (0..BATCH * SEQLEN)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % VOCAB as u64) as u32
        })
        .collect()
}

fn train(device: &Device, steps: usize, flash: bool) -> candle_core::Result<Vec<f32>> {
    let model = Model::new(device)?;
    let mut adam = Adam::new(&model.vars())?;
    let mut curve = Vec::new();
    for step in 0..steps {
        let tokens = batch(step);
        let loss =
            loss(&model.forward(&Tensor::from_slice(&tokens, (BATCH, SEQLEN), device)?, flash)?, &tokens, device)?;
        curve.push(loss.to_scalar::<f32>()?);
        adam.update(&model.vars(), &loss)?;
    }
    Ok(curve)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let steps: Option<usize> = match args.iter().position(|a| a == "--steps") {
        Some(i) => Some(args.get(i + 1).ok_or("--steps takes a number")?.parse()?),
        None => None,
    };
    let device = Device::cuda_if_available(0)?;
    // The emulator runs a GPU thread per OS thread: fewer steps there by default.
    let steps = steps.unwrap_or(if device.is_cuda() { 300 } else { 30 });
    println!("device: {device:?} ({} steps, batch {BATCH} × {SEQLEN} tokens, {HEADS} heads of {HEAD_DIM})", steps);
    let ours = train(&device, steps, true)?;
    let plain = train(&device, steps, false)?;
    let mut worst = 0f32;
    println!("step  loss (ours)  loss (candle ops)");
    for step in (0..steps).filter(|s| s % 10 == 0 || s + 1 == steps) {
        let difference = (ours[step] - plain[step]).abs() / plain[step].abs().max(1e-6);
        worst = worst.max(difference);
        println!("{step:>4}  {:>11.4}  {:>17.4}", ours[step], plain[step]);
    }
    println!("largest relative difference of the printed losses: {worst:.2e}");
    if worst > 0.01 {
        return Err(format!("the loss curves differ by {worst:.2e} (> 1 %)").into());
    }
    Ok(())
}

//! The forward pass of a ViT's patch embedding and first attention layer, step by step:
//!
//! ```text
//! pixels [3, S, S] ─patchify→ [196, 768] ─W_pe·+b→ [196, D] ─[cls; ·] + pos→ X [N, D]
//!   ─LayerNorm (norm1)→ ─·W_qkvᵀ + b→ [N, 3D] ─split→ Q, K, V [1, H, N, d_k]  (─cosine→)
//!   ─softmax(Q Kᵀ · scale) V→ O [1, H, N, d_k] ─merge heads→ [N, D] ─·W_projᵀ + b→ Y [N, D]
//! ```
//!
//! (ViT-B/16: S = 224, 196 patches of 16 × 16, D = 768, N = 197, H = 12, d_k = 64.) The matrix
//! products run on a [`Matmul`] (cuBLAS or CPU); attention on one of [`AttentionImpl`]: our
//! FlashAttention kernels (`f32`, `f16`), our naive kernels, or the `f64` CPU reference. The
//! small element-wise steps (patchify, LayerNorm, head split) run on the host in `f64`.

use std::time::Instant;

use super::config::{CHANNELS, VitConfig};
use super::matmul::Matmul;
use super::weights::VitWeights;
use crate::dtype::{Element, from_f32_slice, to_f32_vec};
use crate::error::{Error, Result};
use crate::ops::AttentionOutput;
use crate::timing::time_gpu;
use crate::{AttentionOptions, AttentionShape, Context, DType, TileConfig, cpu};

/// The attention implementations the pipeline can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionImpl {
    /// Our FlashAttention-2 forward kernel in `f32` (CUDA cores).
    FlashF32,
    /// Our FlashAttention-2 forward kernel in `f16` on the tensor cores (Q, K, V rounded to
    /// `f16`; `f32` accumulation).
    FlashF16,
    /// Our naive kernels in `f32` (the N × N score matrix in device memory).
    NaiveF32,
    /// The CPU reference in `f64` ([`cpu::attention`]), rounded to `f32`.
    CpuF64,
}

impl AttentionImpl {
    /// Every implementation, in the order the tables list them.
    pub const ALL: [Self; 4] = [Self::FlashF32, Self::FlashF16, Self::NaiveF32, Self::CpuF64];

    /// A short name for tables: "flash f32", "flash f16", "naive f32", "CPU f64".
    pub fn name(self) -> &'static str {
        match self {
            Self::FlashF32 => "flash f32",
            Self::FlashF16 => "flash f16 (tensor cores)",
            Self::NaiveF32 => "naive f32",
            Self::CpuF64 => "CPU f64 (reference)",
        }
    }

    /// Whether it runs on a [`Context`] (GPU or emulator) rather than the host.
    pub fn needs_context(self) -> bool {
        self != Self::CpuF64
    }
}

/// Which token's attention row to look at: the class token, or a patch of the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Query {
    /// Token 0, the class token.
    ClassToken,
    /// The patch in grid row `row`, column `col` (0-based, from the top left).
    Patch {
        /// Grid row, 0..grid.
        row: usize,
        /// Grid column, 0..grid.
        col: usize,
    },
}

impl Query {
    /// The centre patch of the grid (row and column grid / 2).
    pub fn centre(config: &VitConfig) -> Self {
        Self::Patch { row: config.grid() / 2, col: config.grid() / 2 }
    }

    /// The token index: 0 for the class token, 1 + row · grid + col for a patch.
    ///
    /// # Errors
    /// [`Error::Vit`] for a patch outside the grid.
    pub fn token(self, config: &VitConfig) -> Result<usize> {
        match self {
            Self::ClassToken => Ok(0),
            Self::Patch { row, col } if row < config.grid() && col < config.grid() => {
                Ok(config.token_of_patch(row, col))
            }
            Self::Patch { row, col } => Err(Error::Vit(format!(
                "query patch ({row}, {col}) is outside the {g} × {g} grid (rows and columns 0..{g})",
                g = config.grid()
            ))),
        }
    }

    /// A name for file names: `cls`, or `r7-c7`.
    pub fn file_tag(self) -> String {
        match self {
            Self::ClassToken => "cls".into(),
            Self::Patch { row, col } => format!("r{row}-c{col}"),
        }
    }
}

impl std::fmt::Display for Query {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ClassToken => f.write_str("class token"),
            Self::Patch { row, col } => write!(f, "patch ({row}, {col})"),
        }
    }
}

impl std::str::FromStr for Query {
    type Err = String;

    /// `cls`, or `ROW,COL` (0-based grid coordinates).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.eq_ignore_ascii_case("cls") {
            return Ok(Self::ClassToken);
        }
        let parsed = s.split_once(',').and_then(|(r, c)| Some((r.trim().parse().ok()?, c.trim().parse().ok()?)));
        parsed
            .map(|(row, col)| Self::Patch { row, col })
            .ok_or_else(|| format!("`{s}` is neither `cls` nor ROW,COL (e.g. 7,7)"))
    }
}

/// A label for token `token` in tables: `cls`, or `(row, col)` of its patch.
pub fn token_label(config: &VitConfig, token: usize) -> String {
    match token {
        0 => "cls".into(),
        t => format!("({}, {})", (t - 1) / config.grid(), (t - 1) % config.grid()),
    }
}

/// Q, K and V split into heads, `[1, H, N, d_k]` each (batch 1), `f32`.
#[derive(Clone, Debug)]
pub struct Qkv {
    /// Q, `[1, H, N, d_k]`.
    pub q: Vec<f32>,
    /// K, `[1, H, N, d_k]`.
    pub k: Vec<f32>,
    /// V, `[1, H, N, d_k]`.
    pub v: Vec<f32>,
    /// The attention problem: batch 1, H heads, N tokens, head_dim d_k, no mask.
    pub shape: AttentionShape,
}

/// An attention result on the host: O `[1, H, N, d_k]` and the natural-log logsumexp `[1, H, N]`.
#[derive(Clone, Debug)]
pub struct AttentionRows {
    /// O, `[1, H, N, d_k]`, `f32` (the `f16` kernel's output widened exactly).
    pub o: Vec<f32>,
    /// LSE_i = ln Σ_j exp(scale · q_i·k_j), `[1, H, N]`.
    pub lse: Vec<f32>,
    /// Time of the attention alone, in ms: the kernels' median over the timed repeats (CUDA
    /// events; host clock on the emulator), or one run's wall time for the CPU.
    pub ms: f64,
}

/// Every intermediate of one forward pass.
#[derive(Clone, Debug)]
pub struct Forward {
    /// X = [cls; patch embeddings] + pos, `[N, D]`.
    pub tokens: Vec<f32>,
    /// LayerNorm(X) with norm1's γ and β, `[N, D]`.
    pub normed: Vec<f32>,
    /// Q, K, V in heads (q and k rescaled to length √d_k when the weights ask for cosine attention).
    pub qkv: Qkv,
    /// The attention's O and LSE.
    pub attention: AttentionRows,
    /// Y = merge_heads(O) W_projᵀ + b_proj, `[N, D]`: the attention sublayer's output.
    pub output: Vec<f32>,
    /// X + Y, `[N, D]`: the residual stream after the first attention sublayer.
    pub residual: Vec<f32>,
}

/// Timing of the kernels: `warmup` untimed runs, then the median of `repeats`.
#[derive(Clone, Copy, Debug)]
pub struct Repeats {
    /// Untimed runs first.
    pub warmup: usize,
    /// Timed runs (at least 1).
    pub repeats: usize,
}

impl Repeats {
    /// One timed run and no warm-up: for tests and the emulator.
    pub const ONCE: Self = Self { warmup: 0, repeats: 1 };
}

/// The patches of a `[3, S, S]` image as rows, `[num_patches, 3·P·P]`, patches in row-major
/// grid order, each flattened (channel, row, column): the order in which a `[D, 3, P, P]`
/// convolution weight, read as `[D, 3·P·P]`, multiplies them.
///
/// # Errors
/// [`Error::Length`] when `pixels` is not `[3, S, S]` for the config's S.
pub fn patchify(pixels: &[f32], config: &VitConfig) -> Result<Vec<f32>> {
    let (s, p, g) = (config.image_size, config.patch_size, config.grid());
    if pixels.len() != CHANNELS * s * s {
        return Err(Error::Length { expected: CHANNELS * s * s, got: pixels.len() });
    }
    let mut out = Vec::with_capacity(config.num_patches() * config.patch_dim());
    for (gy, gx) in (0..g).flat_map(|gy| (0..g).map(move |gx| (gy, gx))) {
        for c in 0..CHANNELS {
            for y in 0..p {
                let start = c * s * s + (gy * p + y) * s + gx * p;
                out.extend_from_slice(&pixels[start..start + p]);
            }
        }
    }
    Ok(out)
}

/// X = [cls; patches · W_peᵀ + b_pe] + pos, `[N, D]`.
///
/// # Errors
/// As [`patchify`] and [`Matmul::linear`].
pub fn embed(config: &VitConfig, weights: &VitWeights, pixels: &[f32], matmul: &Matmul) -> Result<Vec<f32>> {
    let d = config.dim;
    let patches = patchify(pixels, config)?;
    let embedded = matmul.linear(
        &patches,
        &weights.patch_embed_weight,
        &weights.patch_embed_bias,
        config.num_patches(),
        config.patch_dim(),
        d,
    )?;
    let mut tokens = Vec::with_capacity(config.seqlen() * d);
    tokens.extend_from_slice(&weights.cls_token);
    tokens.extend_from_slice(&embedded);
    for (x, pos) in tokens.iter_mut().zip(&weights.pos_embed) {
        *x += pos;
    }
    Ok(tokens)
}

/// LayerNorm over each row of `dim` values (Ba et al. 2016): (x − mean) / √(var + eps), then
/// · γ + β when `affine` is given; mean and (biased) variance in `f64`.
pub fn layer_norm(x: &[f32], dim: usize, eps: f32, affine: Option<(&[f32], &[f32])>) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim.max(1)) {
        let n = row.len() as f64;
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps as f64).sqrt();
        out.extend(row.iter().enumerate().map(|(i, &v)| {
            let normed = (v as f64 - mean) * inv;
            match affine {
                Some((gamma, beta)) => (normed * gamma[i] as f64 + beta[i] as f64) as f32,
                None => normed as f32,
            }
        }));
    }
    out
}

/// `[Q K V] = normed · W_qkvᵀ + b_qkv`, split as timm does (`qkv.reshape(N, 3, H, d_k)`, then
/// heads first) into three `[1, H, N, d_k]` tensors; with [`VitWeights::cosine_attention`] each
/// head's q and k vectors are rescaled to length √d_k (a zero vector stays zero).
///
/// # Errors
/// As [`Matmul::linear`].
pub fn qkv(config: &VitConfig, weights: &VitWeights, normed: &[f32], matmul: &Matmul) -> Result<Qkv> {
    let (n, d, h, dk) = (config.seqlen(), config.dim, config.num_heads, config.head_dim());
    let fused = matmul.linear(normed, &weights.qkv_weight, &weights.qkv_bias, n, d, 3 * d)?;
    let split = |which: usize| -> Vec<f32> {
        let mut out = vec![0.0; h * n * dk];
        for (head, token) in (0..h).flat_map(|head| (0..n).map(move |token| (head, token))) {
            let from = token * 3 * d + which * d + head * dk;
            out[(head * n + token) * dk..][..dk].copy_from_slice(&fused[from..from + dk]);
        }
        out
    };
    let (mut q, mut k, v) = (split(0), split(1), split(2));
    if weights.cosine_attention {
        let length = (dk as f64).sqrt();
        q = rescale_rows(&q, dk, length);
        k = rescale_rows(&k, dk, length);
    }
    let shape = AttentionShape { batch: 1, num_heads_q: h, num_heads_kv: h, seqlen_q: n, seqlen_k: n, head_dim: dk };
    Ok(Qkv { q, k, v, shape })
}

/// Every row of `dim` values rescaled to Euclidean length `length` (rows of zeros stay zero);
/// norms in `f64`.
pub fn rescale_rows(x: &[f32], dim: usize, length: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim.max(1)) {
        let norm = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let factor = if norm > 0.0 { length / norm } else { 0.0 };
        out.extend(row.iter().map(|&v| (v as f64 * factor) as f32));
    }
    out
}

/// Runs attention O = softmax(Q Kᵀ · scale) V with `which` (scale `None`: 1/√d_k). The kernels
/// write into outputs poisoned with NaN first, so an element they miss shows; they are timed
/// as `repeats` says, writing into the same outputs.
///
/// # Errors
/// [`Error::Vit`] when a kernel is asked for without a context; the kernels' errors (e.g.
/// [`Error::HeadDimNotCompiled`] for a head_dim without flash kernels).
pub fn attention(
    which: AttentionImpl,
    ctx: Option<&Context>,
    qkv: &Qkv,
    scale: Option<f32>,
    repeats: Repeats,
) -> Result<AttentionRows> {
    let options = AttentionOptions { scale, ..AttentionOptions::default() };
    let ctx = match (which, ctx) {
        (AttentionImpl::CpuF64, _) => return cpu_attention(qkv, &options),
        (_, Some(ctx)) => ctx,
        (_, None) => return Err(Error::Vit(format!("{} needs a GPU or the CPU emulator", which.name()))),
    };
    match which {
        AttentionImpl::FlashF32 => flash_attention::<f32>(ctx, qkv, &options, repeats),
        AttentionImpl::FlashF16 => flash_attention::<half::f16>(ctx, qkv, &options, repeats),
        AttentionImpl::NaiveF32 => naive_attention(ctx, qkv, &options, repeats),
        AttentionImpl::CpuF64 => cpu_attention(qkv, &options),
    }
}

fn cpu_attention(qkv: &Qkv, options: &AttentionOptions) -> Result<AttentionRows> {
    let start = Instant::now();
    let params = cpu::Params {
        scale: options.checked_scale(qkv.shape.head_dim)? as f64,
        causal: options.causal,
        window: options.window,
        score: Default::default(),
        sinks: None,
        mask_table: None,
        bias: None,
    };
    let reference = cpu::attention(&qkv.q, &qkv.k, &qkv.v, &qkv.shape, params)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect();
    Ok(AttentionRows { o: narrow(&reference.o), lse: narrow(&reference.lse), ms })
}

/// Q, K, V uploaded as `T`, and O, LSE outputs poisoned with NaN.
fn upload_poisoned<T: Element>(ctx: &Context, qkv: &Qkv) -> Result<([crate::DeviceTensor<T>; 3], AttentionOutput<T>)> {
    let shape = qkv.shape.q_shape();
    let up = |x: &[f32]| ctx.upload(&from_f32_slice::<T>(x), &shape);
    let inputs = [up(&qkv.q)?, up(&qkv.k)?, up(&qkv.v)?];
    let out = AttentionOutput {
        o: ctx.full(&shape, T::from_f32(f32::NAN))?,
        lse: ctx.full(&qkv.shape.lse_shape(), f32::NAN)?,
    };
    Ok((inputs, out))
}

fn flash_attention<T: Element>(
    ctx: &Context,
    qkv: &Qkv,
    options: &AttentionOptions,
    repeats: Repeats,
) -> Result<AttentionRows> {
    let tile = ctx.default_tile(T::DTYPE, qkv.shape.head_dim);
    // Checked before uploading anything, so a head_dim without kernels costs nothing.
    tile.validate_kernel(crate::FlashKernel::Forward, T::DTYPE, qkv.shape.head_dim, ctx.device())?;
    let ([q, k, v], mut out) = upload_poisoned::<T>(ctx, qkv)?;
    ctx.flash_attention_forward_into(&q, &k, &v, &mut out, options, tile)?;
    let (o, lse) = (to_f32_vec(&out.o.to_host()?), out.lse.to_host()?);
    let timing = time_gpu(ctx, repeats.warmup, repeats.repeats, || {
        ctx.flash_attention_forward_into(&q, &k, &v, &mut out, options, tile)
    })?;
    Ok(AttentionRows { o, lse, ms: timing.median_ms })
}

fn naive_attention(ctx: &Context, qkv: &Qkv, options: &AttentionOptions, repeats: Repeats) -> Result<AttentionRows> {
    let ([q, k, v], mut out) = upload_poisoned::<f32>(ctx, qkv)?;
    ctx.attention_naive_into(&q, &k, &v, &mut out, options)?;
    let (o, lse) = (out.o.to_host()?, out.lse.to_host()?);
    let timing =
        time_gpu(ctx, repeats.warmup, repeats.repeats, || ctx.attention_naive_into(&q, &k, &v, &mut out, options))?;
    Ok(AttentionRows { o, lse, ms: timing.median_ms })
}

/// O `[1, H, N, d_k]` back to tokens, `[N, D]` with head h in columns h·d_k..(h+1)·d_k
/// (PyTorch's `o.transpose(1, 2).reshape(N, D)`).
pub fn merge_heads(o: &[f32], config: &VitConfig) -> Vec<f32> {
    let (n, d, dk) = (config.seqlen(), config.dim, config.head_dim());
    let mut out = vec![0.0; n * d];
    for (head, token) in (0..config.num_heads).flat_map(|head| (0..n).map(move |token| (head, token))) {
        out[token * d + head * dk..][..dk].copy_from_slice(&o[(head * n + token) * dk..][..dk]);
    }
    out
}

/// Y = merge_heads(O) · W_projᵀ + b_proj, `[N, D]`.
///
/// # Errors
/// [`Error::Length`] when O is not `[1, H, N, d_k]`; as [`Matmul::linear`].
pub fn project(config: &VitConfig, weights: &VitWeights, o: &[f32], matmul: &Matmul) -> Result<Vec<f32>> {
    let (n, d) = (config.seqlen(), config.dim);
    if o.len() != n * d {
        return Err(Error::Length { expected: n * d, got: o.len() });
    }
    matmul.linear(&merge_heads(o, config), &weights.proj_weight, &weights.proj_bias, n, d, d)
}

/// The whole forward pass of [`super::pipeline`] for one image (`pixels` `[3, S, S]`,
/// normalised), with the matrix products on `matmul` and attention by `which` (on `ctx` for the
/// kernels).
///
/// # Errors
/// [`Error::Vit`] for an invalid config or weights that do not fit it; the steps' errors.
pub fn forward(
    config: &VitConfig,
    weights: &VitWeights,
    pixels: &[f32],
    matmul: &Matmul,
    ctx: Option<&Context>,
    which: AttentionImpl,
    scale: Option<f32>,
) -> Result<Forward> {
    config.validate()?;
    weights.validate(config)?;
    let tokens = embed(config, weights, pixels, matmul)?;
    let normed =
        layer_norm(&tokens, config.dim, config.layer_norm_eps, Some((&weights.norm1_weight, &weights.norm1_bias)));
    let qkv = qkv(config, weights, &normed, matmul)?;
    let attention = attention(which, ctx, &qkv, scale, Repeats::ONCE)?;
    let output = project(config, weights, &attention.o, matmul)?;
    let residual = tokens.iter().zip(&output).map(|(x, y)| x + y).collect();
    Ok(Forward { tokens, normed, qkv, attention, output, residual })
}

/// The attention weights of token `query` in every head, `[H][N]`: P_qj = exp(scale · q·k_j −
/// LSE_q), computed from Q, K and the logsumexp a kernel returned (as FlashAttention's backward
/// pass recomputes P), each row summing to 1. Scale `None`: 1/√d_k.
///
/// # Errors
/// [`Error::Vit`] for a query outside 0..N; [`Error::Length`] when `lse` is not `[1, H, N]`;
/// [`Error::InvalidScale`].
pub fn attention_weights(qkv: &Qkv, lse: &[f32], query: usize, scale: Option<f32>) -> Result<Vec<Vec<f64>>> {
    let s = qkv.shape;
    if query >= s.seqlen_q {
        return Err(Error::Vit(format!("query token {query} is outside 0..{}", s.seqlen_q)));
    }
    if lse.len() != s.query_rows() {
        return Err(Error::Length { expected: s.query_rows(), got: lse.len() });
    }
    let scale = AttentionOptions { scale, ..AttentionOptions::default() }.checked_scale(s.head_dim)? as f64;
    let d = s.head_dim;
    Ok((0..s.num_heads_q)
        .map(|h| {
            let head = h * s.seqlen_q * d;
            let q = &qkv.q[head + query * d..][..d];
            let lse = lse[h * s.seqlen_q + query] as f64;
            qkv.k[head..head + s.seqlen_k * d]
                .chunks_exact(d)
                .map(|k| {
                    let dot: f64 = q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                    (scale * dot - lse).exp()
                })
                .collect()
        })
        .collect())
}

/// Entropy of a probability row in nats, −Σ p ln p (0 for a one-hot row, ln N for a uniform one).
pub fn entropy(p: &[f64]) -> f64 {
    -p.iter().filter(|&&x| x > 0.0).map(|&x| x * x.ln()).sum::<f64>()
}

/// The `k` largest entries of `p` as (index, value), largest first (ties: lower index first).
pub fn top_k(p: &[f64], k: usize) -> Vec<(usize, f64)> {
    let mut indexed: Vec<(usize, f64)> = p.iter().copied().enumerate().collect();
    indexed.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    indexed.truncate(k);
    indexed
}

/// Whether the flash forward of `dtype` runs `head_dim` (1 to 256: compiled or padded to the next
/// compiled one; the naive kernels take any).
pub fn flash_compiled(dtype: DType, head_dim: usize) -> bool {
    TileConfig::padded_head_dim(crate::FlashKernel::Forward, dtype, head_dim).is_ok()
}

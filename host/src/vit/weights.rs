//! The parameters of the patch embedding and of the first block's attention, in timm's names and
//! layouts: made up (seeded random, or the `similarity` initialisation) or loaded from a
//! safetensors checkpoint.

use std::path::Path;

use super::config::{CHANNELS, VitConfig};
use crate::check::random_normal;
use crate::error::{Error, Result};
use crate::io;

/// How to make up weights when no checkpoint is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// See [`VitWeights::similarity`]: attention by appearance, no training needed.
    Similarity,
    /// See [`VitWeights::random`]: an untrained network (near-uniform attention).
    Random {
        /// Seed of the generator; the same seed gives the same weights everywhere.
        seed: u64,
    },
}

/// The parameters the first block's attention needs, as `f32`, row-major, in the layouts of
/// timm's `VisionTransformer` (D = [`VitConfig::dim`], P = patch size, N = tokens).
///
/// The forward pass they define ([`super::pipeline`]): patch embedding `x_p = W_pe · patch +
/// b_pe`, tokens `X = [cls; x_1 … x_196] + pos`, `LN(X)` with `norm1`, `[Q K V] = LN(X) W_qkvᵀ +
/// b_qkv` split into heads, attention, `Y = O W_projᵀ + b_proj`.
#[derive(Clone, Debug, PartialEq)]
pub struct VitWeights {
    /// `patch_embed.proj.weight`, `[D, 3, P, P]`: the patch embedding, a convolution with
    /// stride P, i.e. a `[D, 3·P·P]` matrix applied to each flattened patch.
    pub patch_embed_weight: Vec<f32>,
    /// `patch_embed.proj.bias`, `[D]`.
    pub patch_embed_bias: Vec<f32>,
    /// `cls_token`, `[D]` (`[1, 1, D]` in the file): the class token's embedding.
    pub cls_token: Vec<f32>,
    /// `pos_embed`, `[N, D]` (`[1, N, D]` in the file): position embeddings, row 0 the class
    /// token's.
    pub pos_embed: Vec<f32>,
    /// `blocks.0.norm1.weight`, `[D]`: the LayerNorm's scale γ.
    pub norm1_weight: Vec<f32>,
    /// `blocks.0.norm1.bias`, `[D]`: the LayerNorm's shift β.
    pub norm1_bias: Vec<f32>,
    /// `blocks.0.attn.qkv.weight`, `[3·D, D]`: W_Q, W_K, W_V stacked (rows 0..D give Q, D..2D K,
    /// 2D..3D V; within each, head h owns rows h·head_dim..(h+1)·head_dim).
    pub qkv_weight: Vec<f32>,
    /// `blocks.0.attn.qkv.bias`, `[3·D]`.
    pub qkv_bias: Vec<f32>,
    /// `blocks.0.attn.proj.weight`, `[D, D]`: the output projection W_O.
    pub proj_weight: Vec<f32>,
    /// `blocks.0.attn.proj.bias`, `[D]`.
    pub proj_bias: Vec<f32>,
    /// Cosine attention (as in Swin Transformer V2, Liu et al. 2022): each head's q and k
    /// vectors are rescaled to length √d_k before the scores, so that q·k = d_k · cos(q, k), at
    /// most d_k, reached by a token with itself. Set by [`VitWeights::similarity`]; off for
    /// random and loaded weights (a plain ViT-B/16).
    pub cosine_attention: bool,
}

/// The tensors a checkpoint must hold, in timm's names, with the shapes `config` needs.
pub fn timm_tensors(config: &VitConfig) -> [(&'static str, Vec<usize>); 10] {
    let (d, p, n) = (config.dim, config.patch_size, config.seqlen());
    [
        ("patch_embed.proj.weight", vec![d, CHANNELS, p, p]),
        ("patch_embed.proj.bias", vec![d]),
        ("cls_token", vec![1, 1, d]),
        ("pos_embed", vec![1, n, d]),
        ("blocks.0.norm1.weight", vec![d]),
        ("blocks.0.norm1.bias", vec![d]),
        ("blocks.0.attn.qkv.weight", vec![3 * d, d]),
        ("blocks.0.attn.qkv.bias", vec![3 * d]),
        ("blocks.0.attn.proj.weight", vec![d, d]),
        ("blocks.0.attn.proj.bias", vec![d]),
    ]
}

/// Standard deviation of [`VitWeights::random`]'s weights (timm's initialisation).
pub const RANDOM_STD: f32 = 0.02;

impl VitWeights {
    /// [`VitWeights::similarity`] or [`VitWeights::random`].
    ///
    /// # Errors
    /// As [`VitWeights::similarity`].
    pub fn init(init: Init, config: &VitConfig) -> Result<Self> {
        match init {
            Init::Similarity => Self::similarity(config),
            Init::Random { seed } => Ok(Self::random(config, seed)),
        }
    }

    /// Seeded random weights, as an untrained timm ViT: patch embedding, class token, position
    /// embeddings, W_qkv and W_proj normal with std [`RANDOM_STD`] = 0.02; biases 0; LayerNorm
    /// γ = 1, β = 0. The attention of such a network is close to uniform.
    pub fn random(config: &VitConfig, seed: u64) -> Self {
        let (d, n) = (config.dim, config.seqlen());
        let normal = |len: usize, stream: u64| -> Vec<f32> {
            random_normal(len, seed.wrapping_mul(16).wrapping_add(stream)).iter().map(|x| x * RANDOM_STD).collect()
        };
        Self {
            patch_embed_weight: normal(d * config.patch_dim(), 1),
            patch_embed_bias: vec![0.0; d],
            cls_token: normal(d, 2),
            pos_embed: normal(n * d, 3),
            norm1_weight: vec![1.0; d],
            norm1_bias: vec![0.0; d],
            qkv_weight: normal(3 * d * d, 4),
            qkv_bias: vec![0.0; 3 * d],
            proj_weight: normal(d * d, 5),
            proj_bias: vec![0.0; d],
            cosine_attention: false,
        }
    }

    /// Weights with which attention finds patches that look alike, with no training:
    ///
    /// * the patch embedding is the orthonormal 2-D DCT-II of each colour channel
    ///   ([`dct_patch_embedding`]): a rotation of the 3·P² normalised pixel values (so D must
    ///   equal 3·P², 768 for 16 × 16 patches), which keeps every distance and angle between
    ///   patches, with the features ordered from low to high spatial frequency. Head h sees the
    ///   h-th band of 64: in ViT-B/16 head 0 the colour balance and coarse shading of the
    ///   patch, the next heads its broad edges and gradients, the last ones fine texture;
    /// * class token and position embeddings are 0: only appearance counts, not position (the
    ///   class token, all zeros, has nothing to compare and attends uniformly);
    /// * W_Q = W_K = W_V = W_proj = identity, biases 0;
    /// * [`VitWeights::cosine_attention`] is on: each head's q and k are rescaled to length
    ///   √d_k, so the score of patches i and j is scale · d_k · cos(x_i, x_j), the cosine
    ///   similarity of their frequency bands (after the token's LayerNorm, which removes the
    ///   patch's overall brightness and contrast but keeps its colour balance and pattern). A patch matches itself best (cosine 1; by the Cauchy–Schwarz inequality
    ///   nothing scores higher), and with the default scale 1/√d_k the logits span ±√d_k (±8
    ///   at d_k = 64): a temperature at which patches of similar colour and texture get a
    ///   visible share and unrelated ones next to none (`--scale` changes it).
    ///
    /// # Errors
    /// [`Error::Vit`] when D ≠ 3·P².
    pub fn similarity(config: &VitConfig) -> Result<Self> {
        let d = config.dim;
        if d != config.patch_dim() {
            return Err(Error::Vit(format!(
                "the similarity initialisation maps a patch's 3·{p}·{p} = {} pixel values one to one onto \
                 the D features, so it needs D = {}; this model has D = {d} (use --init random or --weights)",
                config.patch_dim(),
                config.patch_dim(),
                p = config.patch_size,
            )));
        }
        let identity = |n: usize| -> Vec<f32> {
            let mut m = vec![0.0; n * n];
            m.iter_mut().step_by(n + 1).for_each(|x| *x = 1.0);
            m
        };
        Ok(Self {
            patch_embed_weight: dct_patch_embedding(config.patch_size),
            patch_embed_bias: vec![0.0; d],
            cls_token: vec![0.0; d],
            pos_embed: vec![0.0; config.seqlen() * d],
            norm1_weight: vec![1.0; d],
            norm1_bias: vec![0.0; d],
            qkv_weight: [identity(d), identity(d), identity(d)].concat(),
            qkv_bias: vec![0.0; 3 * d],
            proj_weight: identity(d),
            proj_bias: vec![0.0; d],
            cosine_attention: true,
        })
    }

    /// Loads the weights from a safetensors file in timm's names and shapes ([`timm_tensors`]),
    /// e.g. the `model.safetensors` of timm's `vit_base_patch16_224` for [`VitConfig::vit_b16`].
    /// Other tensors in the file (later blocks, the head) are ignored. Elements may be `F32`,
    /// `F16` or `BF16` ([`crate::io`]); they are widened to `f32`.
    ///
    /// # Errors
    /// [`Error::TensorFile`] naming the file and the first tensor at fault: the file cannot be
    /// read or is not safetensors, a tensor is missing, has another element type or another
    /// shape than `config` needs.
    pub fn load_safetensors(path: &Path, config: &VitConfig) -> Result<Self> {
        let wanted = timm_tensors(config);
        let names = wanted.each_ref().map(|(name, _)| *name);
        let tensors = io::read_safetensors_tensors(path, &names)?;
        let mut values = wanted.iter().zip(tensors).map(|((name, shape), tensor)| {
            if tensor.shape() != shape.as_slice() {
                return Err(Error::TensorFile {
                    path: path.display().to_string(),
                    tensor: Some(name.to_string()),
                    reason: format!("has shape {:?}; the model needs {shape:?}", tensor.shape()),
                });
            }
            Ok(tensor.to_f32())
        });
        // In timm_tensors' order.
        let mut next = || values.next().expect("one tensor per name");
        Ok(Self {
            patch_embed_weight: next()?,
            patch_embed_bias: next()?,
            cls_token: next()?,
            pos_embed: next()?,
            norm1_weight: next()?,
            norm1_bias: next()?,
            qkv_weight: next()?,
            qkv_bias: next()?,
            proj_weight: next()?,
            proj_bias: next()?,
            cosine_attention: false,
        })
    }

    /// Checks every tensor's length against `config` (weights built by hand may be wrong).
    ///
    /// # Errors
    /// [`Error::Vit`] naming the first tensor of the wrong length.
    pub fn validate(&self, config: &VitConfig) -> Result<()> {
        let tensors = timm_tensors(config);
        let (d, n) = (config.dim, config.seqlen());
        let ours: [(&[f32], usize); 10] = [
            (&self.patch_embed_weight, d * config.patch_dim()),
            (&self.patch_embed_bias, d),
            (&self.cls_token, d),
            (&self.pos_embed, n * d),
            (&self.norm1_weight, d),
            (&self.norm1_bias, d),
            (&self.qkv_weight, 3 * d * d),
            (&self.qkv_bias, 3 * d),
            (&self.proj_weight, d * d),
            (&self.proj_bias, d),
        ];
        for ((name, shape), (values, len)) in tensors.iter().zip(ours) {
            if values.len() != len {
                return Err(Error::Vit(format!(
                    "weight `{name}` holds {} values; shape {shape:?} needs {len}",
                    values.len()
                )));
            }
        }
        Ok(())
    }
}

/// The patch embedding of [`VitWeights::similarity`]: the orthonormal 2-D DCT-II (Ahmed, Natarajan
/// and Rao 1974) of each colour channel of a P × P patch, as a `[3·P², 3, P, P]` convolution
/// weight. Feature f is the coefficient of channel c at frequency (u, v),
///
/// ```text
/// W[f, c, y, x] = α(u) α(v) cos(π (2y + 1) u / 2P) cos(π (2x + 1) v / 2P),
/// α(0) = √(1/P), α(u > 0) = √(2/P),
/// ```
///
/// with the features sorted by u + v, then u, then channel: the lowest frequencies of all three
/// channels first (f = 0, 1, 2 are the channels' means, up to the factor P). The matrix is
/// orthogonal: dot products between patches are kept.
pub fn dct_patch_embedding(patch_size: usize) -> Vec<f32> {
    let p = patch_size;
    let basis = |u: usize, y: usize| {
        let alpha = if u == 0 { (1.0 / p as f64).sqrt() } else { (2.0 / p as f64).sqrt() };
        alpha * (std::f64::consts::PI * (2 * y + 1) as f64 * u as f64 / (2 * p) as f64).cos()
    };
    let mut features: Vec<(usize, usize, usize)> =
        (0..p).flat_map(|u| (0..p).flat_map(move |v| (0..CHANNELS).map(move |c| (u, v, c)))).collect();
    features.sort_by_key(|&(u, v, c)| (u + v, u, c));
    let plane = p * p;
    let mut w = vec![0.0f32; features.len() * CHANNELS * plane];
    for (f, &(u, v, c)) in features.iter().enumerate() {
        let row = &mut w[f * CHANNELS * plane + c * plane..][..plane];
        for (y, x) in (0..p).flat_map(|y| (0..p).map(move |x| (y, x))) {
            row[y * p + x] = (basis(u, y) * basis(v, x)) as f32;
        }
    }
    w
}

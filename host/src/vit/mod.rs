//! # Self-attention of a Vision Transformer on a real photo
//!
//! The classic walk-through of self-attention, runnable: a ViT-B/16 (Dosovitskiy et al., "An
//! Image is Worth 16x16 Words", ICLR 2021) cuts a 224 × 224 image into 14 × 14 = 196 patches of
//! 16 × 16 pixels, projects each to D = 768 features, puts a class token in front (N = 197
//! tokens) and adds position embeddings: X ∈ R^(N×D). After a LayerNorm, Q = XW_Q, K = XW_K,
//! V = XW_V are split into 12 heads of d_k = 64 and each head computes softmax(QKᵀ/√d_k)V, here
//! with this crate's own attention kernels; an output projection mixes the heads again.
//!
//! | step | module |
//! |---|---|
//! | photo → `[3, 224, 224]` normalised pixels | [`preprocess`] |
//! | sizes (ViT-B/16, a tiny test model) | [`config`] |
//! | parameters: seeded random, the `similarity` initialisation, or a timm checkpoint (safetensors) | [`weights`] |
//! | matrix products: cuBLAS or rayon | [`matmul`] |
//! | cuBLAS, found and loaded at run time (any CUDA version, the usual places) | `cublas` |
//! | patches → tokens → LayerNorm → Q, K, V → attention → output projection | [`pipeline`] |
//! | attention weights of one query as heat maps over the photo, one per head | [`render`] |
//!
//! ```no_run
//! use attn_host::vit::{self, AttentionImpl, Matmul, Query, VitConfig, VitWeights};
//!
//! # fn main() -> attn_host::Result<()> {
//! let config = VitConfig::vit_b16();
//! let photo = vit::preprocess::decode_image(vit::preprocess::DEFAULT_PHOTO, "chelsea.jpg")?;
//! let input = vit::preprocess::preprocess(&photo, config.image_size, vit::Normalization::IMAGENET)?;
//! let weights = VitWeights::similarity(&config)?;
//! let ctx = attn_host::Context::new(0)?;
//! let matmul = Matmul::cublas(&ctx)?;
//! let fwd = vit::pipeline::forward(&config, &weights, &input.pixels, &matmul, Some(&ctx), AttentionImpl::FlashF32, None)?;
//! let query = Query::Patch { row: 7, col: 7 }.token(&config)?;
//! let maps = vit::pipeline::attention_weights(&fwd.qkv, &fwd.attention.lse, query, None)?; // [12][197]
//! # Ok(()) }
//! ```
//!
//! The command line: `cargo run --release -- vit --help`.

pub mod config;
mod cublas;
pub mod matmul;
pub mod pipeline;
pub mod preprocess;
pub mod render;
pub mod weights;

pub use config::{Normalization, VitConfig};
pub use matmul::{Matmul, MatmulBackend};
pub use pipeline::{AttentionImpl, Query};
pub use weights::{Init, VitWeights};

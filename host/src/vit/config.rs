//! The sizes of a vision transformer's first block, and the pixel normalisation.

use crate::error::{Error, Result};

/// Colour channels of the input (RGB).
pub const CHANNELS: usize = 3;

/// The sizes of the model: a square image cut into square patches, each patch projected to
/// `dim` features; one class token in front; `num_heads` attention heads of `dim / num_heads`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VitConfig {
    /// Side of the (square) input image, in pixels.
    pub image_size: usize,
    /// Side of a patch, in pixels.
    pub patch_size: usize,
    /// D: features per token (the embedding width).
    pub dim: usize,
    /// Attention heads; each sees `dim / num_heads` features (head_dim, d_k).
    pub num_heads: usize,
    /// ε of the LayerNorms (timm's ViTs use 1e-6).
    pub layer_norm_eps: f32,
}

impl VitConfig {
    /// ViT-B/16 at 224×224 (Dosovitskiy et al. 2021): 14 × 14 = 196 patches of 16 × 16 pixels,
    /// D = 768, 12 heads of head_dim 64; with the class token N = 197 tokens.
    pub const fn vit_b16() -> Self {
        Self { image_size: 224, patch_size: 16, dim: 768, num_heads: 12, layer_norm_eps: 1e-6 }
    }

    /// A tiny model for tests: a 32 × 32 image in 4 × 4 = 16 patches of 8 × 8 pixels, D = 192
    /// (= 3 · 8 · 8, so that the `similarity` initialisation works), 3 heads of head_dim 64 (a
    /// head_dim every flash kernel, `f32` and 16-bit, is compiled for); N = 17 tokens.
    pub const fn tiny() -> Self {
        Self { image_size: 32, patch_size: 8, dim: 192, num_heads: 3, layer_norm_eps: 1e-6 }
    }

    /// Patches per side of the image (14 for ViT-B/16).
    pub const fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Patches in the image, grid² (196 for ViT-B/16).
    pub const fn num_patches(&self) -> usize {
        self.grid() * self.grid()
    }

    /// N: tokens, the patches and the class token (197 for ViT-B/16).
    pub const fn seqlen(&self) -> usize {
        self.num_patches() + 1
    }

    /// head_dim (d_k): features per head, D / heads (64 for ViT-B/16).
    pub const fn head_dim(&self) -> usize {
        self.dim / self.num_heads
    }

    /// Values in one flattened patch, 3 · patch² (768 for ViT-B/16), in (channel, row, column)
    /// order: the order of a `[D, 3, patch, patch]` convolution weight's last three axes.
    pub const fn patch_dim(&self) -> usize {
        CHANNELS * self.patch_size * self.patch_size
    }

    /// The token index of patch (`row`, `col`) of the grid: 1 + row · grid + col (token 0 is the
    /// class token).
    pub const fn token_of_patch(&self, row: usize, col: usize) -> usize {
        1 + row * self.grid() + col
    }

    /// Checks that the sizes fit together.
    ///
    /// # Errors
    /// [`Error::Vit`] when a size is 0, the patch size does not divide the image size, or the
    /// head count does not divide D.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.image_size == 0 || c.patch_size == 0 || c.dim == 0 || c.num_heads == 0 {
            return Err(Error::Vit(format!("every size must be at least 1; got {c:?}")));
        }
        if !c.image_size.is_multiple_of(c.patch_size) {
            return Err(Error::Vit(format!(
                "the patch size {} does not divide the image size {}",
                c.patch_size, c.image_size
            )));
        }
        if !c.dim.is_multiple_of(c.num_heads) {
            return Err(Error::Vit(format!("{} heads do not divide D = {}", c.num_heads, c.dim)));
        }
        if !c.layer_norm_eps.is_finite() || c.layer_norm_eps < 0.0 {
            return Err(Error::Vit(format!("the LayerNorm ε must be finite and ≥ 0; got {}", c.layer_norm_eps)));
        }
        Ok(())
    }
}

/// Per-channel normalisation of pixel values in [0, 1]: x' = (x − mean) / std, channels R, G, B.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    /// Mean per channel (R, G, B).
    pub mean: [f32; 3],
    /// Standard deviation per channel (R, G, B).
    pub std: [f32; 3],
}

impl Normalization {
    /// The ImageNet statistics used by most image models (torchvision, timm's default):
    /// mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225).
    pub const IMAGENET: Self = Self { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] };

    /// mean 0.5, std 0.5 for every channel (pixels to [−1, 1]): what the original ViT
    /// checkpoints and timm's `augreg` ViT-B/16 weights were trained with.
    pub const HALF: Self = Self { mean: [0.5; 3], std: [0.5; 3] };
}

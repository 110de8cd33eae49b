//! From a photo to the model's input: decode (PNG or JPEG), resize the shorter side to the model's
//! image size, crop the centre square, scale to [0, 1] and normalise per channel.

use std::path::Path;

use image::RgbImage;
use image::imageops::{self, FilterType};

use super::config::{CHANNELS, Normalization};
use crate::error::{Error, Result};

/// The photo used when none is given: Chelsea the cat, 451 × 300 pixels, from scikit-image's
/// sample data (`skimage.data.chelsea`), CC0 by the photographer, Stefan van der Walt; see
/// `assets/README.md`. Embedded in the binary, so it works from any directory.
pub const DEFAULT_PHOTO: &[u8] = include_bytes!("../../../assets/chelsea.jpg");

/// The file name the default photo is shown and saved under.
pub const DEFAULT_PHOTO_NAME: &str = "chelsea.jpg";

/// An image ready for the model.
#[derive(Clone, Debug)]
pub struct Preprocessed {
    /// Normalised pixels, `[3, size, size]` channel-major (CHW, PyTorch's layout), `f32`:
    /// `(value / 255 − mean[c]) / std[c]`.
    pub pixels: Vec<f32>,
    /// The resized and cropped `size × size` image, 8-bit RGB, for drawing the attention over.
    pub rgb: RgbImage,
}

/// Reads and decodes an image file (PNG or JPEG, recognised by its content) to 8-bit RGB.
///
/// # Errors
/// [`Error::Image`] naming the file when it cannot be read or decoded.
pub fn load_image(path: &Path) -> Result<RgbImage> {
    let fail = |reason: String| Error::Image { path: path.display().to_string(), reason };
    let bytes = std::fs::read(path).map_err(|e| fail(format!("cannot read it: {e}")))?;
    decode_image(&bytes, &path.display().to_string())
}

/// Decodes an image held in memory (PNG or JPEG) to 8-bit RGB; `name` is used in errors.
///
/// # Errors
/// [`Error::Image`] when the bytes are not a PNG or JPEG image this decoder can read.
pub fn decode_image(bytes: &[u8], name: &str) -> Result<RgbImage> {
    let image = image::load_from_memory(bytes)
        .map_err(|e| Error::Image { path: name.to_string(), reason: format!("cannot decode it (PNG or JPEG): {e}") })?;
    Ok(image.to_rgb8())
}

/// Resizes `image` so that its shorter side is `size` pixels (Catmull-Rom, i.e. bicubic,
/// interpolation; the aspect ratio kept) and crops the centred `size × size` square.
///
/// # Errors
/// [`Error::Image`] for an empty image or a `size` of 0.
pub fn resize_and_crop(image: &RgbImage, size: usize) -> Result<RgbImage> {
    let (w, h) = (image.width() as usize, image.height() as usize);
    if w == 0 || h == 0 || size == 0 {
        return Err(Error::Image {
            path: "(input)".into(),
            reason: format!("cannot resize a {w} × {h} image to {size} × {size}"),
        });
    }
    // The shorter side becomes `size`; the longer one keeps the ratio (rounded, never below size).
    let scaled = |long: usize, short: usize| ((long * size) as f64 / short as f64).round().max(size as f64) as u32;
    let (nw, nh) = if w <= h { (size as u32, scaled(h, w)) } else { (scaled(w, h), size as u32) };
    let resized = if (nw, nh) == (w as u32, h as u32) {
        image.clone()
    } else {
        imageops::resize(image, nw, nh, FilterType::CatmullRom)
    };
    let (x, y) = ((nw - size as u32) / 2, (nh - size as u32) / 2);
    Ok(imageops::crop_imm(&resized, x, y, size as u32, size as u32).to_image())
}

/// The pixels of `image` in [0, 1], normalised per channel, `[3, height, width]` channel-major.
pub fn normalize(image: &RgbImage, norm: Normalization) -> Vec<f32> {
    let plane = image.width() as usize * image.height() as usize;
    let mut out = vec![0.0f32; CHANNELS * plane];
    for (i, pixel) in image.pixels().enumerate() {
        for c in 0..CHANNELS {
            out[c * plane + i] = (pixel.0[c] as f32 / 255.0 - norm.mean[c]) / norm.std[c];
        }
    }
    out
}

/// [`resize_and_crop`] to `size`, then [`normalize`].
///
/// # Errors
/// As [`resize_and_crop`].
pub fn preprocess(image: &RgbImage, size: usize, norm: Normalization) -> Result<Preprocessed> {
    let rgb = resize_and_crop(image, size)?;
    Ok(Preprocessed { pixels: normalize(&rgb, norm), rgb })
}

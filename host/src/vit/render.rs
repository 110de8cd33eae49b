//! Attention maps as a picture: one cell per head, the query's attention weights over the patch
//! grid upsampled smoothly to the image and blended over it, the query patch outlined, and a
//! first cell with the input and its patch grid.

use std::path::Path;

use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::{Rgb, RgbImage};

use super::config::VitConfig;
use super::pipeline::Query;
use crate::error::{Error, Result};

/// Background of the picture.
const BACKGROUND: Rgb<u8> = Rgb([24, 24, 28]);
/// Text.
const TEXT: Rgb<u8> = Rgb([235, 235, 235]);
/// Dimmer text.
const TEXT_DIM: Rgb<u8> = Rgb([165, 165, 175]);
/// Outline of the query patch.
const QUERY_MARK: Rgb<u8> = Rgb([0, 230, 255]);
/// Space between cells and around the picture, in pixels.
const GAP: u32 = 10;
/// Height of the strip above each cell (its label).
const LABEL_HEIGHT: u32 = 26;
/// Height of the title strip.
const TITLE_HEIGHT: u32 = 44;
/// At most this many cells per row.
const MAX_COLUMNS: usize = 7;
/// Weight of the heat map's colour over the photo.
const HEAT_ALPHA: f32 = 0.62;

/// The colour map: dark violet (low weight) through red and orange to pale yellow (high),
/// interpolated linearly between these stops (our own choice of colours).
const COLOR_STOPS: [(f32, [f32; 3]); 5] = [
    (0.0, [14.0, 8.0, 44.0]),
    (0.25, [88.0, 18.0, 112.0]),
    (0.5, [178.0, 40.0, 92.0]),
    (0.75, [240.0, 118.0, 40.0]),
    (1.0, [252.0, 238.0, 140.0]),
];

/// The colour map at `t` in [0, 1] (clamped).
pub fn colormap(t: f32) -> [f32; 3] {
    let t = t.clamp(0.0, 1.0);
    for pair in COLOR_STOPS.windows(2) {
        let ((t0, c0), (t1, c1)) = (pair[0], pair[1]);
        if t <= t1 {
            let u = (t - t0) / (t1 - t0);
            return std::array::from_fn(|i| c0[i] + (c1[i] - c0[i]) * u);
        }
    }
    COLOR_STOPS[COLOR_STOPS.len() - 1].1
}

/// What the picture shows.
pub struct MapPicture<'a> {
    /// The model's sizes (grid, patch size).
    pub config: &'a VitConfig,
    /// The cropped input, `image_size × image_size`.
    pub image: &'a RgbImage,
    /// The query whose attention is shown.
    pub query: Query,
    /// Attention weights of the query per head, `[H][N]` over all tokens (token 0 the class
    /// token, which the grid does not show; the label gives its weight).
    pub weights: &'a [Vec<f64>],
    /// The title line (ASCII; other characters are drawn as `?`).
    pub title: &'a str,
}

/// Draws the grid of attention maps: first the input with its patch grid and the query
/// outlined, then one cell per head with the weights over the patches scaled to that head's
/// largest on a patch other than the query's own (so each head's pattern shows; the label gives
/// the query's own weight and that largest other one, or for the class token the largest weight
/// and the class token's own), bilinearly upsampled from the grid to the image, coloured by [`colormap`] and
/// blended over the photo. Images smaller than 224 pixels are enlarged by a whole factor.
///
/// # Errors
/// [`Error::Vit`] when the image or the weights do not match the config.
pub fn render_attention_grid(picture: &MapPicture) -> Result<RgbImage> {
    let config = picture.config;
    config.validate()?;
    let size = config.image_size;
    if picture.image.dimensions() != (size as u32, size as u32) {
        return Err(Error::Vit(format!(
            "the image to draw on is {:?}; the model's is {size} × {size}",
            picture.image.dimensions()
        )));
    }
    if let Some(row) = picture.weights.iter().find(|w| w.len() != config.seqlen()) {
        return Err(Error::Vit(format!("an attention row has {} weights; N = {}", row.len(), config.seqlen())));
    }
    let scale = (224 / size).max(1) as u32;
    let cell = size as u32 * scale;
    let photo = image::imageops::resize(picture.image, cell, cell, image::imageops::FilterType::Nearest);
    let cells = picture.weights.len() + 1;
    let columns = cells.min(MAX_COLUMNS) as u32;
    let rows = cells.div_ceil(MAX_COLUMNS) as u32;
    let width = GAP + columns * (cell + GAP);
    let height = TITLE_HEIGHT + rows * (LABEL_HEIGHT + cell + GAP);
    let mut canvas = RgbImage::from_pixel(width, height.max(1), BACKGROUND);

    draw_text(&mut canvas, GAP, 8, picture.title, 2, TEXT);
    draw_legend(&mut canvas, width, TITLE_HEIGHT);

    let origin = |index: usize| {
        let (c, r) = ((index % MAX_COLUMNS) as u32, (index / MAX_COLUMNS) as u32);
        (GAP + c * (cell + GAP), TITLE_HEIGHT + r * (LABEL_HEIGHT + cell + GAP))
    };
    let patch_px = config.patch_size as u32 * scale;

    // Cell 0: the input with its patch grid.
    let (x0, y0) = origin(0);
    draw_text(&mut canvas, x0, y0 + 4, "input", 2, TEXT);
    let query_label = match picture.query {
        Query::ClassToken => "query: cls".to_string(),
        Query::Patch { row, col } => format!("query ({row},{col})"),
    };
    draw_text_right(&mut canvas, x0 + cell, y0 + 8, &query_label, 1, QUERY_MARK);
    let mut input = photo.clone();
    for y in 0..cell {
        for x in 0..cell {
            if x % patch_px == 0 || y % patch_px == 0 {
                let p = input.get_pixel_mut(x, y);
                p.0 = p.0.map(|v| (v as f32 * 0.55 + 255.0 * 0.45) as u8);
            }
        }
    }
    paste(&mut canvas, &input, x0, y0 + LABEL_HEIGHT);
    mark_query(&mut canvas, picture.query, (x0, y0 + LABEL_HEIGHT), patch_px);

    for (head, weights) in picture.weights.iter().enumerate() {
        let (x0, y0) = origin(head + 1);
        let grid = config.grid();
        let patches = &weights[1..];
        let max = patches.iter().copied().fold(0.0f64, f64::max);
        // Colours run up to the largest weight on a patch other than the query's own (which
        // would otherwise outshine the rest; it is drawn at full scale).
        let own = match picture.query {
            Query::Patch { row, col } => Some(row * grid + col),
            Query::ClassToken => None,
        };
        let top = patches.iter().enumerate().filter(|&(i, _)| Some(i) != own).map(|(_, &w)| w).fold(0.0f64, f64::max);
        let normalised: Vec<f32> =
            patches.iter().map(|&w| if top > 0.0 { (w / top).min(1.0) as f32 } else { 0.0 }).collect();
        let heat = upsample_bilinear(&normalised, grid, cell as usize);
        let mut blended = photo.clone();
        for (pixel, &t) in blended.pixels_mut().zip(&heat) {
            let colour = colormap(t);
            pixel.0 = std::array::from_fn(|i| {
                (pixel.0[i] as f32 * (1.0 - HEAT_ALPHA) + colour[i] * HEAT_ALPHA).round().clamp(0.0, 255.0) as u8
            });
        }
        paste(&mut canvas, &blended, x0, y0 + LABEL_HEIGHT);
        mark_query(&mut canvas, picture.query, (x0, y0 + LABEL_HEIGHT), patch_px);
        draw_text(&mut canvas, x0, y0 + 4, &format!("head {head}"), 2, TEXT);
        let stats = match own {
            Some(own) => [format!("self {:.3}", patches[own]), format!("top {top:.3}")],
            None => [format!("top {max:.3}"), format!("cls {:.3}", weights[0])],
        };
        draw_text_right(&mut canvas, x0 + cell, y0 + 3, &stats[0], 1, TEXT_DIM);
        draw_text_right(&mut canvas, x0 + cell, y0 + 13, &stats[1], 1, TEXT_DIM);
    }
    Ok(canvas)
}

/// Saves `image` as a PNG file (best zlib compression, adaptive row filters).
///
/// # Errors
/// [`Error::Image`] naming the file when it cannot be written.
pub fn save_png(image: &RgbImage, path: &Path) -> Result<()> {
    let fail = |reason: String| Error::Image { path: path.display().to_string(), reason };
    let file = std::fs::File::create(path).map_err(|e| fail(format!("cannot create it: {e}")))?;
    let encoder =
        PngEncoder::new_with_quality(std::io::BufWriter::new(file), CompressionType::Best, FilterType::Adaptive);
    image.write_with_encoder(encoder).map_err(|e| fail(format!("cannot write it: {e}")))
}

/// A `grid × grid` map upsampled to `size × size` by bilinear interpolation between the cells'
/// centres (edges held constant), row-major.
pub fn upsample_bilinear(values: &[f32], grid: usize, size: usize) -> Vec<f32> {
    let at = |r: usize, c: usize| values[r.min(grid - 1) * grid + c.min(grid - 1)];
    // Pixel centre → grid coordinate, where cell centres sit at integers.
    let coordinate = |p: usize| ((p as f32 + 0.5) * grid as f32 / size as f32 - 0.5).clamp(0.0, (grid - 1) as f32);
    let mut out = Vec::with_capacity(size * size);
    for y in 0..size {
        let gy = coordinate(y);
        let (r, fy) = (gy.floor() as usize, gy.fract());
        for x in 0..size {
            let gx = coordinate(x);
            let (c, fx) = (gx.floor() as usize, gx.fract());
            let top = at(r, c) * (1.0 - fx) + at(r, c + 1) * fx;
            let bottom = at(r + 1, c) * (1.0 - fx) + at(r + 1, c + 1) * fx;
            out.push(top * (1.0 - fy) + bottom * fy);
        }
    }
    out
}

fn paste(canvas: &mut RgbImage, image: &RgbImage, x: u32, y: u32) {
    image::imageops::replace(canvas, image, x as i64, y as i64);
}

/// A 2-pixel outline around the query patch (nothing for the class token).
fn mark_query(canvas: &mut RgbImage, query: Query, (x0, y0): (u32, u32), patch_px: u32) {
    let Query::Patch { row, col } = query else { return };
    let (x, y) = (x0 + col as u32 * patch_px, y0 + row as u32 * patch_px);
    for i in 0..patch_px {
        for t in 0..2 {
            for (px, py) in
                [(x + i, y + t), (x + i, y + patch_px - 1 - t), (x + t, y + i), (x + patch_px - 1 - t, y + i)]
            {
                if px < canvas.width() && py < canvas.height() {
                    canvas.put_pixel(px, py, QUERY_MARK);
                }
            }
        }
    }
}

/// The colour scale at the right of the title strip: "0" … "max".
fn draw_legend(canvas: &mut RgbImage, width: u32, title_height: u32) {
    let (bar_w, bar_h) = (160u32, 10u32);
    let Some(x0) = width.checked_sub(GAP + bar_w + 40) else { return };
    let y0 = title_height / 2 - bar_h / 2 - 4;
    if x0 < 400 {
        return; // no room next to the title
    }
    for x in 0..bar_w {
        let colour = colormap(x as f32 / (bar_w - 1) as f32).map(|v| v as u8);
        for y in 0..bar_h {
            canvas.put_pixel(x0 + x, y0 + y, Rgb(colour));
        }
    }
    draw_text_right(canvas, x0 - 4, y0 + 1, "0", 1, TEXT_DIM);
    draw_text(canvas, x0 + bar_w + 4, y0 + 1, "max", 1, TEXT_DIM);
}

/// Draws ASCII `text` with its top left at (x, y), each 8 × 8 glyph pixel as a `scale` ×
/// `scale` square (the public-domain 8 × 8 font of the `font8x8` crate); clipped at the edges.
fn draw_text(canvas: &mut RgbImage, x: u32, y: u32, text: &str, scale: u32, colour: Rgb<u8>) {
    for (i, ch) in text.chars().enumerate() {
        let code = if ch.is_ascii() { ch as usize } else { '?' as usize };
        let glyph = font8x8::legacy::BASIC_LEGACY[code];
        let left = x + i as u32 * 8 * scale;
        for (gy, bits) in glyph.iter().enumerate() {
            for gx in 0..8 {
                if bits & (1 << gx) == 0 {
                    continue;
                }
                for (dy, dx) in (0..scale).flat_map(|dy| (0..scale).map(move |dx| (dy, dx))) {
                    let (px, py) = (left + gx * scale + dx, y + gy as u32 * scale + dy);
                    if px < canvas.width() && py < canvas.height() {
                        canvas.put_pixel(px, py, colour);
                    }
                }
            }
        }
    }
}

/// [`draw_text`] with the text's right edge at `right`.
fn draw_text_right(canvas: &mut RgbImage, right: u32, y: u32, text: &str, scale: u32, colour: Rgb<u8>) {
    let width = text.chars().count() as u32 * 8 * scale;
    draw_text(canvas, right.saturating_sub(width), y, text, scale, colour);
}

//! The `vit` pipeline: image preprocessing, the safetensors loader, the similarity
//! initialisation, the matrix products (cuBLAS against the CPU) and the whole forward pass with
//! our kernels against the CPU reference, on the GPU and on the CPU emulator, and the picture.

mod common;

use std::path::PathBuf;

use attn_host::check::{random_normal, relative_l2_error};
use attn_host::vit::pipeline::{self, AttentionImpl, Forward};
use attn_host::vit::preprocess::{self, DEFAULT_PHOTO, DEFAULT_PHOTO_NAME};
use attn_host::vit::render::{self, MapPicture};
use attn_host::vit::weights::timm_tensors;
use attn_host::vit::{Init, Matmul, MatmulBackend, Normalization, Query, VitConfig, VitWeights};
use attn_host::{Context, Error};
use common::files::{f32_bytes, safetensors_bytes};
use image::{Rgb, RgbImage};

/// A seeded image of random pixels (no two patches alike).
fn noise_image(width: u32, height: u32, seed: u64) -> RgbImage {
    let values = random_normal((width * height * 3) as usize, seed);
    let mut image = RgbImage::new(width, height);
    for (pixel, chunk) in image.pixels_mut().zip(values.chunks(3)) {
        pixel.0 = std::array::from_fn(|c| (128.0 + 60.0 * chunk[c]).clamp(0.0, 255.0) as u8);
    }
    image
}

fn tiny_input(seed: u64) -> preprocess::Preprocessed {
    let config = VitConfig::tiny();
    preprocess::preprocess(&noise_image(40, 32, seed), config.image_size, Normalization::IMAGENET).unwrap()
}

fn shipped_photo(config: &VitConfig) -> preprocess::Preprocessed {
    let photo = preprocess::decode_image(DEFAULT_PHOTO, DEFAULT_PHOTO_NAME).unwrap();
    preprocess::preprocess(&photo, config.image_size, Normalization::IMAGENET).unwrap()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Relative L2 differences of every step of two forward passes, by name.
fn step_errors(got: &Forward, want: &Forward) -> Vec<(&'static str, f64)> {
    vec![
        ("X", relative_l2_error(&got.tokens, &widen(&want.tokens))),
        ("LN(X)", relative_l2_error(&got.normed, &widen(&want.normed))),
        ("Q", relative_l2_error(&got.qkv.q, &widen(&want.qkv.q))),
        ("K", relative_l2_error(&got.qkv.k, &widen(&want.qkv.k))),
        ("V", relative_l2_error(&got.qkv.v, &widen(&want.qkv.v))),
        ("O", relative_l2_error(&got.attention.o, &widen(&want.attention.o))),
        ("LSE", relative_l2_error(&got.attention.lse, &widen(&want.attention.lse))),
        ("Y", relative_l2_error(&got.output, &widen(&want.output))),
        ("X + Y", relative_l2_error(&got.residual, &widen(&want.residual))),
    ]
}

/// Runs the pipeline with each attention kernel on `ctx` (matrix products on `matmul`) and
/// compares every step with the all-CPU pipeline: `f32` steps within 1e-5 relative L2; with the
/// `f16` kernel, O, LSE and what follows within 3e-3 (Q, K, V rounded to `f16`).
fn check_pipeline(
    test: &str,
    ctx: &Context,
    matmul: &Matmul,
    config: &VitConfig,
    weights: &VitWeights,
    pixels: &[f32],
) {
    let cpu = pipeline::forward(config, weights, pixels, &Matmul::cpu(), None, AttentionImpl::CpuF64, None).unwrap();
    for which in [AttentionImpl::FlashF32, AttentionImpl::FlashF16, AttentionImpl::NaiveF32] {
        let got = pipeline::forward(config, weights, pixels, matmul, Some(ctx), which, None).unwrap();
        for (step, error) in step_errors(&got, &cpu) {
            let after_attention = matches!(step, "O" | "LSE" | "Y" | "X + Y");
            let tolerance = if which == AttentionImpl::FlashF16 && after_attention { 3e-3 } else { 1e-5 };
            assert!(
                error <= tolerance,
                "{test}: {} ({}): step {step} differs from the CPU by {error:.2e} (tolerance {tolerance:.0e})",
                which.name(),
                matmul.backend()
            );
        }
    }
}

#[test]
fn preprocess_resizes_the_shorter_side_and_crops_the_centre() {
    // Thirds of a wide image: red, green, blue; the centre crop of a 96 × 32 image at 32 is the
    // green third, and of the tall version too.
    let thirds = |w: u32, h: u32, horizontal: bool| {
        RgbImage::from_fn(w, h, |x, y| {
            let third = if horizontal { x * 3 / w } else { y * 3 / h };
            Rgb(std::array::from_fn(|c| if c as u32 == third { 255 } else { 0 }))
        })
    };
    for image in [thirds(96, 32, true), thirds(32, 96, false)] {
        let out = preprocess::preprocess(&image, 32, Normalization::IMAGENET).unwrap();
        assert_eq!(out.rgb.dimensions(), (32, 32));
        assert!(out.rgb.pixels().all(|p| p.0 == [0, 255, 0]), "the crop is not the centre third");
        // Channel-major: plane c holds channel c, normalised with the ImageNet statistics.
        assert_eq!(out.pixels.len(), 3 * 32 * 32);
        let n = Normalization::IMAGENET;
        for (c, plane) in out.pixels.chunks(32 * 32).enumerate() {
            let value = if c == 1 { 1.0 } else { 0.0 };
            let want = (value - n.mean[c]) / n.std[c];
            assert!(plane.iter().all(|&v| (v - want).abs() < 1e-6), "channel {c}: {} vs {want}", plane[0]);
        }
    }
    // A resize: 64 × 48 → shorter side 32 (64 → 43), centre crop 32 × 32.
    let out = preprocess::resize_and_crop(&noise_image(64, 48, 1), 32).unwrap();
    assert_eq!(out.dimensions(), (32, 32));
    // The shipped photo decodes and becomes a ViT input.
    let config = VitConfig::vit_b16();
    let photo = shipped_photo(&config);
    assert_eq!(photo.rgb.dimensions(), (224, 224));
    assert_eq!(photo.pixels.len(), 3 * 224 * 224);
    // Bad input is an error naming the file, not a panic.
    let err = preprocess::decode_image(b"not an image", "junk.png").unwrap_err();
    assert!(matches!(err, Error::Image { ref path, .. } if path == "junk.png"), "{err}");
    let err = preprocess::load_image(std::path::Path::new("/nonexistent/cat.jpg")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/cat.jpg"), "{err}");
}

#[test]
fn patchify_orders_patches_by_row_and_values_by_channel_row_column() {
    let config = VitConfig::tiny(); // 32 × 32 image, 8 × 8 patches, 4 × 4 grid
    let (s, p, g) = (config.image_size, config.patch_size, config.grid());
    let pixels: Vec<f32> = (0..3 * s * s).map(|i| i as f32).collect();
    let patches = pipeline::patchify(&pixels, &config).unwrap();
    assert_eq!(patches.len(), config.num_patches() * config.patch_dim());
    for (gy, gx, c, y, x) in [(0, 0, 0, 0, 0), (1, 2, 2, 7, 3), (3, 3, 1, 5, 7), (2, 0, 0, 1, 6)] {
        let got = patches[(gy * g + gx) * config.patch_dim() + c * p * p + y * p + x];
        assert_eq!(got, pixels[c * s * s + (gy * p + y) * s + gx * p + x], "patch ({gy}, {gx}) c{c} y{y} x{x}");
    }
    assert!(matches!(pipeline::patchify(&pixels[1..], &config), Err(Error::Length { .. })));
}

/// One tensor of a test file: name, dtype as the format spells it (e.g. "F32"), shape,
/// little-endian bytes.
type FileTensor = (String, &'static str, Vec<usize>, Vec<u8>);

/// Writes `tensors` as a safetensors file (laid out by `common::files::safetensors_bytes`).
fn write_safetensors(name: &str, tensors: &[FileTensor]) -> PathBuf {
    let entries: Vec<(&str, &str, &[usize], Vec<u8>)> =
        tensors.iter().map(|(n, dtype, shape, bytes)| (n.as_str(), *dtype, shape.as_slice(), bytes.clone())).collect();
    let dir = std::env::temp_dir().join(format!("attn-vit-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, safetensors_bytes(&entries)).unwrap();
    path
}

/// The tiny model's tensors in timm names, seeded values, all `F32`.
fn timm_file_tensors(config: &VitConfig) -> Vec<FileTensor> {
    timm_tensors(config)
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let values = random_normal(shape.iter().product(), 100 + i as u64);
            (name.to_string(), "F32", shape, f32_bytes(&values))
        })
        .collect()
}

#[test]
fn safetensors_loader_reads_timm_names() {
    let config = VitConfig::tiny();
    let mut tensors = timm_file_tensors(&config);
    // Other tensors of a full checkpoint are ignored; 16-bit tensors are widened.
    tensors.push(("blocks.1.attn.qkv.weight".into(), "F32", vec![2], f32_bytes(&[1.0, 2.0])));
    let bias16: Vec<half::f16> = random_normal(3 * config.dim, 7).iter().map(|&v| half::f16::from_f32(v)).collect();
    let qkv_bias = tensors.iter_mut().find(|t| t.0 == "blocks.0.attn.qkv.bias").unwrap();
    qkv_bias.1 = "F16";
    qkv_bias.3 = bias16.iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = write_safetensors("good.safetensors", &tensors);

    let weights = VitWeights::load_safetensors(&path, &config).unwrap();
    weights.validate(&config).unwrap();
    assert!(!weights.cosine_attention);
    let values = |i: u64, n: usize| random_normal(n, 100 + i);
    let (d, p) = (config.dim, config.patch_size);
    assert_eq!(weights.patch_embed_weight, values(0, d * 3 * p * p));
    assert_eq!(weights.cls_token, values(2, d));
    assert_eq!(weights.pos_embed, values(3, config.seqlen() * d));
    assert_eq!(weights.qkv_weight, values(6, 3 * d * d));
    assert_eq!(weights.qkv_bias, bias16.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
    assert_eq!(weights.proj_bias, values(9, d));

    // The loaded weights run through the pipeline.
    let input = tiny_input(3);
    let cpu = Matmul::cpu();
    pipeline::forward(&config, &weights, &input.pixels, &cpu, None, AttentionImpl::CpuF64, None).unwrap();
}

#[test]
fn safetensors_loader_names_a_missing_tensor() {
    let config = VitConfig::tiny();
    let tensors: Vec<_> = timm_file_tensors(&config).into_iter().filter(|t| t.0 != "blocks.0.attn.qkv.bias").collect();
    let path = write_safetensors("missing.safetensors", &tensors);
    let err = VitWeights::load_safetensors(&path, &config).unwrap_err();
    match &err {
        Error::TensorFile { path: p, tensor, reason } => {
            assert_eq!(tensor.as_deref(), Some("blocks.0.attn.qkv.bias"));
            assert_eq!(p, &path.display().to_string());
            assert!(reason.contains("no such tensor"), "{reason}");
        }
        other => panic!("expected TensorFile, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains("blocks.0.attn.qkv.bias") && message.contains("missing.safetensors"), "{message}");
}

#[test]
fn safetensors_loader_names_a_tensor_of_the_wrong_shape_or_dtype() {
    let config = VitConfig::tiny();
    // pos_embed for 16 tokens instead of 17 (no class token's row).
    let mut tensors = timm_file_tensors(&config);
    let pos = tensors.iter_mut().find(|t| t.0 == "pos_embed").unwrap();
    pos.2 = vec![1, config.num_patches(), config.dim];
    pos.3 = f32_bytes(&random_normal(config.num_patches() * config.dim, 1));
    let path = write_safetensors("shape.safetensors", &tensors);
    let err = VitWeights::load_safetensors(&path, &config).unwrap_err();
    match &err {
        Error::TensorFile { tensor, reason, .. } => {
            assert_eq!(tensor.as_deref(), Some("pos_embed"));
            assert!(reason.contains("[1, 16, 192]") && reason.contains("[1, 17, 192]"), "{reason}");
        }
        other => panic!("expected TensorFile, got {other:?}"),
    }
    assert!(err.to_string().contains("pos_embed") && err.to_string().contains("shape.safetensors"), "{err}");

    // An integer tensor where a float one belongs.
    let mut tensors = timm_file_tensors(&config);
    let cls = tensors.iter_mut().find(|t| t.0 == "cls_token").unwrap();
    cls.1 = "I32";
    let path = write_safetensors("dtype.safetensors", &tensors);
    let err = VitWeights::load_safetensors(&path, &config).unwrap_err();
    assert!(matches!(&err, Error::TensorFile { tensor: Some(t), .. } if t == "cls_token"), "{err:?}");

    // The ViT-B/16 names against the tiny file: the first tensor's shape is named.
    let path = write_safetensors("tiny.safetensors", &timm_file_tensors(&config));
    let err = VitWeights::load_safetensors(&path, &VitConfig::vit_b16()).unwrap_err();
    assert!(matches!(&err, Error::TensorFile { tensor: Some(t), .. } if t == "patch_embed.proj.weight"), "{err:?}");

    // Not a safetensors file, and no file at all.
    let path = write_safetensors("empty.safetensors", &[]);
    std::fs::write(&path, b"garbage").unwrap();
    let err = VitWeights::load_safetensors(&path, &config).unwrap_err();
    assert!(matches!(&err, Error::TensorFile { path: p, .. } if p.ends_with("empty.safetensors")), "{err:?}");
    let err = VitWeights::load_safetensors(&path.with_extension("absent"), &config).unwrap_err();
    assert!(matches!(&err, Error::TensorFile { path: p, .. } if p.ends_with("empty.absent")), "{err:?}");
}

/// Every patch's attention row, in every head, has its largest weight on the patch itself
/// (ties allowed: identical patches score alike).
fn assert_patches_attend_to_themselves_most(config: &VitConfig, input: &preprocess::Preprocessed) {
    let weights = VitWeights::similarity(config).unwrap();
    let cpu = Matmul::cpu();
    let fwd = pipeline::forward(config, &weights, &input.pixels, &cpu, None, AttentionImpl::CpuF64, None).unwrap();
    for row in 0..config.grid() {
        for col in 0..config.grid() {
            let token = Query::Patch { row, col }.token(config).unwrap();
            let rows = pipeline::attention_weights(&fwd.qkv, &fwd.attention.lse, token, None).unwrap();
            for (head, p) in rows.iter().enumerate() {
                let sum: f64 = p.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "head {head}, patch ({row}, {col}): weights sum to {sum}");
                let max = p.iter().copied().fold(0.0, f64::max);
                assert!(
                    p[token] >= max * (1.0 - 1e-9),
                    "head {head}, patch ({row}, {col}): own weight {} < largest {max} (at token {:?})",
                    p[token],
                    pipeline::top_k(p, 1)
                );
            }
        }
    }
}

#[test]
fn similarity_init_makes_each_patch_attend_to_itself_most() {
    assert_patches_attend_to_themselves_most(&VitConfig::tiny(), &tiny_input(11));
    let config = VitConfig::vit_b16();
    assert_patches_attend_to_themselves_most(&config, &shipped_photo(&config));
    // The patch embedding is a rotation: orthonormal rows.
    let w = attn_host::vit::weights::dct_patch_embedding(8);
    let n = 3 * 8 * 8;
    for (i, j) in [(0, 0), (0, 1), (5, 5), (17, 100), (191, 191), (3, 190)] {
        let dot: f64 = (0..n).map(|k| w[i * n + k] as f64 * w[j * n + k] as f64).sum();
        let want = if i == j { 1.0 } else { 0.0 };
        assert!((dot - want).abs() < 1e-6, "rows {i} and {j}: {dot}");
    }
    // D must be 3·P² for it.
    let config = VitConfig { dim: 96, num_heads: 3, ..VitConfig::tiny() };
    assert!(matches!(VitWeights::similarity(&config), Err(Error::Vit(_))));
}

#[test]
fn pipeline_on_the_emulator_matches_the_cpu() {
    // Our kernels' own code on the CPU emulator; the matrix products on the CPU.
    let ctx = Context::cpu_emulated();
    let config = VitConfig::tiny();
    let input = tiny_input(5);
    for init in [Init::Similarity, Init::Random { seed: 3 }] {
        let weights = VitWeights::init(init, &config).unwrap();
        check_pipeline(&format!("emulated, {init:?}"), &ctx, &Matmul::cpu(), &config, &weights, &input.pixels);
    }
}

/// The GPU's matrix products, cuBLAS or a missing library: with REQUIRE_GPU=1 a missing cuBLAS
/// fails the test (the issue needs cuBLAS), otherwise it is reported and the CPU ones are used.
fn gpu_matmul(test: &str, ctx: &Context) -> Matmul {
    match Matmul::cublas(ctx) {
        Ok(matmul) => matmul,
        Err(e) if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("{test}: {e}; CPU matrix products instead");
            Matmul::cpu()
        }
    }
}

#[test]
fn gpu_cublas_linear_matches_the_cpu() {
    let test = "gpu_cublas_linear_matches_the_cpu";
    let Some(ctx) = common::gpu(test) else { return };
    let matmul = gpu_matmul(test, ctx);
    assert_eq!(matmul.backend(), MatmulBackend::Cublas);
    let cpu = Matmul::cpu();
    for (i, (rows, k, n)) in [(197, 768, 2304), (197, 768, 768), (196, 768, 768), (5, 3, 7), (1, 1, 1), (17, 192, 576)]
        .into_iter()
        .enumerate()
    {
        let seed = 10 * i as u64;
        let x = random_normal(rows * k, seed);
        let w = random_normal(n * k, seed + 1);
        let b = random_normal(n, seed + 2);
        let got = matmul.linear(&x, &w, &b, rows, k, n).unwrap();
        let want = cpu.linear(&x, &w, &b, rows, k, n).unwrap();
        let error = relative_l2_error(&got, &widen(&want));
        assert!(error < 1e-6, "{rows}×{k} · ({n}×{k})ᵀ: cuBLAS differs from the CPU by {error:.2e}");
    }
    assert!(matches!(matmul.linear(&[1.0; 6], &[1.0; 6], &[0.0; 2], 2, 3, 3), Err(Error::Length { .. })));
}

#[test]
fn gpu_pipeline_matches_the_cpu() {
    let test = "gpu_pipeline_matches_the_cpu";
    let Some(ctx) = common::gpu(test) else { return };
    let matmul = gpu_matmul(test, ctx);
    let config = VitConfig::tiny();
    let input = tiny_input(5);
    for init in [Init::Similarity, Init::Random { seed: 3 }] {
        let weights = VitWeights::init(init, &config).unwrap();
        check_pipeline(&format!("tiny, {init:?}"), ctx, &matmul, &config, &weights, &input.pixels);
    }
    // ViT-B/16 on the shipped photo.
    let config = VitConfig::vit_b16();
    let input = shipped_photo(&config);
    for init in [Init::Similarity, Init::Random { seed: 1 }] {
        let weights = VitWeights::init(init, &config).unwrap();
        check_pipeline(&format!("ViT-B/16, {init:?}"), ctx, &matmul, &config, &weights, &input.pixels);
    }
}

#[test]
fn attention_maps_render_as_a_grid() {
    let config = VitConfig::tiny();
    let input = tiny_input(2);
    let weights = VitWeights::similarity(&config).unwrap();
    let cpu = Matmul::cpu();
    let fwd = pipeline::forward(&config, &weights, &input.pixels, &cpu, None, AttentionImpl::CpuF64, None).unwrap();
    let query = Query::Patch { row: 1, col: 2 };
    let maps = pipeline::attention_weights(&fwd.qkv, &fwd.attention.lse, query.token(&config).unwrap(), None).unwrap();
    assert_eq!((maps.len(), maps[0].len()), (config.num_heads, config.seqlen()));
    let picture = MapPicture { config: &config, image: &input.rgb, query, weights: &maps, title: "test" };
    let grid = render::render_attention_grid(&picture).unwrap();
    // Four cells of 224 pixels (the 32-pixel image enlarged 7×) in one row.
    assert!(grid.width() >= 4 * 224 && grid.height() >= 224, "{:?}", grid.dimensions());
    let path = std::env::temp_dir().join(format!("attn-vit-grid-{}.png", std::process::id()));
    render::save_png(&grid, &path).unwrap();
    assert_eq!(image::open(&path).unwrap().to_rgb8(), grid);
    // Weights of the wrong length are an error.
    let short = vec![vec![0.5; 3]; 3];
    let bad = MapPicture { weights: &short, ..picture };
    assert!(matches!(render::render_attention_grid(&bad), Err(Error::Vit(_))));
}

#[test]
fn queries_parse_and_are_checked_against_the_grid() {
    let config = VitConfig::vit_b16();
    assert_eq!("cls".parse::<Query>().unwrap(), Query::ClassToken);
    assert_eq!(" 3, 4".parse::<Query>().unwrap(), Query::Patch { row: 3, col: 4 });
    assert!("7".parse::<Query>().is_err() && "a,b".parse::<Query>().is_err());
    assert_eq!(Query::ClassToken.token(&config).unwrap(), 0);
    assert_eq!(Query::Patch { row: 0, col: 0 }.token(&config).unwrap(), 1);
    assert_eq!(Query::Patch { row: 13, col: 13 }.token(&config).unwrap(), 196);
    assert!(matches!(Query::Patch { row: 14, col: 0 }.token(&config), Err(Error::Vit(_))));
    assert_eq!(pipeline::token_label(&config, 16), "(1, 1)");
}

//! `cargo run --release -- vit`: a Vision Transformer's first attention layer on a real photo
//! (see [`crate::vit`]): the attention computed with our flash kernels (`f32`, `f16`), our naive
//! kernel and the CPU reference, their differences, the whole pipeline checked against the CPU,
//! and one query's attention in every head as heat maps over the photo (a PNG grid), with each
//! head's entropy and top 5 patches in the terminal.

use std::path::{Path, PathBuf};

use comfy_table::{Table, presets::ASCII_MARKDOWN};

use super::DeviceArg;
use crate::check::relative_l2_error;
use crate::vit::pipeline::{self, AttentionRows, Forward, Repeats};
use crate::vit::preprocess::{self, DEFAULT_PHOTO, DEFAULT_PHOTO_NAME};
use crate::vit::render::{self, MapPicture};
use crate::vit::{AttentionImpl, Init, Matmul, Normalization, Query, VitConfig, VitWeights};
use crate::{Context, Error, Result};

/// `--init`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitArg {
    /// W_Q = W_K = W_V = identity over a DCT patch embedding (head 0: colour and coarse shading,
    /// later heads finer detail), zero positions, cosine attention: each patch attends to the
    /// patches that look like it.
    Similarity,
    /// Seeded normal weights of std 0.02 (an untrained ViT: near-uniform attention).
    Random,
}

/// `--model`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelArg {
    /// ViT-B/16: 224×224 image, 16×16 patches, D = 768, 12 heads of 64.
    VitB16,
    /// A 32×32 image in 8×8 patches, D = 192, 3 heads of 64 (for a quick look on the emulator).
    Tiny,
}

/// `--normalize`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormalizeArg {
    /// ImageNet mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225).
    Imagenet,
    /// Mean 0.5 and std 0.5 per channel (the original ViT weights, timm's augreg ViT-B/16).
    Half,
}

/// `--attention`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionArg {
    /// Our FlashAttention forward kernel, f32.
    FlashF32,
    /// Our FlashAttention forward kernel, f16 on the tensor cores.
    FlashF16,
    /// Our naive attention kernels, f32.
    NaiveF32,
    /// The CPU reference, f64 (always run: the others are compared with it).
    CpuF64,
}

impl From<AttentionArg> for AttentionImpl {
    fn from(arg: AttentionArg) -> Self {
        match arg {
            AttentionArg::FlashF32 => Self::FlashF32,
            AttentionArg::FlashF16 => Self::FlashF16,
            AttentionArg::NaiveF32 => Self::NaiveF32,
            AttentionArg::CpuF64 => Self::CpuF64,
        }
    }
}

/// The `vit` job's flags.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A PNG or JPEG photo; resized to 224 pixels on its shorter side and centre-cropped. Default:
    /// the shipped photo of Chelsea the cat (assets/chelsea.jpg, CC0; built into the binary).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// A ViT-B/16 checkpoint (.safetensors) in timm's tensor names (patch_embed.proj, cls_token,
    /// pos_embed, blocks.0.norm1, blocks.0.attn.qkv, blocks.0.attn.proj); replaces --init.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Weights when no --weights file is given.
    #[arg(long, value_enum, default_value_t = InitArg::Similarity)]
    pub init: InitArg,
    /// Seed of --init random.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The query token whose attention is drawn: `cls` or ROW,COL of a patch (0-based, 0..14).
    /// Default: the class token, except with --init similarity, whose class token is all zeros
    /// and attends uniformly: there the centre patch (7,7).
    #[arg(long)]
    pub query: Option<Query>,
    /// Folder for the picture (created if missing).
    #[arg(long, default_value = "vit-out")]
    pub out: PathBuf,
    /// A CUDA device ordinal (0, 1, …), `cpu-emulated` (our kernels on the CPU emulator: slow
    /// at ViT-B/16 size, try --model tiny), or `cpu` (the CPU reference only, no kernels).
    #[arg(long, default_value = "0")]
    pub device: DeviceArg,
    /// Softmax scale (the temperature's inverse); default 1/sqrt(d_k) = 0.125.
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Pixel normalisation; use `half` for checkpoints trained with mean = std = 0.5.
    #[arg(long, value_enum, default_value_t = NormalizeArg::Imagenet)]
    pub normalize: NormalizeArg,
    /// The model's sizes.
    #[arg(long, value_enum, default_value_t = ModelArg::VitB16)]
    pub model: ModelArg,
    /// Attention implementations to run and compare (comma list); the first that runs gives
    /// the maps and the output projection's input.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "flash-f32,flash-f16,naive-f32,cpu-f64")]
    pub attention: Vec<AttentionArg>,
    /// Timed repeats per kernel (the median is reported), after 5 warm-up runs.
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
}

/// The photo: its name for titles and file names, and its pixels.
struct Photo {
    name: String,
    image: image::RgbImage,
}

fn load_photo(path: Option<&Path>) -> Result<Photo> {
    match path {
        Some(path) => Ok(Photo {
            name: path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned()),
            image: preprocess::load_image(path)?,
        }),
        None => Ok(Photo {
            name: DEFAULT_PHOTO_NAME.into(),
            image: preprocess::decode_image(DEFAULT_PHOTO, DEFAULT_PHOTO_NAME)?,
        }),
    }
}

/// Runs the `vit` job.
pub(super) fn run(args: &Args) -> Result<()> {
    let config = match args.model {
        ModelArg::VitB16 => VitConfig::vit_b16(),
        ModelArg::Tiny => VitConfig::tiny(),
    };
    config.validate()?;
    // Everything that can fail on bad input is checked before a device is opened.
    let photo = load_photo(args.image.as_deref())?;
    let (weights, weights_name, weights_tag) = match (&args.weights, args.init) {
        (Some(path), _) => {
            let stem = path.file_stem().map_or("weights".into(), |s| s.to_string_lossy().into_owned());
            (VitWeights::load_safetensors(path, &config)?, format!("{} (timm names)", path.display()), stem)
        }
        (None, InitArg::Similarity) => (
            VitWeights::similarity(&config)?,
            "similarity init (patch embedding = per-channel 2-D DCT, low frequencies in head 0; W_Q = W_K = \
             W_V = W_proj = identity; zero class token and positions; cosine attention: q and k scaled to length \
             sqrt(d_k))"
                .to_string(),
            "similarity".to_string(),
        ),
        (None, InitArg::Random) => (
            VitWeights::init(Init::Random { seed: args.seed }, &config)?,
            format!("seeded random init (std 0.02, seed {})", args.seed),
            format!("random{}", args.seed),
        ),
    };
    let query = match args.query {
        Some(query) => query,
        None if weights_tag == "similarity" => Query::centre(&config),
        None => Query::ClassToken,
    };
    let query_token = query.token(&config)?;
    let scale = crate::AttentionOptions { scale: args.scale, ..Default::default() }.checked_scale(config.head_dim())?;
    let normalization = match args.normalize {
        NormalizeArg::Imagenet => Normalization::IMAGENET,
        NormalizeArg::Half => Normalization::HALF,
    };
    let input = preprocess::preprocess(&photo.image, config.image_size, normalization)?;

    let ctx = open_device(args.device)?;
    let matmul = match &ctx {
        Some(ctx) if !ctx.is_emulated() => Matmul::cublas(ctx).unwrap_or_else(|e| {
            println!("{e}; the matrix products run on the CPU instead");
            Matmul::cpu()
        }),
        _ => Matmul::cpu(),
    };
    let (w, h) = photo.image.dimensions();
    let (mean, std) = (normalization.mean, normalization.std);
    println!(
        "image: {} ({w} × {h}), shorter side resized to {s}, centre crop {s} × {s}, normalised per channel with \
         mean ({}, {}, {}), std ({}, {}, {})",
        photo.name,
        mean[0],
        mean[1],
        mean[2],
        std[0],
        std[1],
        std[2],
        s = config.image_size
    );
    println!(
        "model: block 0 of a ViT with {g}×{g} = {} patches of {p}×{p} pixels + class token = {} tokens, D = {}, \
         {} heads of d_k = {}; softmax scale {scale}",
        config.num_patches(),
        config.seqlen(),
        config.dim,
        config.num_heads,
        config.head_dim(),
        g = config.grid(),
        p = config.patch_size,
    );
    println!("weights: {weights_name}");
    match matmul.library() {
        Some(library) => println!("matrix products: {} ({library})", matmul.backend()),
        None => println!("matrix products: {}", matmul.backend()),
    }

    // The steps before attention, once, on this device's matrix products.
    let tokens = pipeline::embed(&config, &weights, &input.pixels, &matmul)?;
    let affine = Some((weights.norm1_weight.as_slice(), weights.norm1_bias.as_slice()));
    let normed = pipeline::layer_norm(&tokens, config.dim, config.layer_norm_eps, affine);
    let qkv = pipeline::qkv(&config, &weights, &normed, &matmul)?;

    let repeats = match &ctx {
        Some(ctx) if !ctx.is_emulated() => Repeats { warmup: 5, repeats: args.repeats.max(1) },
        _ => Repeats::ONCE,
    };
    let runs = run_attention(args, ctx.as_ref(), &qkv, repeats);
    let Some((main_impl, main)) = runs.iter().find_map(|(which, run)| run.as_ref().ok().map(|r| (*which, r))) else {
        // The CPU reference always runs, so this is only reached if it failed too.
        return Err(runs.into_iter().find_map(|(_, r)| r.err()).unwrap_or(Error::Vit("no attention ran".into())));
    };
    print_attention_table(&qkv, &runs, ctx.as_ref().is_some_and(|c| !c.is_emulated()));

    let output = pipeline::project(&config, &weights, &main.o, &matmul)?;
    let forward = Forward {
        residual: tokens.iter().zip(&output).map(|(x, y)| x + y).collect(),
        tokens,
        normed,
        qkv,
        attention: main.clone(),
        output,
    };
    if ctx.is_some() {
        check_against_cpu(&config, &weights, &input.pixels, args.scale, &forward, main_impl)?;
    }

    let maps = pipeline::attention_weights(&forward.qkv, &forward.attention.lse, query_token, args.scale)?;
    let reference_lse = runs.iter().find(|(w, _)| *w == AttentionImpl::CpuF64).and_then(|(_, r)| r.as_ref().ok());
    let check = match reference_lse {
        Some(reference) if main_impl != AttentionImpl::CpuF64 => {
            let cpu_maps = pipeline::attention_weights(&forward.qkv, &reference.lse, query_token, args.scale)?;
            let diff =
                maps.iter().flatten().zip(cpu_maps.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            format!("; max |ΔP| vs the CPU's {diff:.1e}")
        }
        _ => String::new(),
    };
    println!(
        "\nattention weights of the {query} (token {query_token}) per head, P = exp(scale·q·k − LSE) with the LSE of {}{check}:",
        main_impl.name()
    );
    print_head_table(&config, &maps);

    let title = format!("{}  |  {}  |  query {}", photo.name, weights_tag, query_label(query));
    let picture = render::render_attention_grid(&MapPicture {
        config: &config,
        image: &input.rgb,
        query,
        weights: &maps,
        title: &title,
    })?;
    std::fs::create_dir_all(&args.out).map_err(|e| Error::Image {
        path: args.out.display().to_string(),
        reason: format!("cannot create the folder: {e}"),
    })?;
    let stem = Path::new(&photo.name).file_stem().map_or("image".into(), |s| s.to_string_lossy().into_owned());
    let path = args.out.join(format!("{stem}_{weights_tag}_{}.png", query.file_tag()));
    render::save_png(&picture, &path)?;
    println!("\nwrote {} ({} × {} pixels)", path.display(), picture.width(), picture.height());
    Ok(())
}

fn query_label(query: Query) -> String {
    match query {
        Query::ClassToken => "cls".into(),
        Query::Patch { row, col } => format!("({row},{col})"),
    }
}

/// The context for `device`, or `None` for the CPU (also when no GPU is found, said in a line).
fn open_device(device: DeviceArg) -> Result<Option<Context>> {
    let DeviceArg::Kernels(device) = device else {
        println!("device: CPU (matrix products with rayon, attention by the f64 reference; no kernels)");
        return Ok(None);
    };
    match Context::open(device) {
        Ok(ctx) if ctx.is_emulated() => {
            println!("device: CPU emulator (our kernels' own code on the CPU: slow by design)");
            Ok(Some(ctx))
        }
        Ok(ctx) => {
            println!("device: {}", ctx.device());
            Ok(Some(ctx))
        }
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
            println!("no CUDA device ({e}); running on the CPU instead (--device cpu)");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Every requested attention implementation (the CPU reference always, last if not asked
/// for), each result or its error; kernels are skipped without a context.
fn run_attention(
    args: &Args,
    ctx: Option<&Context>,
    qkv: &pipeline::Qkv,
    repeats: Repeats,
) -> Vec<(AttentionImpl, Result<AttentionRows>)> {
    let mut wanted: Vec<AttentionImpl> = Vec::new();
    for which in args.attention.iter().copied().map(AttentionImpl::from).chain([AttentionImpl::CpuF64]) {
        if !wanted.contains(&which) && (ctx.is_some() || !which.needs_context()) {
            wanted.push(which);
        }
    }
    wanted.into_iter().map(|which| (which, pipeline::attention(which, ctx, qkv, args.scale, repeats))).collect()
}

/// The attention table: time and the relative L2 differences between the implementations.
fn print_attention_table(qkv: &pipeline::Qkv, runs: &[(AttentionImpl, Result<AttentionRows>)], gpu: bool) {
    let s = qkv.shape;
    let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let find = |which| runs.iter().find(|(w, _)| *w == which).and_then(|(_, r)| r.as_ref().ok());
    let against = [AttentionImpl::CpuF64, AttentionImpl::FlashF32, AttentionImpl::NaiveF32];
    let mut table = Table::new();
    let mut header = vec!["attention".to_string(), "time (ms)".to_string()];
    header.extend(against.iter().map(|w| format!("O rel L2 vs {}", short_name(*w))));
    header.push("LSE rel L2 vs CPU f64".into());
    table.load_style(ASCII_MARKDOWN).set_header(header);
    for (which, run) in runs {
        let mut row = vec![which.name().to_string()];
        match run {
            Ok(r) => {
                row.push(format!("{:.4}", r.ms));
                for other in against {
                    row.push(match find(other) {
                        Some(_) if other == *which => "-".into(),
                        Some(o) => format!("{:.1e}", relative_l2_error(&r.o, &widen(&o.o))),
                        None => "n/a".into(),
                    });
                }
                row.push(match find(AttentionImpl::CpuF64) {
                    Some(_) if *which == AttentionImpl::CpuF64 => "-".into(),
                    Some(o) => format!("{:.1e}", relative_l2_error(&r.lse, &widen(&o.lse))),
                    None => "n/a".into(),
                });
            }
            Err(e) => row.push(format!("not run: {e}")),
        }
        table.add_row(row);
    }
    println!(
        "\nattention O = softmax(Q Kᵀ · scale) V, [batch, heads, tokens, d_k] = [{}, {}, {}, {}]:\n{table}",
        s.batch, s.num_heads_q, s.seqlen_q, s.head_dim
    );
    let kernels = if gpu { "the kernels' median of the timed runs (CUDA events)" } else { "one run, host clock" };
    if runs.iter().any(|(which, _)| which.needs_context()) {
        println!("time: {kernels}, the CPU reference one run; the f16 row's errors include rounding Q, K, V to f16");
    } else {
        println!("time: one run of the CPU reference");
    }
}

fn short_name(which: AttentionImpl) -> &'static str {
    match which {
        AttentionImpl::FlashF32 => "flash f32",
        AttentionImpl::FlashF16 => "flash f16",
        AttentionImpl::NaiveF32 => "naive f32",
        AttentionImpl::CpuF64 => "CPU f64",
    }
}

/// Runs the whole pipeline on the CPU and prints the relative L2 difference of each step.
fn check_against_cpu(
    config: &VitConfig,
    weights: &VitWeights,
    pixels: &[f32],
    scale: Option<f32>,
    device: &Forward,
    which: AttentionImpl,
) -> Result<()> {
    let cpu = pipeline::forward(config, weights, pixels, &Matmul::cpu(), None, AttentionImpl::CpuF64, scale)?;
    let rel = |got: &[f32], want: &[f32]| {
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        format!("{:.1e}", relative_l2_error(got, &want))
    };
    println!(
        "\npipeline on this device ({}) vs all on the CPU, relative L2: X {}, LN(X) {}, Q {}, K {}, V {}, O {}, \
         Y = proj(O) {}, X + Y {}",
        short_name(which),
        rel(&device.tokens, &cpu.tokens),
        rel(&device.normed, &cpu.normed),
        rel(&device.qkv.q, &cpu.qkv.q),
        rel(&device.qkv.k, &cpu.qkv.k),
        rel(&device.qkv.v, &cpu.qkv.v),
        rel(&device.attention.o, &cpu.attention.o),
        rel(&device.output, &cpu.output),
        rel(&device.residual, &cpu.residual),
    );
    Ok(())
}

/// Per head: the entropy of the query's attention row and its 5 most attended tokens.
fn print_head_table(config: &VitConfig, maps: &[Vec<f64>]) {
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "head",
        "entropy (nats)",
        "e^entropy (tokens)",
        "top 5 attended tokens: (row, col) weight",
    ]);
    for (head, p) in maps.iter().enumerate() {
        let h = pipeline::entropy(p);
        let top: Vec<String> = pipeline::top_k(p, 5)
            .into_iter()
            .map(|(token, w)| format!("{} {w:.3}", pipeline::token_label(config, token)))
            .collect();
        table.add_row([head.to_string(), format!("{h:.3}"), format!("{:.1}", h.exp()), top.join(", ")]);
    }
    println!("{table}");
    println!("entropy of a uniform row: ln {} = {:.3} nats", config.seqlen(), (config.seqlen() as f64).ln());
}

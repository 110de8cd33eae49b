//! The `attn` subcommand (`host/src/cli/attn.rs`) on files written by the tests: inputs as
//! separate `.npy` files, separate `.safetensors` files or one `.safetensors` file, in every
//! element type, with GQA, cross lengths, every mask and an explicit scale; outputs read back and
//! compared with the float64 CPU reference on the same (rounded) inputs. Three paths: the CPU
//! reference (`--device cpu`, always), the GPU (skipped without one) and the CPU emulator on tiny
//! shapes. Then the errors: wrong rank, mismatched dO, missing tensors, mixed types, the naive
//! kernels with 16 bits, head dims without kernels.

mod common;

use attn_host::check::{Tolerance, lse_error, random_normal, relative_l2_error};
use attn_host::cli::{Cli, Command, attn};
use attn_host::io::{self, HostTensor};
use attn_host::{AttentionShape, Causal, DType, Error, cpu};
use clap::Parser;
use common::files::TempDir;

/// Runs `rust-attention attn ARGS` in this process.
fn run_attn(args: &[String]) -> attn_host::Result<()> {
    let argv = ["rust-attention", "attn"].into_iter().map(String::from).chain(args.iter().cloned());
    let cli = Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}"));
    match cli.command {
        Some(Command::Attn(args)) => attn::run(&args),
        other => panic!("parsed as {other:?}"),
    }
}

/// How the test hands the inputs over.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `--q q.npy --k k.npy …`
    Npy,
    /// `--q q.safetensors …`, one file per tensor.
    SafetensorsEach,
    /// `--input qkv.safetensors`.
    OneFile,
}

/// A problem: its shape, mask, scale and random inputs (`f32`, rounded to the files' type when
/// written).
struct Case {
    shape: AttentionShape,
    causal: Causal,
    scale: Option<f32>,
    inputs: [HostTensor; 4], // q, k, v, do
}

impl Case {
    fn new(shape: AttentionShape, causal: Causal, scale: Option<f32>, seed: u64) -> Self {
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let names = ["q", "k", "v", "do"];
        let inputs = std::array::from_fn(|i| {
            HostTensor::new(names[i], &shapes[i], random_normal(shapes[i].iter().product(), seed + i as u64)).unwrap()
        });
        Self { shape, causal, scale, inputs }
    }

    /// Writes the inputs in `dtype` under `dir` and returns the flags that read them (dO only
    /// with `backward`), the mask and the scale.
    fn write(&self, dir: &TempDir, dtype: DType, layout: Layout, backward: bool) -> Vec<String> {
        let tensors: Vec<HostTensor> =
            self.inputs.iter().take(if backward { 4 } else { 3 }).map(|t| t.converted(dtype)).collect();
        let mut args = Vec::new();
        match layout {
            Layout::OneFile => {
                let path = dir.join("inputs.safetensors");
                io::write_safetensors(&path, &tensors).unwrap();
                args.extend(["--input".to_string(), path.display().to_string()]);
            }
            Layout::Npy | Layout::SafetensorsEach => {
                for tensor in &tensors {
                    let path = match layout {
                        // Files named otherwise than their flag: the flag gives the role.
                        Layout::Npy => dir.join(&io::npy_file_name(&format!("in_{}", tensor.name()), dtype)),
                        _ => dir.join(&format!("{}.safetensors", tensor.name())),
                    };
                    match layout {
                        Layout::Npy => io::write_npy(&path, &tensor.clone().renamed(format!("in_{}", tensor.name()))),
                        _ => io::write_safetensors(&path, std::slice::from_ref(tensor)),
                    }
                    .unwrap();
                    args.extend([format!("--{}", tensor.name()), path.display().to_string()]);
                }
            }
        }
        let causal = match self.causal {
            Causal::None => "none",
            Causal::TopLeft => "top-left",
            Causal::BottomRight => "bottom-right",
        };
        args.extend(["--causal".to_string(), causal.to_string()]);
        if let Some(scale) = self.scale {
            args.extend(["--scale".to_string(), scale.to_string()]);
        }
        args
    }

    /// Reads the outputs the job wrote to `out` and checks them against the float64 reference on
    /// the inputs rounded to `dtype`; returns the errors, for the failure message.
    fn check_outputs(&self, out: &std::path::Path, dtype: DType, backward: bool, context: &str) {
        let read = |name: &str, dtype: DType| {
            let tensor = if out.extension().is_some_and(|e| e == "safetensors") {
                io::read_safetensors_tensor(out, name)
            } else {
                io::read_npy(out.join(io::npy_file_name(name, dtype)))
            }
            .unwrap_or_else(|e| panic!("{context}: {e}"));
            assert_eq!(tensor.dtype(), dtype, "{context}: {name}");
            tensor
        };
        let rounded: Vec<Vec<f32>> = self.inputs.iter().map(|t| t.converted(dtype).to_f32()).collect();
        let shape = &self.shape;
        let params = cpu::Params {
            scale: self.scale.unwrap_or(1.0 / (shape.head_dim as f32).sqrt()) as f64,
            causal: self.causal,
            window: None,
            score: Default::default(),
            sinks: None,
            mask_table: None,
            bias: None,
        };
        let (o_tol, lse_tol, grad_tol) = tolerances(dtype);
        let reference = cpu::attention(&rounded[0], &rounded[1], &rounded[2], shape, params).unwrap();
        let (o, lse) = (read("o", dtype), read("lse", DType::F32));
        assert_eq!(o.shape(), shape.q_shape(), "{context}");
        assert_eq!(lse.shape(), shape.lse_shape(), "{context}");
        let o_err = relative_l2_error(&o.to_f32(), &reference.o);
        let lse_err = lse_error(&lse.to_f32(), &reference.lse);
        assert!(o_err <= o_tol && lse_err <= lse_tol, "{context}: O {o_err:.2e}, LSE {lse_err:.2e}");
        let grads_path = |name: &str| {
            if out.extension().is_some_and(|e| e == "safetensors") {
                io::read_safetensors_tensor(out, name).is_ok()
            } else {
                out.join(io::npy_file_name(name, dtype)).exists()
            }
        };
        if !backward {
            assert!(!grads_path("dq"), "{context}: no dO, no dQ");
            return;
        }
        let grads = cpu::attention_backward(&rounded[0], &rounded[1], &rounded[2], &rounded[3], shape, params).unwrap();
        for (name, want, dims) in [
            ("dq", &grads.dq, shape.q_shape()),
            ("dk", &grads.dk, shape.kv_shape()),
            ("dv", &grads.dv, shape.kv_shape()),
        ] {
            let got = read(name, dtype);
            assert_eq!(got.shape(), dims, "{context}: {name}");
            let err = relative_l2_error(&got.to_f32(), want);
            assert!(err <= grad_tol, "{context}: {name} {err:.2e} > {grad_tol:.0e}");
        }
    }
}

/// Relative L2 tolerances (O, LSE, gradients) against the float64 reference on the rounded
/// inputs: those of the kernels' own tests (`attn_host::check::Tolerance`).
fn tolerances(dtype: DType) -> (f64, f64, f64) {
    let tolerance = Tolerance::of(dtype);
    (tolerance.o, tolerance.lse, tolerance.grad)
}

fn gqa(
    batch: usize,
    heads: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
) -> AttentionShape {
    AttentionShape { batch, num_heads_q: heads, num_heads_kv: heads_kv, seqlen_q, seqlen_k, head_dim }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Runs one case on `device` and checks what it wrote; `out_name` picks .safetensors or a
/// directory of .npy files.
#[allow(clippy::too_many_arguments)]
fn run_case(
    test: &str,
    case: &Case,
    device: &str,
    kernel: &str,
    dtype: DType,
    layout: Layout,
    backward: bool,
    out_name: &str,
) {
    let dir = TempDir::new(&format!("{test}-{device}-{kernel}-{dtype}-{layout:?}-{backward}-{out_name}"));
    let out = dir.join(out_name);
    let mut args = case.write(&dir, dtype, layout, backward);
    args.extend(strings(&["--device", device, "--kernel", kernel, "--check", "--repeats", "2", "--warmup", "1"]));
    args.extend(["--out".to_string(), out.display().to_string()]);
    let context = format!("{device} {kernel} {dtype} {layout:?} backward={backward} {:?} → {out_name}", case.shape);
    run_attn(&args).unwrap_or_else(|e| panic!("{context}: {e}"));
    case.check_outputs(&out, dtype, backward, &context);
}

#[test]
fn attn_cpu_path_every_dtype_layout_and_mask() {
    let cases = [
        Case::new(gqa(2, 4, 2, 37, 29, 16), Causal::None, None, 1),
        Case::new(gqa(1, 3, 1, 23, 41, 8), Causal::TopLeft, Some(0.3), 11),
        Case::new(gqa(2, 2, 2, 30, 19, 24), Causal::BottomRight, None, 21),
    ];
    for (i, case) in cases.iter().enumerate() {
        for dtype in DType::ALL {
            for (j, layout) in [Layout::Npy, Layout::SafetensorsEach, Layout::OneFile].into_iter().enumerate() {
                let out = if (i + j) % 2 == 0 { "out.safetensors" } else { "out" };
                run_case("cpu", case, "cpu", "flash", dtype, layout, true, out);
            }
        }
    }
    // Forward only: no dO, so no gradients written.
    run_case("cpu", &cases[0], "cpu", "flash", DType::Bf16, Layout::Npy, false, "out");
    run_case("cpu", &cases[1], "cpu", "naive", DType::F32, Layout::OneFile, false, "out.safetensors");
}

#[test]
fn attn_rounds_inputs_to_the_requested_dtype() {
    let dir = TempDir::new("attn_dtype");
    let case = Case::new(gqa(1, 2, 1, 20, 20, 16), Causal::TopLeft, None, 5);
    let mut args = case.write(&dir, DType::F32, Layout::Npy, true);
    let out = dir.join("out");
    args.extend(strings(&["--dtype", "bf16", "--device", "cpu"]));
    args.extend(["--out".to_string(), out.display().to_string()]);
    run_attn(&args).unwrap();
    case.check_outputs(&out, DType::Bf16, true, "f32 files run as bf16");

    // Inputs of different types need --dtype.
    let mixed = dir.join("k_half.npy");
    io::write_npy(&mixed, &case.inputs[1].converted(DType::F16)).unwrap();
    let mut args = case.write(&dir, DType::F32, Layout::Npy, false);
    let k = args.iter().position(|a| a == "--k").unwrap();
    args[k + 1] = mixed.display().to_string();
    args.extend(strings(&["--device", "cpu"]));
    let error = run_attn(&args).unwrap_err();
    assert!(matches!(error, Error::Argument(_)), "{error}");
    assert!(error.to_string().contains("--dtype"), "{error}");
    args.extend(strings(&["--dtype", "f16"]));
    run_attn(&args).unwrap();
}

/// The kernels on the GPU: the f32 flash and naive kernels and the f16/bf16 tensor-core kernels,
/// at both tensor-core head dims, ragged lengths, GQA and every mask.
#[test]
fn attn_gpu_path() {
    let Some(ctx) = common::gpu("attn_gpu_path") else { return };
    let runs = [
        (gqa(2, 4, 2, 133, 97, 64), Causal::BottomRight, "flash", DType::F32, Layout::Npy, "out"),
        (gqa(2, 4, 2, 133, 97, 64), Causal::TopLeft, "naive", DType::F32, Layout::OneFile, "out.safetensors"),
        (gqa(1, 6, 2, 200, 200, 32), Causal::None, "flash", DType::F32, Layout::SafetensorsEach, "out"),
        (gqa(2, 4, 2, 133, 97, 64), Causal::BottomRight, "flash", DType::F16, Layout::Npy, "out.safetensors"),
        (gqa(1, 4, 1, 77, 150, 128), Causal::TopLeft, "flash", DType::Bf16, Layout::Npy, "out"),
        (gqa(2, 2, 2, 150, 150, 128), Causal::None, "flash", DType::F16, Layout::OneFile, "out"),
        (gqa(2, 4, 4, 129, 129, 64), Causal::TopLeft, "flash", DType::Bf16, Layout::SafetensorsEach, "out.safetensors"),
    ];
    for (i, (shape, causal, kernel, dtype, layout, out)) in runs.into_iter().enumerate() {
        if common::runs(ctx, dtype) {
            let case = Case::new(shape, causal, None, 100 + 10 * i as u64);
            run_case("gpu", &case, "0", kernel, dtype, layout, true, out);
        }
    }
    // Forward only.
    let case = Case::new(gqa(1, 2, 1, 65, 65, 64), Causal::None, Some(0.2), 200);
    let dtype = if common::runs(ctx, DType::Bf16) { DType::Bf16 } else { DType::F16 };
    run_case("gpu", &case, "0", "flash", dtype, Layout::Npy, false, "out");
}

/// The kernels' own code on the CPU emulator, on tiny shapes (one OS thread per GPU thread).
#[test]
fn attn_emulated_path() {
    let runs = [
        (gqa(1, 2, 1, 20, 24, 32), Causal::BottomRight, "flash", DType::F32),
        (gqa(1, 2, 1, 20, 24, 20), Causal::TopLeft, "naive", DType::F32),
        (gqa(1, 2, 1, 20, 17, 64), Causal::None, "flash", DType::Bf16),
    ];
    for (i, (shape, causal, kernel, dtype)) in runs.into_iter().enumerate() {
        let case = Case::new(shape, causal, None, 300 + 10 * i as u64);
        run_case("emulated", &case, "cpu-emulated", kernel, dtype, Layout::Npy, true, "out");
    }
}

/// `--documents` (with `--documents-k`: a varlen table) and `--prefix-lm` (a `MaskTable` on the
/// context that runs the kernels), checked against the reference on the emulator (f32 and bf16,
/// forward and backward) and on the CPU path; what cannot apply is refused before any device
/// work.
#[test]
fn attn_document_masks_and_prefix_lm() {
    let runs: [&[&str]; 6] = [
        &["--random", "2x2x40x32", "--documents", "7,20", "--causal", "top-left", "--device", "cpu-emulated"],
        &["--random", "1x2x1x40x40x64", "--dtype", "bf16", "--prefix-lm", "13", "--device", "cpu-emulated"],
        &["--random", "1x2x40x64", "--dtype", "f16", "--documents", "1,30", "--device", "cpu-emulated"],
        &["--random", "2x2x40x16", "--prefix-lm", "5", "--device", "cpu"],
        // Chunked prefill: 7 and 20 new queries against 15 and 0 keys, the rest 3 against 35.
        &["--random", "2x4x2x30x50x32", "--documents", "7,20", "--documents-k", "15,0", "--causal", "bottom-right"],
        &[
            "--random",
            "1x2x1x20x44x64",
            "--dtype",
            "bf16",
            "--documents",
            "9,0,11",
            "--documents-k",
            "30,4,10",
            "--window",
            "5,0",
            "--causal",
            "top-left",
            "--device",
            "cpu-emulated",
        ],
    ];
    for args in runs {
        run_attn(&strings(&[args, &["--check"]].concat())).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
    let refused = |args: &[&str], says: &str| {
        let error = run_attn(&strings(args)).unwrap_err().to_string();
        assert!(error.contains(says), "{args:?}: {error}");
    };
    refused(&["--random", "1x2x40x16", "--prefix-lm", "5", "--causal", "top-left", "--device", "cpu"], "causal");
    refused(&["--random", "1x2x40x16", "--documents", "30,30", "--device", "cpu"], "more than seqlen");
    refused(&["--random", "1x2x1x30x40x16", "--documents", "3", "--device", "cpu"], "seqlen_q = seqlen_k");
    refused(&["--random", "1x2x40x16", "--prefix-lm", "50", "--device", "cpu"], "longer than seqlen");
    let varlen = ["--random", "1x2x1x30x40x16", "--documents", "3,4", "--device", "cpu"];
    refused(&[&varlen[..], &["--documents-k", "3"]].concat(), "one per document");
    refused(&[&varlen[..], &["--documents-k", "3,40"]].concat(), "more than seqlen_k = 40");
    refused(&[&varlen[..], &["--documents-k", "3,4", "--alibi"]].concat(), "ALiBi");
}

#[test]
fn attn_errors_name_the_file_and_the_tensor() {
    let dir = TempDir::new("attn_errors");
    let case = Case::new(gqa(1, 4, 2, 16, 16, 16), Causal::None, None, 7);
    let base = case.write(&dir, DType::F32, Layout::Npy, true);
    let with = |extra: &[&str], replace: Option<(&str, &std::path::Path)>| {
        let mut args = base.clone();
        if let Some((flag, path)) = replace {
            let at = args.iter().position(|a| a == flag).unwrap();
            args[at + 1] = path.display().to_string();
        }
        args.extend(strings(extra));
        run_attn(&args)
    };

    // A rank-3 Q.
    let flat = dir.join("flat.npy");
    io::write_npy(&flat, &HostTensor::new("flat", &[4, 16, 16], random_normal(4 * 16 * 16, 1)).unwrap()).unwrap();
    let error = with(&["--device", "cpu"], Some(("--q", &flat))).unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, Error::TensorFile { .. }), "{message}");
    assert!(message.contains("flat.npy") && message.contains("`q`") && message.contains("expected 4"), "{message}");

    // dO of another shape than Q.
    let small = dir.join("small.npy");
    io::write_npy(&small, &HostTensor::new("s", &[1, 4, 8, 16], random_normal(4 * 8 * 16, 2)).unwrap()).unwrap();
    let message = with(&["--device", "cpu"], Some(("--do", &small))).unwrap_err().to_string();
    assert!(message.contains("small.npy") && message.contains("`do`"), "{message}");

    // K and V disagreeing (the library's shape check), a file of the wrong type, a missing file.
    let message = with(&["--device", "cpu"], Some(("--v", &small))).unwrap_err().to_string();
    assert!(message.contains("`k`") && message.contains("`v`"), "{message}");
    let text = dir.join("q.txt");
    std::fs::write(&text, "not a tensor").unwrap();
    let message = with(&["--device", "cpu"], Some(("--q", &text))).unwrap_err().to_string();
    assert!(message.contains("q.txt") && message.contains("`q`"), "{message}");
    let message = with(&["--device", "cpu"], Some(("--k", &dir.join("nowhere.npy")))).unwrap_err().to_string();
    assert!(message.contains("nowhere.npy") && message.contains("`k`"), "{message}");

    // One input file without v.
    let partial = dir.join("partial.safetensors");
    io::write_safetensors(&partial, &[case.inputs[0].clone(), case.inputs[1].clone()]).unwrap();
    let message =
        run_attn(&strings(&["--input", &partial.display().to_string(), "--device", "cpu"])).unwrap_err().to_string();
    assert!(message.contains("partial.safetensors") && message.contains("`v`"), "{message}");

    // The naive kernels are f32 only; the scale must be finite. These are refused before any device is opened, on every machine.
    let error = with(&["--kernel", "naive", "--dtype", "bf16"], None).unwrap_err();
    assert!(matches!(error, Error::Argument(_)) && error.to_string().contains("naive"), "{error}");
    let error = with(&["--scale", "inf", "--device", "cpu"], None).unwrap_err();
    assert!(matches!(error, Error::InvalidScale { .. }), "{error}");

    // Flags that clap refuses: --q with --input, no inputs at all, an unknown device.
    let parse = |args: &[&str]| Cli::try_parse_from(["rust-attention", "attn"].iter().chain(args)).map(|_| ());
    assert!(parse(&["--input", "a.safetensors", "--q", "q.npy"]).is_err());
    assert!(parse(&["--k", "k.npy", "--v", "v.npy"]).is_err());
    assert!(parse(&["--input", "a.safetensors", "--device", "tpu"]).is_err());
    assert!(parse(&["--input", "a.safetensors", "--device", "cpu-emulated"]).is_ok());
}

/// `--random SHAPE` draws Q, K, V and dO as `check::random_normal` with seeds SEED … SEED+3 (the
/// seeds `Case::new` uses), so the outputs can be checked against the reference on the same
/// inputs: on the CPU path with GQA and cross lengths, and a forward only on the emulator.
#[test]
fn attn_random_inputs() {
    let dir = TempDir::new("attn_random");
    let case = Case::new(gqa(1, 4, 2, 20, 27, 16), Causal::None, None, 5);
    let out = dir.join("out.safetensors");
    let out_flag = out.display().to_string();
    run_attn(&strings(&[
        "--random",
        "1x4x2x20x27x16",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--check",
        "--out",
        &out_flag,
    ]))
    .unwrap();
    case.check_outputs(&out, DType::F32, true, "--random on the CPU");

    let case = Case::new(gqa(1, 2, 2, 24, 24, 32), Causal::TopLeft, None, 0);
    let out = dir.join("emulated");
    let out_flag = out.display().to_string();
    let args = ["--random", "1x2x24x32", "--forward-only", "--causal", "top-left", "--device", "cpu-emulated"];
    run_attn(&strings(&[args.as_slice(), &["--check", "--out", &out_flag]].concat())).unwrap();
    case.check_outputs(&out, DType::F32, false, "--random on the emulator");
    // A 16-bit head_dim above 128 (two warps share each slice of the backward's rows) and one
    // between compiled ones, forward and backward, checked against the reference.
    // (Under the T4 profile the emulator has 64 KiB a block, which no tile above 192 fits.)
    let emulator = attn_host::Context::cpu_emulated();
    for (shape, head_dim) in [("1x1x9x200", 200), ("1x1x9x72", 72)] {
        let fits = |dq| common::fits(&emulator, DType::Bf16, head_dim, dq);
        let modes = [attn_host::DqAccumulation::Atomic, attn_host::DqAccumulation::Deterministic];
        if fits(None) && modes.into_iter().all(|mode| fits(Some(mode))) {
            run_attn(&strings(&["--random", shape, "--dtype", "bf16", "--device", "cpu-emulated", "--check"])).unwrap();
        }
    }

    // Shapes that are not problems are refused while parsing, saying why; --seed and
    // --forward-only without --random are refused before any file is read.
    let parse = |args: &[&str]| {
        Cli::try_parse_from(["rust-attention", "attn"].iter().chain(args)).map(|_| ()).map_err(|e| e.to_string())
    };
    for (shape, why) in [
        ("2x8x128", "has 3 dimensions"),
        ("2x8xax64", "`a` is not a whole number"),
        ("0x8x128x64", "at least 1"),
        ("1x3x2x8x8x64", "not a multiple"),
        ("99999999999x99999999999x1x1", "more than 2^32 elements"),
    ] {
        let message = parse(&["--random", shape]).unwrap_err();
        assert!(message.contains(why), "{shape}: {message}");
    }
    assert!(parse(&["--random", "1x2x8x64", "--q", "q.npy"]).is_err());
    for flag in [&["--seed", "3"][..], &["--forward-only"]] {
        let error = run_attn(&strings(&[&["--input", "a.safetensors"][..], flag].concat())).unwrap_err();
        assert!(matches!(error, Error::Argument(_)) && error.to_string().contains("--random"), "{error}");
    }
    assert!(parse(&["--random", "2X8×16x64", "--seed", "3", "--dtype", "bf16"]).is_ok());
}

/// `--bias`: every broadcast, on the emulator (the kernels' own code) with `--check` (a row off
/// the reference fails the job), dBias written with the bias's shape; the CPU reference writes
/// the same dBias; the naive kernels and softcapping refuse a bias before any device work.
#[test]
fn attn_bias() {
    let dir = TempDir::new("attn_bias");
    for (broadcast, dims) in [
        ("per-head", [1, 4, 24, 40]),
        ("per-batch", [2, 1, 24, 40]),
        ("shared", [1, 1, 24, 40]),
        ("full", [2, 4, 24, 40]),
    ] {
        let mut d_bias = Vec::new();
        for device in ["cpu-emulated", "cpu"] {
            let out = dir.join(&format!("{broadcast}-{device}.safetensors"));
            let out_flag = out.display().to_string();
            let args =
                ["--random", "2x4x2x24x40x32", "--dtype", "f16", "--causal", "bottom-right", "--bias", broadcast];
            run_attn(&strings(&[args.as_slice(), &["--device", device, "--check", "--out", &out_flag]].concat()))
                .unwrap_or_else(|e| panic!("--bias {broadcast} on {device}: {e}"));
            let written = io::read_safetensors(&out).unwrap();
            let found = written.iter().find(|t| t.name() == "d_bias").expect("d_bias written");
            assert_eq!(found.shape(), dims.as_slice(), "--bias {broadcast}: dBias's shape");
            d_bias.push(found.to_f32());
        }
        let error = relative_l2_error(&d_bias[0], &d_bias[1].iter().map(|&x| x as f64).collect::<Vec<_>>());
        assert!(error < 1e-2, "--bias {broadcast}: the emulator's dBias is {error:.1e} off the reference's");
    }
    for flags in [&["--kernel", "naive"][..], &["--softcap", "30"]] {
        let args = [&["--random", "1x2x16x32", "--bias", "per-head", "--device", "cpu"][..], flags].concat();
        let error = run_attn(&strings(&args)).unwrap_err();
        assert!(matches!(error, Error::Bias(_)), "{flags:?}: {error}");
    }
}

#!/usr/bin/env python3
"""Our kernels next to cuDNN and FlashAttention-2, in one run on one GPU, on the same shapes.

For every shape it times our forward and backward with `rust-attention attn --random` (CUDA
events, warm-up, median; a pass our kernels do not take gets an empty cell), then PyTorch SDPA's
cuDNN and FA2 backends on inputs of the same shape and distribution (torch.randn), and prints
one markdown table: TFLOP/s of each and our ratio to cuDNN.

    python3 benches/peers/side_by_side.py --ours target/release/rust-attention              # models
    python3 benches/peers/side_by_side.py --ours target/release/rust-attention --preset head-dims
    python3 benches/peers/side_by_side.py --ours target/release/rust-attention --shapes 1x64x8x2048x128:bf16:causal

(`cargo build --release` makes target/release/rust-attention; a binary built elsewhere and copied
to the GPU machine works the same way.)

Shapes are `BxHxNxD` or `BxHqxHkvxNxD` (GQA), then `:dtype`, then `:causal` for a causal
(top-left) mask: seqlen_q = seqlen_k = N. Presets: `models` (issue 20: ViT-B/16, ViT-L/14,
GPT-2, Llama-3-70B prefill, and the two benchmark shapes), `head-dims` (issue 21) and
`backward` (issue 23: the two benchmark shapes and Llama's GQA, each with and without a mask).
`--persistent` also times our forward with the Hopper forward's persistent grid forced off, on
with the static unit order, and on (RUST_ATTENTION_PERSISTENT=0/static/1), in extra columns; `--deterministic` our backward with
`--dq deterministic` (bit-identical dQ), next to our default mode, with its ratio to it. FLOPs: forward 4·B·Hq·N²·D, halved when
causal; backward 2.5× forward. GQA peers run with `enable_gqa=True`.

The first call of our binary also compiles its PTX for the GPU (the driver caches the result;
CUDA_CACHE_MAXSIZE may need raising).
"""
import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from merge import tflops  # noqa: E402  (beside this file)
from sdpa_bench import time_it  # noqa: E402

PRESETS = {
    "models": "256x12x197x64:f16,64x16x577x64:bf16,16x12x1024x64:f16:causal,1x64x8x16384x128:bf16:causal,"
              "8x12x197x64:f16,4x16x4096x64:f16,2x16x8192x128:bf16",
    "head-dims": "4x16x4096x40:f16,4x16x4096x80:f16,4x16x4096x96:f16,4x16x4096x160:f16,"
                 "4x16x4096x192:f16,2x16x4096x256:bf16,4x16x4096x64:f16,2x16x8192x128:bf16",
    "backward": "4x16x4096x64:f16,4x16x4096x64:f16:causal,2x16x8192x128:bf16,2x16x8192x128:bf16:causal,"
                "1x64x8x16384x128:bf16,1x64x8x16384x128:bf16:causal",
}


def parse(spec):
    """'BxHqxHkvxNxD:dtype[:causal]' -> (b, hq, hkv, n, d, dtype, causal)."""
    fields = spec.split(":")
    dims = [int(x) for x in fields[0].split("x")]
    if len(dims) == 4:
        dims = [dims[0], dims[1], dims[1], dims[2], dims[3]]
    if len(dims) != 5 or len(fields) < 2:
        sys.exit(f"shape {spec!r} is not BxHxNxD:dtype or BxHqxHkvxNxD:dtype[:causal]")
    return (*dims, fields[1], "causal" in fields[2:])


def flops(b, hq, n, d, causal, pass_):
    f = 4 * b * hq * n * n * d / (2 if causal else 1)
    return f * (2.5 if pass_ == "backward" else 1)


def ours(binary, case, warmup, repeats, env=None, forward_only=False, dq=None):
    """{pass: (TFLOP/s, kernel label)} of our kernels; a pass that fails or is not taken is left out."""
    b, hq, hkv, n, d, dtype, causal = case
    result = {}
    for only in ((True,) if forward_only else (False, True)):
        args = [binary, "attn", "--random", f"{b}x{hq}x{hkv}x{n}x{n}x{d}", "--dtype", dtype,
                "--causal", "top-left" if causal else "none", "--warmup", str(warmup), "--repeats", str(repeats)]
        args += ["--dq", dq] if dq else []
        run = subprocess.run(args + (["--forward-only"] if only else []), capture_output=True, text=True,
                             env={**os.environ, **(env or {})})
        # Table rows: | flash forward f16 (sm_90a m128_n128_s2) | 0.871 | 473.26 |
        for line in run.stdout.splitlines():
            m = re.match(r"\|\s*flash (forward|backward)[^|]*\(([^)]*)\)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)", line)
            if m:
                result[m.group(1)] = (float(m.group(4)), m.group(2))
        if run.returncode == 0:
            break  # both passes ran; otherwise retry the forward alone (e.g. a 16-bit backward above 128)
        if only:
            print(f"our binary failed on {case}: {run.stderr.strip()[-300:]}", file=sys.stderr)
    return result


def peers(cases, warmup, repeats):
    """{(case, backend, pass): TFLOP/s} of PyTorch SDPA's cuDNN and FA2 backends."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    found = {}
    for case in cases:
        b, hq, hkv, n, d, dtype, causal = case
        torch.manual_seed(0)
        make = lambda h: torch.randn(b, h, n, d, device="cuda", dtype=dtypes[dtype], requires_grad=True)
        q, k, v = make(hq), make(hkv), make(hkv)
        do = torch.randn_like(q)
        gqa = {"enable_gqa": True} if hkv != hq else {}
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        def forward(_):
            with torch.no_grad():
                run()

        def backward(out):
            torch.autograd.grad(out, (q, k, v), do)

        for backend, name in (("cudnn", "CUDNN_ATTENTION"), ("fa2", "FLASH_ATTENTION")):
            for pass_, fn, setup in (("forward", forward, lambda: None), ("backward", backward, run)):
                try:
                    with sdpa_kernel(getattr(SDPBackend, name)):
                        ms = time_it(torch, fn, setup, warmup, repeats)
                    found[(case, backend, pass_)] = tflops(flops(b, hq, n, d, causal, pass_), ms)
                except Exception as exc:  # a backend that does not take the case: an empty cell
                    print(f"{backend} {pass_} {case}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
                torch.cuda.empty_cache()
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True, help="path of the rust-attention binary")
    p.add_argument("--preset", choices=sorted(PRESETS), default="models")
    p.add_argument("--shapes", help="comma list of shapes (see above), in place of the preset's")
    p.add_argument("--persistent", action="store_true", help="also time our forward with the persistent grid off and on")
    p.add_argument("--deterministic", action="store_true", help="also time our backward with deterministic dQ")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cases = [parse(s) for s in (args.shapes or PRESETS[args.preset]).split(",") if s]
    mine = {c: ours(args.ours, c, args.warmup, args.repeats) for c in cases}
    grids = {}
    if args.persistent:
        for c in cases:
            for flag in ("0", "static", "1"):
                got = ours(args.ours, c, args.warmup, args.repeats, {"RUST_ATTENTION_PERSISTENT": flag}, True)
                grids[(c, flag)] = got.get("forward", (None, ""))[0]
    deterministic = {}
    if args.deterministic:
        for c in cases:
            deterministic[c] = ours(args.ours, c, args.warmup, args.repeats, dq="deterministic").get("backward")
    theirs = peers(cases, args.warmup, args.repeats)
    extra = " fwd plain grid | fwd persistent static | fwd persistent |" if args.persistent else ""
    extra += " bwd deterministic (kernel) | ÷ default | ÷ cuDNN |" if args.deterministic else ""
    print(f"| shape [B, Hq, Hkv, N, D] | dtype | mask | pass | ours (kernel) | cuDNN | FA2 | ours ÷ cuDNN |{extra}")
    print("|---|---|---|---|---|---:|---:|---:|" + ("---:|---:|---:|" if args.persistent else "")
          + ("---|---:|---:|" if args.deterministic else ""))
    cell = lambda x: f"{x:.1f}" if x is not None else "—"
    for c in cases:
        b, hq, hkv, n, d, dtype, causal = c
        for pass_ in ("forward", "backward"):
            cudnn, fa2 = theirs.get((c, "cudnn", pass_)), theirs.get((c, "fa2", pass_))
            tf, kernel = mine[c].get(pass_, (None, "not taken"))
            ratio = f"{tf / cudnn:.2f}" if tf and cudnn else "—"
            more = ""
            if args.persistent:
                more = (f" {cell(grids[(c, '0')])} | {cell(grids[(c, 'static')])} | {cell(grids[(c, '1')])} |"
                        if pass_ == "forward" else " | | |")
            if args.deterministic:
                det, det_kernel = deterministic.get(c) or (None, "not taken")
                if pass_ == "backward":
                    more += (f" {cell(det)} ({det_kernel}) | {f'{det / tf:.2f}' if det and tf else '—'} "
                             f"| {f'{det / cudnn:.2f}' if det and cudnn else '—'} |")
                else:
                    more += " | | |"
            print(f"| [{b}, {hq}, {hkv}, {n}, {d}] | {dtype} | {'causal' if causal else 'none'} | {pass_} "
                  f"| {cell(tf)} ({kernel}) | {cell(cudnn)} | {cell(fa2)} | {ratio} |{more}")


if __name__ == "__main__":
    main()

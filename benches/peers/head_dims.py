#!/usr/bin/env python3
"""Our kernels next to cuDNN and FlashAttention-2 across head dims, in one run on one GPU.

For every shape (default: the head dims models run, issue 21) it times our forward and backward
with the `rust-attention attn --random` command (CUDA events, warm-up, median; a pass our kernels
do not take gets an empty cell), then PyTorch SDPA's cuDNN and FA2 backends through
`sdpa_bench.py` on inputs of the same shape and distribution, and prints one markdown table:
TFLOP/s of each and our ratio to cuDNN.

    python3 benches/peers/head_dims.py --ours .gpu/bin/rust-attention            # on the GPU machine
    python3 benches/peers/head_dims.py --ours target/release/rust-attention --shapes 4x16x4096x96:f16

Shapes are BxHxNxD:dtype (seqlen_q = seqlen_k = N, no mask). The first call of our binary also
compiles its PTX for the GPU (the driver caches the result; CUDA_CACHE_MAXSIZE may need raising).
"""
import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = ("4x16x4096x40:f16,4x16x4096x80:f16,4x16x4096x96:f16,4x16x4096x160:f16,"
                  "4x16x4096x192:f16,2x16x4096x256:bf16,4x16x4096x64:f16,2x16x8192x128:bf16")


def ours(binary, shape, dtype, warmup, repeats):
    """{pass: TFLOP/s} of our kernels; a pass that fails or is not taken is left out."""
    result = {}
    for forward_only in (False, True):
        args = [binary, "attn", "--random", shape, "--dtype", dtype, "--warmup", str(warmup),
                "--repeats", str(repeats)] + (["--forward-only"] if forward_only else [])
        run = subprocess.run(args, capture_output=True, text=True)
        # Table rows: | flash forward f16 (sm_90a m128_n128_s2) | 0.871 | 473.26 |
        for line in run.stdout.splitlines():
            m = re.match(r"\|\s*flash (forward|backward)[^|]*\(([^)]*)\)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)", line)
            if m:
                result[m.group(1)] = (float(m.group(4)), m.group(2))
        if run.returncode == 0:
            break  # both passes ran; otherwise retry the forward alone (e.g. a 16-bit backward above 128)
    return result


def peers(shapes, warmup, repeats):
    """{(shape, dtype, backend, pass): TFLOP/s} from sdpa_bench.py, one call per dtype."""
    found = {}
    by_dtype = {}
    for shape, dtype in shapes:
        by_dtype.setdefault(dtype, []).append(shape)
    for dtype, group in by_dtype.items():
        with tempfile.NamedTemporaryFile(suffix=".csv") as out:
            subprocess.run([sys.executable, os.path.join(HERE, "sdpa_bench.py"), "--shapes", ",".join(group),
                            "--dtype", dtype, "--warmup", str(warmup), "--repeats", str(repeats), "--out", out.name],
                           check=True, stdout=subprocess.DEVNULL)
            for row in csv.DictReader(open(out.name)):
                shape = f"{row['batch']}x{row['heads']}x{row['seqlen_q']}x{row['head_dim']}"
                if row["status"] == "ok":
                    found[(shape, dtype, row["backend"], row["pass"])] = float(row["tflops"])
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True, help="path of the rust-attention binary")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxHxNxD:dtype")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    shapes = [tuple(s.split(":")) for s in args.shapes.split(",") if s]
    mine = {(s, d): ours(args.ours, s, d, args.warmup, args.repeats) for s, d in shapes}
    theirs = peers(shapes, args.warmup, args.repeats)
    print("| shape [B, H, N, D] | dtype | pass | ours (kernel) | cuDNN | FA2 | ours ÷ cuDNN |")
    print("|---|---|---|---|---:|---:|---:|")
    for shape, dtype in shapes:
        for pass_ in ("forward", "backward"):
            cudnn, fa2 = theirs.get((shape, dtype, "cudnn", pass_)), theirs.get((shape, dtype, "fa2", pass_))
            tf, kernel = mine[(shape, dtype)].get(pass_, (None, "not taken"))
            cell = lambda x: f"{x:.1f}" if x is not None else "—"
            ratio = f"{tf / cudnn:.2f}" if tf and cudnn else "—"
            print(f"| [{shape.replace('x', ', ')}] | {dtype} | {pass_} | {cell(tf)} ({kernel}) | {cell(cudnn)} "
                  f"| {cell(fa2)} | {ratio} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Sliding windows (local attention): our kernels next to FlexAttention and cuDNN, in one run.

For every row, a causal window of W keys (each query sees itself and the W - 1 before it,
Mistral's `sliding_window`), it times, on inputs of the same shape and distribution:

* ours with the window (`rust-attention attn --random ... --causal bottom-right --window W-1,0`)
  and ours with the plain causal mask, which shows what the window saves (a window of W keys
  should cost time in proportion to W, not to the sequence);
* PyTorch's FlexAttention (`torch.nn.attention.flex_attention`, compiled, with the block mask of
  the same window, so that it skips hidden tiles too), the peer that has the feature;
* cuDNN through SDPA with the plain causal mask (SDPA takes no window; a dense `attn_mask` would
  cost more than the causal run), the time a user without windows pays.

It prints a markdown table: milliseconds (CUDA events, warm-up, median) of each forward and
backward, TFLOP/s counted on the visible pairs, and our ratio to FlexAttention.

    python3 benches/peers/windows.py --ours target/release/rust-attention
    python3 benches/peers/windows.py --ours .gpu/bin/rust-attention --rows 1x32x8x16384x128:bf16:w512

Rows are `BxHqxHkvxNxD:dtype:wW` (seqlen_q = seqlen_k = N).
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_bench import our_times, row_arguments, time_it  # noqa: E402  (beside this file)

ROWS = "1x32x8x16384x128:bf16:w512,1x32x8x16384x128:bf16:w4096,4x16x16x4096x64:f16:w1024"


def parse(spec):
    fields = spec.split(":")
    b, hq, hkv, n, d = (int(x) for x in fields[0].split("x"))
    w = next(int(f[1:]) for f in fields[2:] if re.fullmatch(r"w\d+", f))
    return b, hq, hkv, n, d, fields[1], w


def visible_pairs(n, w):
    """Pairs (i, j) with i - w < j <= i: min(i + 1, w) keys for query i."""
    return sum(min(i + 1, w) for i in range(n))


def ours(binary, row, window, warmup, repeats):
    """{pass: ms} of our kernels, with the causal window of `window` keys or (None) the plain causal mask."""
    b, hq, hkv, n, d, dtype, _ = row
    args = [binary, "attn", "--random", f"{b}x{hq}x{hkv}x{n}x{n}x{d}", "--dtype", dtype, "--causal", "bottom-right",
            "--warmup", str(warmup), "--repeats", str(repeats)]
    if window:
        args += ["--window", f"{window - 1},0"]
    return our_times(args, row)


def peers(row, warmup, repeats):
    """{(peer, pass): ms} of FlexAttention with the window and cuDNN with the plain causal mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, hq, hkv, n, d, dtype, w = row
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    make = lambda h: torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    q, k, v = make(hq), make(hkv), make(hkv)
    do = torch.randn_like(q)
    gqa = hkv != hq
    found = {}

    def window_mask(_b, _h, i, j):
        return (j <= i) & (i - j < w)

    block_mask = create_block_mask(window_mask, None, None, n, n, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    runs = {
        "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa),
        "cudnn causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
    }
    for name, run in runs.items():
        def forward(_):
            with torch.no_grad():
                run()

        def backward(out):
            torch.autograd.grad(out, (q, k, v), do)

        for pass_, fn, setup in (("forward", forward, lambda: None), ("backward", backward, run)):
            try:
                if name == "flex":
                    found[(name, pass_)] = time_it(torch, fn, setup, warmup, repeats)
                else:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        found[(name, pass_)] = time_it(torch, fn, setup, warmup, repeats)
            except Exception as exc:  # a peer that does not take the row: an empty cell
                print(f"{name} {pass_} {row}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        torch.cuda.empty_cache()
    return found


def main():
    args = row_arguments(__doc__, ROWS, warmup=5, repeats=20).parse_args()
    rows = [parse(s) for s in args.rows.split(",") if s]
    print("| shape [B, Hq, Hkv, N, D] | dtype | window | pass | ours (ms) | TFLOP/s | ours causal, no window (ms) "
          "| FlexAttention (ms) | cuDNN causal, no window (ms) | ours ÷ Flex time |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        b, hq, hkv, n, d, dtype, w = row
        mine, causal, theirs = ours(args.ours, row, w, args.warmup, args.repeats), \
            ours(args.ours, row, None, args.warmup, args.repeats), peers(row, args.warmup, args.repeats)
        for pass_ in ("forward", "backward"):
            flops = 4 * b * hq * d * visible_pairs(n, w) * (2.5 if pass_ == "backward" else 1)
            ms = mine.get(pass_)
            cell = lambda x: f"{x:.3f}" if x else ""
            tflops = f"{flops / ms / 1e9:.1f}" if ms else ""
            flex = theirs.get(("flex", pass_))
            ratio = f"{ms / flex:.2f}" if ms and flex else ""
            print(f"| [{b}, {hq}, {hkv}, {n}, {d}] | {dtype} | {w} | {pass_} | {cell(ms)} | {tflops} "
                  f"| {cell(causal.get(pass_))} | {cell(flex)} | {cell(theirs.get(('cudnn causal', pass_)))} | {ratio} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

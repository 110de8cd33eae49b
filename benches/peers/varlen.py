#!/usr/bin/env python3
"""Variable-length batches: our kernels on a packed batch next to cuDNN on the same batch padded
to its longest sequence, and FlashAttention-2's own varlen forward, in one run (issue 22's goal).

A batch of `--batch` sequences with lengths drawn uniformly from `--min`..`--max` (seeded) is
packed end to end into one row; we run it with a document mask (`rust-attention attn --documents`:
the kernels skip every key tile of another sequence), and, when the `rust_attention` wheel is
installed, through the PyTorch bridge's `attention_varlen` (`[total, H, D]` in and out, which adds
a transposition each way). The peers: PyTorch SDPA's cuDNN backend on `[B, H, longest, D]` (the
padded batch, what a framework without varlen runs; timed without a key-padding mask, which would
only add to its time) and `torch.ops.aten._flash_attention_forward`
with `cu_seqlens` (FA2's varlen forward, which PyTorch ships). CUDA events, warm-up, median.

TFLOP/s are counted on the real tokens, Σ 4·H·L²·D (half of it causal; backward 2.5×), for every
column, so the columns compare time for the same useful work; the padded run's own rate on its
padded work is printed beside it.

    python3 benches/peers/varlen.py --ours .gpu/bin/rust-attention
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_bench import our_times, time_it  # noqa: E402  (beside this file)


def real_flops(lengths, h, d, causal, pass_):
    f = sum(4 * h * n * n * d for n in lengths) / (2 if causal else 1)
    return f * (2.5 if pass_ == "backward" else 1)


def ours(binary, lengths, h, d, dtype, causal, warmup, repeats):
    """{pass: ms} of the kernels on the packed row (`attn --documents`)."""
    total = sum(lengths)
    args = [binary, "attn", "--random", f"1x{h}x{h}x{total}x{total}x{d}", "--dtype", dtype,
            "--causal", "top-left" if causal else "none", "--documents", ",".join(map(str, lengths)),
            "--warmup", str(warmup), "--repeats", str(repeats)]
    return our_times(args, f"the packed row of {len(lengths)} sequences")


def peers(lengths, h, d, dtype, causal, warmup, repeats):
    """{(column, pass): ms} of the bridge, cuDNN padded and FA2 varlen."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    packed = lambda: torch.randn(total, h, d, device="cuda", dtype=t, requires_grad=True)
    q, k, v = packed(), packed(), packed()
    do = torch.randn_like(q)
    found = {}

    def both(name, run, args, grad):
        def forward(_):
            with torch.no_grad():
                run()

        def backward(out):
            torch.autograd.grad(out, args, grad)

        for pass_, fn, setup in (("forward", forward, lambda: None), ("backward", backward, run)):
            try:
                found[(name, pass_)] = time_it(torch, fn, setup, warmup, repeats)
            except Exception as exc:
                print(f"{name} {pass_}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
            torch.cuda.empty_cache()

    try:
        import rust_attention as ra
        cu_host = cu.cpu()  # offsets on the host, as a training loop keeps them: no synchronisation
        both("bridge", lambda: ra.attention_varlen(q, k, v, cu_host, is_causal=causal), (q, k, v), do)
    except ImportError:
        print("rust_attention is not installed: no bridge column", file=sys.stderr)
    padded = lambda: torch.randn(b, h, longest, d, device="cuda", dtype=t, requires_grad=True)
    qp, kp, vp = padded(), padded(), padded()
    do_padded = torch.randn_like(qp)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        both("cudnn padded", lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal), (qp, kp, vp),
             do_padded)
    try:
        fa2 = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False)
        with torch.no_grad():
            found[("fa2 varlen", "forward")] = time_it(torch, lambda _: fa2(), lambda: None, warmup, repeats)
    except Exception as exc:
        print(f"fa2 varlen: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True, help="path of the rust-attention binary")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min", type=int, default=128)
    p.add_argument("--max", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("f16", "bf16"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    rng = random.Random(a.seed)
    lengths = [rng.randint(a.min, a.max) for _ in range(a.batch)]
    longest = max(lengths)
    print(f"{a.batch} sequences of {a.min}-{a.max} tokens (seed {a.seed}): {sum(lengths)} tokens, longest {longest}; "
          f"H = {a.heads}, D = {a.head_dim}, {a.dtype}; TFLOP/s on the real tokens")
    print()
    print("| mask | pass | ours ms | TFLOP/s | bridge ms | cuDNN padded ms | TFLOP/s | (on padded work) "
          "| FA2 varlen ms | padded ÷ ours (time) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for causal in (False, True):
        mine = ours(a.ours, lengths, a.heads, a.head_dim, a.dtype, causal, a.warmup, a.repeats)
        theirs = peers(lengths, a.heads, a.head_dim, a.dtype, causal, a.warmup, a.repeats)
        for pass_ in ("forward", "backward"):
            flops = real_flops(lengths, a.heads, a.head_dim, causal, pass_)
            padded_flops = real_flops([longest] * a.batch, a.heads, a.head_dim, causal, pass_)
            ms = lambda key: theirs.get((key, pass_))
            cell = lambda x, f="{:.3f}": "" if x is None else f.format(x)
            rate = lambda t, work=flops: None if t is None else work / (t * 1e-3) / 1e12
            o, c = mine.get(pass_), ms("cudnn padded")
            print(f"| {'causal' if causal else 'none'} | {pass_} | {cell(o)} | {cell(rate(o), '{:.1f}')} "
                  f"| {cell(ms('bridge'))} | {cell(c)} | {cell(rate(c), '{:.1f}')} "
                  f"| {cell(rate(c, padded_flops), '{:.1f}')} | {cell(ms('fa2 varlen'))} "
                  f"| {cell(None if o is None or c is None else c / o, '{:.2f}')} |")


if __name__ == "__main__":
    main()

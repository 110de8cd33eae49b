#!/usr/bin/env python3
"""Decoding from a KV cache: our split-KV decoder next to cuDNN and FlashAttention-2, in one run.

For every row it times `rust-attention decode` (CUDA events, warm-up, median; the cache
contiguous, or paged with `:pN`), then, on inputs of the same shape and distribution
(torch.randn): PyTorch SDPA's cuDNN and FLASH (FA2) backends on q [B, Hq, Sq, D] against the
whole cache k, v [B, Hkv, Sk, D] (`enable_gqa` for GQA), the copy bandwidth of the device (a
device-to-device copy of the same bytes, the ceiling), and `flash_attn_with_kvcache` when the
flash_attn package is installed. It prints one markdown table: GB/s of K and V read
(2 · B · Sk · Hkv · D · 2 bytes over the median time) and our ratios to cuDNN and the copy.

    python3 benches/peers/decode.py --ours target/release/rust-attention
    python3 benches/peers/decode.py --ours .gpu/bin/rust-attention --rows 8x32x8x1x8192x128:bf16:p64

Rows are `BxHqxHkvxSqxSkxD:dtype`, then `:pN` for a paged cache of N-token pages (ours only; the
peers read the contiguous cache) and `:causal` for a bottom-right causal mask with Sq > 1.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_bench import row_arguments, time_it  # noqa: E402  (beside this file)

ROWS = ("8x32x8x1x8192x128:bf16,1x32x32x1x32768x128:bf16,"
        "1x64x8x1x131072x128:bf16,64x32x8x1x1024x128:bf16,16x32x8x4x4096x128:bf16:causal,"
        "32x32x8x1x2048x64:f16,4x16x16x1x16384x256:bf16,"
        "8x32x8x1x8192x128:bf16:p64,8x32x8x1x8192x128:bf16:p16,1x32x32x1x32768x128:bf16:p256")


def parse(spec):
    fields = spec.split(":")
    b, hq, hkv, sq, sk, d = (int(x) for x in fields[0].split("x"))
    page = next((int(f[1:]) for f in fields[2:] if re.fullmatch(r"p\d+", f)), None)
    return b, hq, hkv, sq, sk, d, fields[1], page, "causal" in fields[2:]


def kv_bytes(b, hkv, sk, d):
    return 2 * b * sk * hkv * d * 2


def ours(binary, row, warmup, repeats):
    b, hq, hkv, sq, sk, d, dtype, page, causal = row
    args = [binary, "decode", "--batch", str(b), "--heads", str(hq), "--kv-heads", str(hkv), "--seqlen-q", str(sq),
            "--cache-len", str(sk), "--head-dim", str(d), "--dtype", dtype, "--warmup", str(warmup),
            "--repeats", str(repeats)]
    if page:
        args += ["--page-size", str(page)]
    if causal:
        args += ["--causal", "bottom-right"]
    run = subprocess.run(args, capture_output=True, text=True)
    m = re.search(r"RESULT decode us=([\d.]+) gbps=([\d.]+) label=(\S+)", run.stdout)
    if not m:
        print(f"our binary failed on {row}: {run.stderr.strip()[-300:]}", file=sys.stderr)
        return None, ""
    return float(m.group(2)), m.group(3).replace("_", " ")


def peers(rows, warmup, repeats):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None

    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    found = {}
    for row in rows:
        b, hq, hkv, sq, sk, d, dtype, page, causal = row
        gb = kv_bytes(b, hkv, sk, d) / 1e9
        torch.manual_seed(0)
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtypes[dtype])
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtypes[dtype])
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtypes[dtype])
        gqa = {"enable_gqa": True} if hkv != hq else {}
        # Bottom-right causal over the cache: an explicit mask would change the backend; SDPA's
        # is_causal is top-left, so causal rows time the peers unmasked (Sq ≤ 8: the same work).
        run = lambda _: F.scaled_dot_product_attention(q, k, v, **gqa)
        for backend, name in (("cudnn", "CUDNN_ATTENTION"), ("fa2", "FLASH_ATTENTION")):
            try:
                with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, name)):
                    ms = time_it(torch, run, lambda: None, warmup, repeats)
                found[(row, backend)] = gb / (ms * 1e-3)
            except Exception as exc:
                print(f"{backend} {row}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        if flash_attn_with_kvcache is not None:
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
            try:
                ms = time_it(torch, lambda _: flash_attn_with_kvcache(qt, kt, vt, cache_seqlens=lens, causal=causal),
                             lambda: None, warmup, repeats)
                found[(row, "fa_kvcache")] = gb / (ms * 1e-3)
            except Exception as exc:
                print(f"flash_attn_with_kvcache {row}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        dst = torch.empty_like(k)
        both = torch.cat([k.flatten(), v.flatten()])
        dst2 = torch.empty_like(both)
        ms = time_it(torch, lambda _: dst2.copy_(both), lambda: None, warmup, repeats)
        # A copy reads and writes: its bandwidth counts both, as the device's memory moves them.
        found[(row, "copy")] = 2 * gb / (ms * 1e-3)
        del q, k, v, dst, both, dst2
        torch.cuda.empty_cache()
    return found


def main():
    args = row_arguments(__doc__, ROWS, warmup=10, repeats=50).parse_args()
    rows = [parse(s) for s in args.rows.split(",") if s]
    mine = {r: ours(args.ours, r, args.warmup, args.repeats) for r in rows}
    theirs = peers(rows, args.warmup, args.repeats)
    cell = lambda x: f"{x:.0f}" if x is not None else "—"
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "—"
    print("| decode [B, Hq, Hkv, Sq, Sk, D] | dtype | cache | ours (kernel) | cuDNN | FA2 | fa kvcache | copy | ours ÷ cuDNN | ours ÷ copy |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b, hq, hkv, sq, sk, d, dtype, page, causal = r
        gbps, label = mine[r]
        cudnn, fa2, fak, copy = (theirs.get((r, x)) for x in ("cudnn", "fa2", "fa_kvcache", "copy"))
        cache = (f"pages of {page}" if page else "contiguous") + (", causal" if causal else "")
        print(f"| [{b}, {hq}, {hkv}, {sq}, {sk}, {d}] | {dtype} | {cache} | {cell(gbps)} ({label}) | {cell(cudnn)} | "
              f"{cell(fa2)} | {cell(fak)} | {cell(copy)} | {ratio(gbps, cudnn)} | {ratio(gbps, copy)} |")


if __name__ == "__main__":
    main()

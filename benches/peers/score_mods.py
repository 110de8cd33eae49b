#!/usr/bin/env python3
"""Score modifications (softcapping, ALiBi, an additive bias) and attention sinks: our kernels next
to FlexAttention and cuDNN, in one run.

For every row it times, on inputs of the same shape and distribution (CUDA events, warm-up,
median), the forward and the backward of:

* ours with the modification (`rust-attention attn --random ... --softcap CAP`, `--alibi` or
  `--bias per-head`) and
  ours without it, which shows what the modification costs (the goal: within 10 %);
* PyTorch's FlexAttention (`torch.nn.attention.flex_attention`, compiled) with the same
  `score_mod` (`cap * tanh(score / cap)`, or `score - slope[h] * |i - j|` with the paper's
  slopes) and the causal block mask where the row is causal: the peer that has both features;
* for ALiBi, SDPA with the bias as a dense additive `attn_mask` ([1, H, N, N], the causal mask
  folded in as -inf), on cuDNN where it takes one, else the memory-efficient backend: how a
  PyTorch user without FlexAttention adds ALiBi;
* for a bias (one learned `[H, N, N]` plane per head, as Swin's or T5's position bias, shared by
  the batch entries; random normal, `f32` in ours and FlexAttention, the inputs' type in SDPA,
  which takes no other), FlexAttention with `score + bias[h, i, j]` and SDPA with the bias as
  `attn_mask` (cuDNN where it takes one, else the memory-efficient backend); in the backward
  every one of them returns dBias too;
* cuDNN through SDPA without the modification: the time of plain attention on this shape.

Attention sinks (one logit per head that joins each row's softmax, GPT-OSS) have no peer that
takes them whole; the rows time what a PyTorch user writes: FlexAttention returning its LSE, and
cuDNN's attention op (`aten._scaled_dot_product_cudnn_attention`, which returns the LSE; K and V
repeated for GQA), each followed by the sink's correction `O · sigmoid(LSE − sink)` (a peer whose
LSE takes no gradient has an empty backward cell).

    python3 benches/peers/score_mods.py --ours .gpu/bin/rust-attention
    python3 benches/peers/score_mods.py --ours target/release/rust-attention --rows 1x16x8x8192x256:bf16:causal:softcap50

Rows are `BxHqxHkvxNxD:dtype:causal|full:softcapCAP|alibi|sinks|bias` (seqlen_q = seqlen_k = N).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_bench import our_times, row_arguments, time_it  # noqa: E402  (beside this file)

ROWS = ",".join([
    "4x16x16x4096x64:f16:causal:softcap50",
    "2x16x16x8192x128:bf16:causal:softcap50",
    "1x16x8x8192x256:bf16:causal:softcap50",
    "4x16x16x4096x64:f16:causal:alibi",
    "2x32x32x4096x128:bf16:causal:alibi",
    "4x16x16x4096x64:f16:full:alibi",
    "1x64x8x4096x64:bf16:causal:sinks",
    "4x16x16x4096x64:f16:causal:sinks",
    "2x16x16x8192x128:bf16:causal:sinks",
    "4x16x16x4096x64:f16:causal:bias",
    "2x16x16x4096x128:bf16:full:bias",
])

# The sink our rows use (every head): its value does not change the time.
SINK = 1.0


def parse(spec):
    shape, dtype, mask, mod = spec.split(":")
    b, hq, hkv, n, d = (int(x) for x in shape.split("x"))
    cap = float(mod[len("softcap"):]) if mod.startswith("softcap") else None
    if cap is None and mod not in ("alibi", "sinks", "bias"):
        raise SystemExit(f"{spec}: the modification is softcapCAP, alibi, sinks or bias")
    # The modification: the cap (a float), "alibi", "sinks" or "bias".
    return b, hq, hkv, n, d, dtype, mask == "causal", cap if cap is not None else mod


def slopes(h):
    """ALiBi's slopes (Press et al. 2022; BLOOM's completion for head counts off the powers of two)."""
    n = 1 << (h.bit_length() - 1)
    return [2 ** (-8 * (i + 1) / n) for i in range(n)] + [2 ** (-8 * (2 * i + 1) / (2 * n)) for i in range(h - n)]


def ours(binary, row, modified, warmup, repeats):
    """{pass: ms} of our kernels, with the row's modification or (modified=False) without."""
    b, hq, hkv, n, d, dtype, causal, mod = row
    args = [binary, "attn", "--random", f"{b}x{hq}x{hkv}x{n}x{n}x{d}", "--dtype", dtype,
            "--causal", "bottom-right" if causal else "none", "--warmup", str(warmup), "--repeats", str(repeats)]
    if modified:
        args += {"alibi": ["--alibi"], "sinks": ["--sinks", str(SINK)], "bias": ["--bias", "per-head"]}.get(
            mod, ["--softcap", str(mod)])
    return our_times(args, row)


def peers(row, warmup, repeats):
    """{(peer, pass): ms} of FlexAttention and SDPA (see the module docs)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Every row and pass compiles its own FlexAttention kernels: past dynamo's default of 8
    # recompilations it would fall back to the unfused implementation.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    b, hq, hkv, n, d, dtype, causal, mod = row
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    make = lambda h: torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    q, k, v = make(hq), make(hkv), make(hkv)
    do = torch.randn_like(q)
    gqa = hkv != hq
    slope = torch.tensor(slopes(hq), device="cuda", dtype=torch.float32)
    sink = torch.full((hq,), SINK, device="cuda", dtype=torch.float32, requires_grad=True)
    # The learned bias of the "bias" rows, and its copy in the inputs' type for SDPA, with the
    # causal mask folded in as -inf (SDPA takes a float mask or is_causal, not both).
    plane = plane_dt = None
    if mod == "bias":
        plane = torch.randn(hq, n, n, device="cuda", dtype=torch.float32, requires_grad=True)
        plane_dt = plane.detach().to(dt)
        if causal:
            i = torch.arange(n, device="cuda")
            plane_dt = plane_dt.masked_fill(i[None, None, :] > i[None, :, None], float("-inf"))
        plane_dt = plane_dt[None].clone().requires_grad_()
    # What the backward differentiates besides Q, K and V.
    extra = {"sinks": (sink,), "bias": (plane, plane_dt)}.get(mod, ())

    if mod == "alibi":
        def score_mod(score, _b, h, i, j):
            return score - slope[h] * (i - j).abs()
    elif mod == "bias":
        def score_mod(score, _b, h, i, j):
            return score + plane[h, i, j]
    elif mod != "sinks":
        cap = mod

        def score_mod(score, _b, _h, _i, _j):
            return cap * torch.tanh(score / cap)

    def with_sink(o, lse):
        """O over the keys and the sink: O · e^(LSE − ln(e^LSE + e^sink)) = O · sigmoid(LSE − sink)."""
        lse = lse.reshape(o.shape[:3])  # cuDNN's op returns it as [B, H, N, 1]
        return o * torch.sigmoid(lse.float() - sink[None, :, None]).to(o.dtype)[..., None]

    block_mask = create_block_mask(lambda _b, _h, i, j: j <= i, None, None, n, n, device="cuda") if causal else None
    flex = torch.compile(flex_attention, dynamic=False)
    if mod == "sinks":
        kv = lambda t: t.repeat_interleave(hq // hkv, dim=1) if gqa else t

        def cudnn_sinks():
            o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv(k), kv(v), None, True, 0.0, causal)[:2]
            return with_sink(o, lse)

        runs = {
            "flex": (lambda: with_sink(*flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)), None),
            "cudnn sinks": (cudnn_sinks, None),
        }
    else:
        runs = {"flex": (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa), None)}
    if mod == "alibi":
        i = torch.arange(n, device="cuda")
        bias = -(slope[:, None, None] * (i[:, None] - i[None, :]).abs()).to(dt)[None]
        if causal:
            bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
        kv = lambda t: t.repeat_interleave(hq // hkv, dim=1) if gqa else t
        runs["sdpa bias"] = (lambda: F.scaled_dot_product_attention(q, kv(k), kv(v), attn_mask=bias),
                             [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    if mod == "bias":
        kv = lambda t: t.repeat_interleave(hq // hkv, dim=1) if gqa else t
        runs["sdpa bias"] = (lambda: F.scaled_dot_product_attention(q, kv(k), kv(v), attn_mask=plane_dt),
                             [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    runs["cudnn plain"] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                           [SDPBackend.CUDNN_ATTENTION])
    found = {}
    for name, (run, backends) in runs.items():
        def forward(_):
            with torch.no_grad():
                run()

        def backward(out):
            # (A peer does not use every extra input, the plain one none: allow_unused.)
            torch.autograd.grad(out, (q, k, v, *extra), do, allow_unused=True)

        for pass_, fn, setup in (("forward", forward, lambda: None), ("backward", backward, run)):
            for backend in backends or [None]:
                try:
                    if backend is None:
                        found[(name, pass_)] = time_it(torch, fn, setup, warmup, repeats)
                    else:
                        with sdpa_kernel(backend):
                            found[(name, pass_)] = time_it(torch, fn, setup, warmup, repeats)
                        found[(name, "backend")] = backend.name.split("_")[0].lower()
                    break
                except Exception as exc:  # a peer that does not take the row: try the next, else an empty cell
                    print(f"{name} {backend} {pass_} {row[:7]}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        torch.cuda.empty_cache()
    return found


def main():
    args = row_arguments(__doc__, ROWS, warmup=5, repeats=20).parse_args()
    rows = [parse(s) for s in args.rows.split(",") if s]
    print("| shape [B, Hq, Hkv, N, D] | dtype | mask | modification | pass | ours (ms) | TFLOP/s "
          "| ours, no modification (ms) | cost | FlexAttention (ms) | SDPA + bias, or cuDNN + sink (ms) "
          "| cuDNN, no modification (ms) | ours ÷ Flex time |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        b, hq, hkv, n, d, dtype, causal, mod = row
        mine = ours(args.ours, row, True, args.warmup, args.repeats)
        plain = ours(args.ours, row, False, args.warmup, args.repeats)
        theirs = peers(row, args.warmup, args.repeats)
        name = {"alibi": "ALiBi", "sinks": f"sinks ({SINK:g})", "bias": "bias [1, H, N, N]"}.get(mod) or f"softcap {mod:g}"
        for pass_ in ("forward", "backward"):
            flops = 4 * b * hq * n * n * d * (0.5 if causal else 1) * (2.5 if pass_ == "backward" else 1)
            ms, base = mine.get(pass_), plain.get(pass_)
            cell = lambda x: f"{x:.3f}" if x else ""
            tflops = f"{flops / ms / 1e9:.1f}" if ms else ""
            cost = f"{ms / base - 1:+.1%}" if ms and base else ""
            flex = theirs.get(("flex", pass_))
            ratio = f"{ms / flex:.2f}" if ms and flex else ""
            bias = theirs.get(("sdpa bias", pass_))
            bias = f"{bias:.3f} ({theirs.get(('sdpa bias', 'backend'))})" if bias else ""
            if theirs.get(("cudnn sinks", pass_)):
                bias = f"{theirs[('cudnn sinks', pass_)]:.3f} (cudnn + sink)"
            print(f"| [{b}, {hq}, {hkv}, {n}, {d}] | {dtype} | {'causal' if causal else 'none'} | {name} | {pass_} "
                  f"| {cell(ms)} | {tflops} | {cell(base)} | {cost} | {cell(flex)} | {bias} "
                  f"| {cell(theirs.get(('cudnn plain', pass_)))} | {ratio} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Tests of the PyTorch bridge against PyTorch's own attention.

    python -m unittest discover -s bridges/python/tests -v      # after installing the wheel

On a machine without a GPU the CPU tensors run on the kernels' emulator (small shapes only); with
a GPU every test also runs on CUDA tensors, and the training test runs. With REQUIRE_GPU=1 a
missing GPU fails instead of skipping.

The oracle, as in the Rust tests: float64 SDPA on the same inputs is the truth; our error must be
within about twice that of PyTorch's own same-precision attention (the math backend), plus a
small floor for errors at rounding level.
"""
import math
import os
import pathlib
import unittest

import torch
import torch.nn.functional as F

import rust_attention as ra

HAS_GPU = torch.cuda.is_available()
if os.environ.get("REQUIRE_GPU") == "1" and not HAS_GPU:
    raise RuntimeError("REQUIRE_GPU=1, but torch.cuda.is_available() is False")
DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])
if not HAS_GPU:
    print("rust_attention tests: no GPU, CPU tensors only (the emulator); the training test is skipped")

# Turing GPUs (compute capability 7.5: a T4) run f32 and f16 only; bf16 there is refused.
GPU_BF16 = HAS_GPU and torch.cuda.get_device_capability() >= (8, 0)


def skip_unsupported(test, device, dtype):
    """Skips the current (sub)test for bf16 on a GPU without bf16 kernels."""
    if device == "cuda" and dtype == torch.bfloat16 and not GPU_BF16:
        test.skipTest("bf16 needs compute capability 8.0; this GPU is Turing")


# The error a same-precision plain implementation may have, times two, plus a floor.
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel(a, b):
    """‖a − b‖ / ‖b‖, or ‖a − b‖ where b is exactly 0 (as `attn_host::check::relative_l2_error`):
    with one key per row P = 1, so dS = 0 and the true dQ and dK are zero, and rounding-level
    noise in ours must not read as an infinite relative error."""
    a, b = a.double(), b.double()
    norm = b.norm()
    return ((a - b).norm() / (norm if norm > 0 else 1.0)).item()


def leaf(x, dtype, device=None):
    """A fresh leaf copy of `x` in `dtype` (on `device`) that records its own gradient. A copy always:
    `x.to(dtype)` returns `x` itself when the dtype is already `x`'s, and two runs would then
    accumulate their gradients into one `.grad` (or the second would get a non-leaf without one)."""
    return x.detach().to(device=device or x.device, dtype=dtype, copy=True).requires_grad_()


def random_problem(g, b, hq, hkv, sq, sk, d):
    """Fresh normal Q `[b, hq, sq, d]`, K and V `[b, hkv, sk, d]` and dO (Q's shape) from `g`."""
    make = lambda h, s: torch.randn(b, h, s, d, generator=g)
    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)


def reference_mask(sq, sk, is_causal, bottom_right, window):
    """The boolean mask (True = visible) our options describe, for SDPA's attn_mask."""
    i = torch.arange(sq).unsqueeze(1) + (sk - sq if bottom_right else 0)
    j = torch.arange(sk).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if is_causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
    return visible


def sdpa(q, k, v, mask):
    """PyTorch's math attention with `mask`; rows that see no key give 0 (as ours do), not NaN."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return p @ v


def alibi_slopes(heads, max_bias):
    """ALiBi's slopes (Press et al. 2022, section 3; BLOOM's completion for head counts that are not
    powers of two), as `attn_host::Alibi::slope`."""
    n = 1 << (heads.bit_length() - 1)
    exponent = [(h + 1) / n if h < n else (2 * (h - n) + 1) / (2 * n) for h in range(heads)]
    return torch.tensor([2.0 ** (-max_bias * e) for e in exponent], dtype=torch.float64)


def biased_attention(q, k, v, mask, bias):
    """Attention with an additive bias on the scaled scores (SDPA's float attn_mask) by its
    definition: the scores in q's dtype, the bias and the softmax in float32 (float64 for float64
    inputs), P back in q's dtype; rows that see no key give 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).to(wide) + bias.to(wide)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return p.to(q.dtype) @ v


def modified_attention(q, k, v, mask, softcap, alibi, sinks):
    """Attention with softcapping, ALiBi and sinks by their definitions: the scores in q's dtype, the
    modifications and the softmax in float32 (float64 for float64 inputs), P back in q's dtype."""
    hq, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).to(wide)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = alibi_slopes(hq, 8.0 if alibi is True else alibi).to(wide)
        distance = (torch.arange(sq).unsqueeze(1) + (sk - sq) - torch.arange(sk).unsqueeze(0)).abs().to(wide)
        s = s - slopes.view(hq, 1, 1) * distance
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.to(wide).view(1, hq, 1, 1).expand(s.shape[0], hq, sq, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :sk]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p.to(q.dtype) @ v


class Cases(unittest.TestCase):
    def assert_oracle(self, what, dtype, ours, results, names=("O", "dQ", "dK", "dV", "dSinks")):
        """Each of O, dQ, dK, dV (and dSinks or dBias) within twice the plain same-precision error
        plus the floor. dSinks and dBias take D = rowsum(dO·O) from the O the kernels rounded to the
        inputs' dtype, a rounding the plain autograd does not do: twice the floor there."""
        for name, x, plain, truth in zip(names, ours, results["plain"], results["truth"]):
            bound = 2 * rel(plain, truth) + FLOOR[dtype] * (2 if name in ("dSinks", "dBias") else 1)
            self.assertLessEqual(rel(x.cpu(), truth), bound, f"{what}: {name}")

    def check(self, device, dtype, b, hq, hkv, sq, sk, d, is_causal=False, bottom_right=False, window=None,
              layout="bhsd", deterministic=False):
        skip_unsupported(self, device, dtype)
        g = torch.Generator().manual_seed(hash((b, hq, hkv, sq, sk, d, is_causal, bottom_right)) % 2**31)
        make = lambda h, s: torch.randn(b, h, s, d, generator=g).to(device)
        q64, k64, v64 = make(hq, sq), make(hkv, sk), make(hkv, sk)
        do64 = make(hq, sq)
        mask = reference_mask(sq, sk, is_causal, bottom_right, window)
        # The truth (float64) and PyTorch's same-precision attention, with their gradients.
        results = {}
        for name, t in (("truth", torch.float64), ("plain", dtype)):
            q, k, v = (leaf(x, t) for x in (q64, k64, v64))
            o = sdpa(q, k, v, mask)
            o.backward(do64.to(t))
            results[name] = (o, q.grad, k.grad, v.grad)
        q, k, v = (leaf(x, dtype) for x in (q64, k64, v64))
        args = (q, k, v) if layout == "bhsd" else tuple(x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        o = ra.attention(*args, is_causal=is_causal, causal_alignment="bottom-right" if bottom_right else "top-left",
                         enable_gqa=hq != hkv, layout=layout, window=window, deterministic=deterministic)
        if layout == "bshd":
            self.assertEqual(o.shape, (b, sq, hq, d))
            o.backward(do64.to(dtype).transpose(1, 2))
            o = o.transpose(1, 2)
            grads = [x.grad.transpose(1, 2) for x in args]
        else:
            o.backward(do64.to(dtype))
            grads = [x.grad for x in args]
        what = f"{device} {dtype} [{b},{hq},{hkv},{sq},{sk},{d}] causal={is_causal} br={bottom_right} w={window} {layout}"
        for name, ours, plain, truth in zip(("O", "dQ", "dK", "dV"), (o, *grads), results["plain"], results["truth"]):
            bound = 2 * rel(plain, truth) + FLOOR[dtype]
            self.assertLessEqual(rel(ours, truth), bound, f"{what}: {name}")
        return o, grads

    def test_grid(self):
        for device in DEVICES:
            big = device == "cuda"
            shapes = [(1, 2, 2, 1, 1, 8), (2, 4, 2, 17, 33, 64), (1, 2, 1, 45, 37, 128), (1, 2, 2, 23, 23, 96)]
            if big:
                shapes += [(2, 12, 12, 197, 197, 64), (1, 8, 2, 1023, 1023, 128), (2, 4, 4, 577, 300, 256),
                           (1, 16, 4, 1, 4096, 128)]
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for i, shape in enumerate(shapes):
                    with self.subTest(device=device, dtype=dtype, shape=shape):
                        self.check(device, dtype, *shape, is_causal=i % 2 == 1, bottom_right=i % 4 == 3)

    def test_layouts_windows_and_determinism(self):
        for device in DEVICES:
            self.check(device, torch.float16, 2, 4, 2, 40, 40, 64, layout="bshd", is_causal=True)
            if device == "cpu" or GPU_BF16:
                self.check(device, torch.bfloat16, 1, 2, 2, 70, 90, 64, is_causal=True, bottom_right=True,
                           window=(16, 0))
            self.check(device, torch.float16, 1, 2, 1, 50, 50, 32, window=(None, 3))
            runs = [self.check(device, torch.float16, 1, 4, 2, 96, 96, 64, is_causal=True, deterministic=True)[1][0]
                    for _ in range(2)]
            self.assertTrue(torch.equal(runs[0], runs[1]), f"{device}: deterministic dQ differs between runs")

    def test_score_mods_and_sinks(self):
        """Softcapping, ALiBi and sinks against their definitions in float64, forward and backward
        (dSinks too), with GQA, both masks' alignments and a row-window."""
        cases = [  # (dtype, [B, Hq, Hkv, Sq, Sk, D], is_causal, bottom_right, softcap, alibi, with sinks)
            (torch.float16, (1, 4, 2, 37, 53, 64), True, True, 2.0, None, False),
            (torch.bfloat16, (2, 3, 3, 40, 40, 64), False, False, None, True, False),
            (torch.float32, (1, 6, 2, 33, 21, 32), True, False, None, 4.0, True),
            (torch.float16, (1, 4, 1, 45, 45, 128), True, True, None, None, True),
            (torch.bfloat16, (1, 2, 2, 29, 61, 96), False, False, 5.0, None, True),
        ]
        for device in DEVICES:
            for dtype, (b, hq, hkv, sq, sk, d), is_causal, bottom_right, cap, alibi, with_sinks in cases:
                what = f"{device} {dtype} [{b},{hq},{hkv},{sq},{sk},{d}] cap={cap} alibi={alibi} sinks={with_sinks}"
                with self.subTest(what):
                    skip_unsupported(self, device, dtype)
                    g = torch.Generator().manual_seed(len(what))
                    q64, k64, v64, do64 = random_problem(g, b, hq, hkv, sq, sk, d)
                    sinks64 = torch.randn(hq, generator=g) + 1.0 if with_sinks else None
                    mask = reference_mask(sq, sk, is_causal, bottom_right, None)
                    results = {}
                    for name, t in (("truth", torch.float64), ("plain", dtype)):
                        q, k, v = (leaf(x, t) for x in (q64, k64, v64))
                        sinks = None if sinks64 is None else leaf(sinks64, torch.float64)
                        o = modified_attention(q, k, v, mask, cap, alibi, sinks)
                        o.backward(do64.to(t))
                        results[name] = (o, q.grad, k.grad, v.grad) + ((sinks.grad,) if with_sinks else ())
                    q, k, v = (leaf(x, dtype, device) for x in (q64, k64, v64))
                    sinks = None if sinks64 is None else leaf(sinks64, torch.float32, device)
                    o = ra.attention(q, k, v, is_causal=is_causal, enable_gqa=hq != hkv, softcap=cap, alibi=alibi,
                                     sinks=sinks, causal_alignment="bottom-right" if bottom_right else "top-left")
                    o.backward(do64.to(dtype).to(device))
                    ours = (o, q.grad, k.grad, v.grad) + ((sinks.grad,) if with_sinks else ())
                    self.assert_oracle(what, dtype, ours, results)

    def test_attn_mask(self):
        """SDPA's attn_mask: a float bias, broadcast over batch and heads or not, against its
        definition in float64, forward and backward (its gradient too, summed over the broadcast
        dimensions by autograd); a boolean mask; a row the mask hides throughout."""
        cases = [  # (dtype, [B, Hq, Hkv, Sq, Sk, D], is_causal, mask shape)
            (torch.float16, (2, 4, 2, 37, 53, 64), True, (4, 37, 53)),
            (torch.bfloat16, (2, 2, 2, 40, 40, 64), False, (2, 1, 40, 40)),
            (torch.float32, (1, 3, 1, 33, 21, 32), False, (33, 21)),
        ]
        for device in DEVICES:
            for dtype, (b, hq, hkv, sq, sk, d), is_causal, mask_shape in cases:
                what = f"{device} {dtype} [{b},{hq},{hkv},{sq},{sk},{d}] causal={is_causal} mask {mask_shape}"
                with self.subTest(what):
                    skip_unsupported(self, device, dtype)
                    g = torch.Generator().manual_seed(len(what))
                    q64, k64, v64, do64 = random_problem(g, b, hq, hkv, sq, sk, d)
                    bias64 = torch.randn(mask_shape, generator=g)
                    mask = reference_mask(sq, sk, is_causal, False, None)
                    results = {}
                    for name, t in (("truth", torch.float64), ("plain", dtype)):
                        q, k, v = (leaf(x, t) for x in (q64, k64, v64))
                        bias = leaf(bias64, torch.float64)
                        o = biased_attention(q, k, v, mask, bias)
                        o.backward(do64.to(t))
                        results[name] = (o, q.grad, k.grad, v.grad, bias.grad)
                    q, k, v = (leaf(x, dtype, device) for x in (q64, k64, v64))
                    bias = leaf(bias64, torch.float32, device)
                    o = ra.attention(q, k, v, bias, is_causal=is_causal, enable_gqa=hq != hkv)
                    o.backward(do64.to(dtype).to(device))
                    self.assertEqual(bias.grad.shape, bias.shape)
                    self.assert_oracle(what, dtype, (o, q.grad, k.grad, v.grad, bias.grad), results,
                                       names=("O", "dQ", "dK", "dV", "dBias"))
            # A boolean mask is SDPA's: True takes part. Row 3 sees no key: 0, not NaN.
            q, k, v = (torch.randn(1, 2, 24, 64, device=device) for _ in range(3))
            keep = torch.rand(24, 24, generator=torch.Generator().manual_seed(5)).to(device) > 0.3
            keep[3] = False
            o = ra.attention(q, k, v, keep)
            want = biased_attention(q.double(), k.double(), v.double(), keep, torch.zeros((), device=device))
            self.assertLess((o.double() - want).abs().max().item(), 1e-4)
            self.assertTrue(torch.equal(o[:, :, 3], torch.zeros_like(o[:, :, 3])))

    def test_lse(self):
        for device in DEVICES:
            q, k, v = (torch.randn(1, 2, 30, 64, device=device) for _ in range(3))
            o, lse = ra.attention(q, k, v, return_lse=True)
            want = torch.logsumexp((q @ k.transpose(-1, -2)) / 8.0, dim=-1)
            self.assertLess((lse - want).abs().max().item(), 1e-4)
            self.assertFalse(lse.requires_grad)

    def test_empty_sequences(self):
        for device in DEVICES:
            q = torch.randn(2, 4, 7, 64, device=device, dtype=torch.float16, requires_grad=True)
            k = torch.randn(2, 4, 0, 64, device=device, dtype=torch.float16, requires_grad=True)
            o, lse = ra.attention(q, k, k, return_lse=True)
            self.assertTrue(torch.equal(o, torch.zeros_like(o)))
            self.assertTrue(torch.isneginf(lse).all())
            o.sum().backward()
            self.assertTrue(torch.equal(q.grad, torch.zeros_like(q)))
            empty_q = torch.randn(2, 4, 0, 64, device=device, dtype=torch.float16, requires_grad=True)
            kv = torch.randn(2, 4, 5, 64, device=device, dtype=torch.float16, requires_grad=True)
            ra.attention(empty_q, kv, kv).sum().backward()
            self.assertTrue(torch.equal(kv.grad, torch.zeros_like(kv)))

    def test_errors_say_why(self):
        q = torch.randn(1, 4, 8, 64)
        k = torch.randn(1, 2, 8, 64)
        with self.assertRaisesRegex(ValueError, "enable_gqa"):
            ra.attention(q, k, k)
        with self.assertRaisesRegex(ValueError, "float64"):
            ra.attention(q.double(), k.double(), k.double(), enable_gqa=True)
        with self.assertRaisesRegex(ValueError, "head"):
            ra.attention(torch.randn(1, 2, 8, 300), torch.randn(1, 2, 8, 300), torch.randn(1, 2, 8, 300))
        with self.assertRaisesRegex(ValueError, "window"):
            ra.attention(q, q, q, window=(-2, 0))
        with self.assertRaisesRegex(ValueError, "softcap"):
            ra.attention(q, q, q, softcap=-1.0)
        with self.assertRaisesRegex(ValueError, "sinks"):
            ra.attention(q, q, q, sinks=torch.zeros(3))
        with self.assertRaisesRegex(ValueError, "together|both"):
            ra.attention(q, q, q, softcap=30.0, alibi=True)
        with self.assertRaisesRegex(ValueError, "broadcast"):
            ra.attention(q, q, q, torch.zeros(8, 9))
        with self.assertRaisesRegex(ValueError, "boolean"):
            ra.attention(q, q, q, torch.zeros(8, 8, dtype=torch.int32))
        with self.assertRaisesRegex(ValueError, "softcap"):
            ra.attention(q, q, q, torch.zeros(8, 8), softcap=30.0)

    def test_varlen(self):
        """`attention_varlen` against each sequence attended on its own (float64 truth and PyTorch's
        same-precision attention, concatenated), forward and backward, with GQA, empty and one-token
        sequences, causal and not, a window, ALiBi and sinks."""
        cases = [  # (lengths on CPU, lengths on CUDA, dtype, Hq, Hkv, D, is_causal, window, alibi, with sinks)
            ([5, 0, 70, 1, 40], [300, 1, 1000, 77, 0, 513, 2048], torch.float16, 4, 2, 64, True, None, None, False),
            ([33, 17], [128, 129, 4096, 127], torch.bfloat16, 2, 2, 128, False, None, None, False),
            ([20, 0, 45], [640, 0, 700, 65], torch.float32, 2, 1, 32, True, (16, 0), None, False),
            ([30, 9, 26], [1000, 33, 999], torch.float16, 4, 4, 96, True, None, True, True),
        ]
        for device in DEVICES:
            for small, big, dtype, hq, hkv, d, is_causal, window, alibi, with_sinks in cases:
                lengths = big if device == "cuda" else small
                what = f"{device} {dtype} lengths={lengths} H={hq}/{hkv} D={d} causal={is_causal} w={window}"
                with self.subTest(what):
                    skip_unsupported(self, device, dtype)
                    g = torch.Generator().manual_seed(len(what))
                    total = sum(lengths)
                    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
                    make = lambda h: torch.randn(total, h, d, generator=g)
                    q64, k64, v64, do64 = make(hq), make(hkv), make(hkv), make(hq)
                    sinks64 = torch.randn(hq, generator=g) + 1.0 if with_sinks else None
                    results = {}
                    for name, t in (("truth", torch.float64), ("plain", dtype)):
                        q, k, v = (leaf(x, t) for x in (q64, k64, v64))
                        sinks = None if sinks64 is None else leaf(sinks64, torch.float64)
                        parts = []
                        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                            if a == b:
                                continue
                            bhsd = lambda x: x[a:b].transpose(0, 1).unsqueeze(0)
                            mask = reference_mask(b - a, b - a, is_causal, False, window)
                            o = modified_attention(bhsd(q), bhsd(k), bhsd(v), mask, None, alibi, sinks)
                            parts.append(o.squeeze(0).transpose(0, 1))
                        o = torch.cat(parts)
                        o.backward(do64.to(t))
                        results[name] = (o, q.grad, k.grad, v.grad) + ((sinks.grad,) if with_sinks else ())
                    q, k, v = (leaf(x, dtype, device) for x in (q64, k64, v64))
                    sinks = None if sinks64 is None else leaf(sinks64, torch.float32, device)
                    o, lse = ra.attention_varlen(q, k, v, cu.to(device), is_causal=is_causal, window=window,
                                                 alibi=alibi, sinks=sinks, return_lse=True)
                    self.assertEqual(o.shape, (total, hq, d))
                    self.assertTrue(o.is_contiguous())
                    self.assertEqual(lse.shape, (hq, total))
                    if not with_sinks and alibi is None:
                        # The LSE of each row over its own sequence's visible keys (from the
                        # inputs rounded to the dtype, as the kernels read them).
                        want = torch.full((hq, total), float("-inf"), dtype=torch.float64)
                        g = hq // hkv
                        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                            if a == b:
                                continue
                            rounded = lambda x: x[a:b].to(dtype).double()
                            kk = rounded(k64).repeat_interleave(g, dim=1)
                            scores = torch.einsum("qhd,khd->hqk", rounded(q64), kk) / math.sqrt(d)
                            mask = reference_mask(b - a, b - a, is_causal, False, window)
                            want[:, a:b] = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
                        self.assertLess((lse.detach().cpu().double() - want).abs().max().item(), 1e-3, what)
                    o.backward(do64.to(dtype).to(device))
                    ours = (o, q.grad, k.grad, v.grad) + ((sinks.grad,) if with_sinks else ())
                    self.assert_oracle(what, dtype, ours, results)

    def test_varlen_with_key_lengths_of_their_own(self):
        """`attention_varlen` with `cu_seqlens_k`: chunked prefill (new queries against a cache and
        themselves, bottom-right causal, with a window too) and cross-attention (no mask, a
        sequence with more queries than keys, one with no queries), each sequence against its own
        attention, forward and backward."""
        cases = [  # (queries, keys) on CPU, on CUDA, dtype, Hq, Hkv, D, is_causal, window
            (([3, 1], [20, 9]), ([1, 64, 7, 200], [1500, 64, 900, 1200]), torch.float16, 4, 2, 64, True, None),
            (([2, 5], [30, 9]), ([16, 130, 1], [700, 1000, 300]), torch.bfloat16, 2, 1, 128, True, (40, 0)),
            (([7, 0, 5], [3, 6, 8]), ([300, 0, 77], [100, 50, 1000]), torch.float32, 2, 2, 32, False, None),
        ]
        for device in DEVICES:
            for small, big, dtype, hq, hkv, d, is_causal, window in cases:
                lq, lk = big if device == "cuda" else small
                what = f"{device} {dtype} q={lq} k={lk} H={hq}/{hkv} D={d} causal={is_causal} w={window}"
                with self.subTest(what):
                    skip_unsupported(self, device, dtype)
                    g = torch.Generator().manual_seed(len(what))
                    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
                    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
                    q64, do64 = torch.randn(sum(lq), hq, d, generator=g), torch.randn(sum(lq), hq, d, generator=g)
                    k64, v64 = torch.randn(sum(lk), hkv, d, generator=g), torch.randn(sum(lk), hkv, d, generator=g)
                    results = {}
                    for name, t in (("truth", torch.float64), ("plain", dtype)):
                        q, k, v = (leaf(x, t) for x in (q64, k64, v64))
                        parts = []
                        for s in range(len(lq)):
                            (a, b), (c, e) = cu_q[s:s + 2].tolist(), cu_k[s:s + 2].tolist()
                            if a == b:
                                continue
                            bhsd = lambda x, lo, hi: x[lo:hi].transpose(0, 1).unsqueeze(0)
                            mask = reference_mask(b - a, e - c, is_causal, True, window)
                            o = modified_attention(bhsd(q, a, b), bhsd(k, c, e), bhsd(v, c, e), mask, None, None, None)
                            # A row that sees no key is 0 (the kernels' empty-row convention).
                            parts.append(torch.nan_to_num(o, nan=0.0).squeeze(0).transpose(0, 1))
                        o = torch.cat(parts)
                        o.backward(do64.to(t))
                        results[name] = (o, q.grad, k.grad, v.grad)
                    q, k, v = (leaf(x, dtype, device) for x in (q64, k64, v64))
                    o = ra.attention_varlen(q, k, v, cu_q.to(device), cu_seqlens_k=cu_k, is_causal=is_causal,
                                            window=window)
                    self.assertEqual(o.shape, (sum(lq), hq, d))
                    o.backward(do64.to(dtype).to(device))
                    self.assert_oracle(what, dtype, (o, q.grad, k.grad, v.grad), results)

    def test_varlen_edges(self):
        """No tokens at all, offsets as int64 and as a list, and a row of one sequence against the
        plain call."""
        for device in DEVICES:
            empty = torch.randn(0, 2, 64, device=device, requires_grad=True)
            o = ra.attention_varlen(empty, empty, empty, [0, 0, 0])
            self.assertEqual(o.shape, (0, 2, 64))
            x = torch.randn(12, 2, 32, device=device)
            bhsd = x.transpose(0, 1).unsqueeze(0)
            whole = ra.attention(bhsd, bhsd, bhsd, is_causal=True)
            for offsets in ([0, 12], torch.tensor([0, 12], dtype=torch.int64, device=device)):
                o = ra.attention_varlen(x, x, x, offsets, is_causal=True)
                self.assertLess(rel(o, whole.squeeze(0).transpose(0, 1)), 1e-5, device)

    def test_varlen_errors_say_why(self):
        q = torch.randn(10, 2, 64)
        with self.assertRaisesRegex(ValueError, "integers"):
            ra.attention_varlen(q, q, q, torch.tensor([0.0, 10.0]))
        with self.assertRaisesRegex(ValueError, "1-dimensional"):
            ra.attention_varlen(q, q, q, torch.tensor([[0, 10]]))
        with self.assertRaisesRegex(ValueError, "cu_seqlens"):
            ra.attention_varlen(q, q, q, torch.tensor([0, 4, 9]))  # ends before the 10 tokens
        with self.assertRaisesRegex(ValueError, "cu_seqlens"):
            ra.attention_varlen(q, q, q, torch.tensor([0, 6, 4, 10]))  # decreases
        with self.assertRaisesRegex(ValueError, "3-dimensional"):
            ra.attention_varlen(q.unsqueeze(0), q, q, torch.tensor([0, 10]))
        with self.assertRaisesRegex(ValueError, "divide"):
            ra.attention_varlen(q, torch.randn(10, 3, 64), torch.randn(10, 3, 64), torch.tensor([0, 10]))
        kv = torch.randn(12, 2, 64)
        with self.assertRaisesRegex(ValueError, "cu_seqlens_k"):
            ra.attention_varlen(q, kv, kv, [0, 4, 10], cu_seqlens_k=[0, 12])  # two sequences, one key list
        with self.assertRaisesRegex(ValueError, "cu_seqlens_k"):
            ra.attention_varlen(q, kv, kv, [0, 10], cu_seqlens_k=[0, 11])  # ends before the 12 keys
        with self.assertRaisesRegex(ValueError, "alibi"):
            ra.attention_varlen(q, kv, kv, [0, 10], cu_seqlens_k=[0, 12], alibi=True)

    def test_compile(self):
        for device in DEVICES:
            # Inductor needs a compiler for CPU code; aot_eager traces the same graph (fake
            # kernels, autograd formula) without generating code.
            backend = "inductor" if device == "cuda" else "aot_eager"
            q, k, v = (torch.randn(2, 4, 64, 64, device=device, dtype=torch.float16, requires_grad=True)
                       for _ in range(3))

            def f(q, k, v):
                return (ra.attention(q, k, v, is_causal=True) * 2).sum()

            torch._dynamo.reset()
            compiled = torch.compile(f, backend=backend, fullgraph=True)
            eager_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
            compiled_grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
            for a, b in zip(eager_grads, compiled_grads):
                self.assertTrue(torch.allclose(a, b, atol=1e-3, rtol=1e-3), device)
            # The varlen entry too, offsets on the host.
            packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
            cu = torch.tensor([0, 20, 20, 64], dtype=torch.int32)

            def g(q, k, v):
                return (ra.attention_varlen(q, k, v, cu, is_causal=True) * 2).sum()

            torch._dynamo.reset()
            compiled = torch.compile(g, backend=backend, fullgraph=True)
            eager_grads = torch.autograd.grad(g(*packed), packed)
            compiled_grads = torch.autograd.grad(compiled(*packed), packed)
            for a, b in zip(eager_grads, compiled_grads):
                self.assertTrue(torch.allclose(a, b, atol=1e-3, rtol=1e-3), f"{device} varlen")


class TinyGpt(torch.nn.Module):
    """A character-level GPT: `layers` pre-norm blocks of causal self-attention and an MLP."""

    def __init__(self, vocab, width=256, heads=4, layers=4, context=256, attend=None):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
                "proj": torch.nn.Linear(width, width), "norm2": torch.nn.LayerNorm(width),
                "mlp": torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width)),
            }))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.embed(tokens) + self.position[:s]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, s, 3, self.heads, -1).unbind(2)  # BSHD
            x = x + blk["proj"](self.attend(q, k, v).reshape(b, s, -1))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(self.norm(x))


def shipped_text():
    """The project's own prose (the guide and the docs), as training text."""
    root = pathlib.Path(__file__).resolve().parents[3]
    files = sorted((root / "docs").rglob("*.md")) + [root / "README.md", root / "ARCHITECTURE.md"]
    return "\n".join(p.read_text(encoding="utf-8") for p in files if p.exists())


def train(attend, text, steps=300, seed=0):
    """Loss per step of a TinyGpt trained on `text` (bf16 autocast, f16 on Turing; AdamW), from `seed`."""
    torch.manual_seed(seed)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], device="cuda")
    model = TinyGpt(len(chars), attend=attend).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(seed)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 257, (32,), device="cuda", generator=g)
        batch = torch.stack([data[s:s + 257] for s in starts.tolist()])
        with torch.autocast("cuda", dtype=torch.bfloat16 if GPU_BF16 else torch.float16):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@unittest.skipUnless(HAS_GPU, "needs a GPU")
class Training(unittest.TestCase):
    def test_loss_curves_match_sdpa(self):
        text = shipped_text()
        ours = train(lambda q, k, v: ra.attention(q, k, v, is_causal=True, layout="bshd"), text)
        theirs = train(lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2), text)
        # Compare smoothed curves (mean of 20 steps): single steps differ by sampling noise of
        # the rounding, not by the kernels.
        smooth = lambda xs: [sum(xs[i:i + 20]) / 20 for i in range(0, len(xs), 20)]
        worst = max(abs(a - b) / b for a, b in zip(smooth(ours), smooth(theirs)))
        print(f"\nloss (mean of 20 steps), ours vs SDPA: " +
              ", ".join(f"{a:.3f}/{b:.3f}" for a, b in list(zip(smooth(ours), smooth(theirs)))[::3]) +
              f"; largest relative difference {worst:.4f}")
        self.assertLess(worst, 0.01)
        self.assertLess(ours[-1], 0.6 * ours[0], "the model did not learn")


if __name__ == "__main__":
    unittest.main()

"""FlashAttention kernels written in pure Rust, as a PyTorch operator.

    import rust_attention
    out = rust_attention.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out.sum().backward()                                              # our backward kernels

`attention` takes what `torch.nn.functional.scaled_dot_product_attention` takes for the cases
these kernels cover: CUDA tensors (or CPU tensors, run on the kernels' CPU emulator: slow, for
tests) of float32, float16 or bfloat16, Q `[B, Hq, Sq, D]` and K, V `[B, Hkv, Sk, D]` (or all
`[B, S, H, D]` with `layout="bshd"`), head_dim 1 to 256, a causal mask aligned top-left (PyTorch's
`is_causal`) or bottom-right (FlashAttention's), grouped-query attention with `enable_gqa=True`,
a sliding window, and a deterministic backward. There is no dropout and no `attn_mask`.

Under it are two `torch.library` custom ops, `rust_attention::forward` (O and the logsumexp) and
`rust_attention::backward` (dQ, dK, dV), with an autograd formula and fake (meta) kernels, so
`torch.compile` traces through them and autograd runs our backward kernel. They run on PyTorch's
current CUDA stream and write into tensors from PyTorch's allocator (the kernels' own scratch,
an `f32` row statistic and dQ accumulator, comes from the CUDA driver's stream-ordered pool).
"""
import math

import torch

from . import _native

__all__ = ["attention", "device_name", "forward_kernel"]

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ALIGNMENTS = ("top-left", "bottom-right")


def _device_index(t):
    """The bridge's device number: the CUDA ordinal, or -1 for a CPU tensor (the emulator)."""
    if t.device.type == "cuda":
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    if t.device.type == "cpu":
        return -1
    raise ValueError(f"rust_attention runs CUDA tensors (and CPU tensors on its emulator), not {t.device}")


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def _ready(t):
    """`t` contiguous and 16-byte aligned (the kernels copy rows 16 bytes at a time); a copy if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _sizes(q, k):
    b, hq, sq, d = q.shape
    return (b, hq, k.shape[1], sq, k.shape[2], d)


@torch.library.custom_op("rust_attention::forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bottom_right: bool, window_left: int,
    window_right: int, scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[B, Hq, Sq, D]` and LSE `[B, Hq, Sq]` (float32) of BHSD Q, K, V (`deterministic` is for the backward)."""
    q, k, v = _ready(q), _ready(k), _ready(v)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _native.forward(_device_index(q), _stream(q), _DTYPES[q.dtype], _sizes(q, k), q.data_ptr(), k.data_ptr(),
                    v.data_ptr(), o.data_ptr(), lse.data_ptr(), causal, bottom_right, window_left, window_right, scale)
    return o, lse


@_forward.register_fake
def _forward_fake(q, k, v, causal, bottom_right, window_left, window_right, scale, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("rust_attention::backward", mutates_args=())
def _backward(
    d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, bottom_right: bool, window_left: int, window_right: int, scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the forward above for dO (O's shape)."""
    d_o, q, k, v, o, lse = (_ready(t) for t in (d_o, q, k, v, o, lse))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _native.backward(_device_index(q), _stream(q), _DTYPES[q.dtype], _sizes(q, k), q.data_ptr(), k.data_ptr(),
                     v.data_ptr(), o.data_ptr(), lse.data_ptr(), d_o.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                     dv.data_ptr(), causal, bottom_right, window_left, window_right, deterministic, scale)
    return dq, dk, dv


@_backward.register_fake
def _backward_fake(d_o, q, k, v, o, lse, causal, bottom_right, window_left, window_right, scale, deterministic):
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)
    return like(q), like(k), like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, bottom_right, window_left, window_right, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mask = (causal, bottom_right, window_left, window_right)
    ctx.scale, ctx.deterministic = scale, deterministic
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, d_o, _d_lse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _backward(d_o, q, k, v, o, lse, *ctx.mask, ctx.scale, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def attention(q, k, v, *, is_causal=False, causal_alignment="top-left", scale=None, enable_gqa=False,
              layout="bhsd", window=None, deterministic=None, return_lse=False):
    """Scaled dot-product attention on our kernels: softmax(Q Kᵀ · scale) V.

    Args:
        q: `[B, Hq, Sq, D]` (or `[B, Sq, Hq, D]` with `layout="bshd"`), float32/float16/bfloat16.
        k, v: `[B, Hkv, Sk, D]` (or BSHD), Q's dtype and device; Hkv = Hq unless `enable_gqa`.
        is_causal: hide key j from query i when j > i + offset, where offset is 0 for
            `causal_alignment="top-left"` (PyTorch's `is_causal`) and Sk - Sq for `"bottom-right"`
            (FlashAttention's, what decoding with a KV cache needs).
        scale: the score scale, default 1/sqrt(D) (as SDPA's).
        enable_gqa: allow Hkv to divide Hq (grouped-query attention, as SDPA's flag).
        layout: `"bhsd"` (PyTorch's) or `"bshd"` (FlashAttention's and most models' projections);
            BSHD is transposed to BHSD and back around the kernels (a copy each way, for now).
        window: `(left, right)`: query i sees keys from its diagonal - left to diagonal + right,
            `None` for an unbounded side; the diagonal is aligned by `causal_alignment` (with or
            without `is_causal`, which intersects). Mistral's sliding window W is
            `is_causal=True, window=(W - 1, 0)`.
        deterministic: whether the backward sums dQ in a fixed order (bit-identical runs);
            `None` follows `torch.are_deterministic_algorithms_enabled()`.
        return_lse: also return the logsumexp of each score row, `[B, Hq, Sq]` float32 (natural
            log; -inf for a row that sees no key), which is not differentiable.

    Returns:
        O in Q's layout, dtype and device (and the LSE with `return_lse`). Its backward runs our
        backward kernels.

    Raises:
        ValueError: for shapes, dtypes, devices or options these kernels do not take, with the reason.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', not {layout!r}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment must be 'top-left' or 'bottom-right', not {causal_alignment!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-dimensional tensor")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} is {t.dtype}; the kernels take float32, float16 and bfloat16")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must have one dtype and one device")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, Sk, D] with q's B and D")
    hkv = k.shape[1]
    if hkv != hq and not enable_gqa:
        raise ValueError(f"q has {hq} heads and k, v {hkv}: pass enable_gqa=True for grouped-query attention")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the {hkv} key/value heads must divide the {hq} query heads")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, not {scale}")
    left, right = -1, -1  # -1: no edge on that side
    if window is not None:
        if len(window) != 2 or any(w is not None and (int(w) != w or w < 0) for w in window):
            raise ValueError(f"window must be (left, right), each a non-negative int or None, not {window!r}")
        left, right = (-1 if w is None else int(w) for w in window)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    bottom_right = causal_alignment == "bottom-right"
    o, lse = torch.ops.rust_attention.forward(q, k, v, bool(is_causal), bottom_right, left, right, scale,
                                              bool(deterministic))
    if layout == "bshd":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def device_name(device=None):
    """The name of the device the kernels run on: a CUDA ordinal or `torch.device`, or "cpu" for the emulator."""
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return _native.device_name(-1 if device.type == "cpu" else (device.index or 0))


def forward_kernel(q, k, is_causal=False, causal_alignment="top-left"):
    """The forward kernel `attention(q, k, ...)` runs for these BHSD tensors, e.g. `sm_90a m128_n128_s2 persistent`."""
    return _native.forward_kernel(_device_index(q), _DTYPES[q.dtype], _sizes(q, k), bool(is_causal),
                                  causal_alignment == "bottom-right")

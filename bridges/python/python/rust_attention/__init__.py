"""FlashAttention kernels written in pure Rust, as a PyTorch operator.

    import rust_attention
    out = rust_attention.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out.sum().backward()                                              # our backward kernels

`attention` takes what `torch.nn.functional.scaled_dot_product_attention` takes for the cases
these kernels cover: CUDA tensors (or CPU tensors, run on the kernels' CPU emulator: slow, for
tests) of float32, float16 or bfloat16, Q `[B, Hq, Sq, D]` and K, V `[B, Hkv, Sk, D]` (or all
`[B, S, H, D]` with `layout="bshd"`), head_dim 1 to 256, a causal mask aligned top-left (PyTorch's
`is_causal`) or bottom-right (FlashAttention's), grouped-query attention with `enable_gqa=True`,
a sliding window, logit softcapping, ALiBi, attention sinks (with their gradient), SDPA's
`attn_mask` (boolean, or an additive float bias with its gradient), and a deterministic backward.
There is no dropout. `attention_varlen` takes a
variable-length batch packed end to end (`[total, H, D]` with `cu_seqlens`, FlashAttention's
varlen layout).

Under it are two `torch.library` custom ops, `rust_attention::forward` (O and the logsumexp) and
`rust_attention::backward` (dQ, dK, dV), with an autograd formula and fake (meta) kernels, so
`torch.compile` traces through them and autograd runs our backward kernel. They run on PyTorch's
current CUDA stream and write into tensors from PyTorch's allocator (the kernels' own scratch,
an `f32` row statistic and dQ accumulator, comes from the CUDA driver's stream-ordered pool).
"""
import math
from typing import Optional

import torch

from . import _native

__all__ = ["attention", "attention_varlen", "device_name", "forward_kernel"]

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


def _address(t):
    """The data pointer of an optional tensor, 0 for none."""
    return 0 if t is None else t.data_ptr()


def _bias_dims(bias):
    """The two leading sizes of a prepared bias (`_prepare_bias`), (1, 1) for none."""
    return (1, 1) if bias is None else (bias.shape[0], bias.shape[1])


def _offsets(cu_seqlens):
    """The document offsets as a list of ints for the native side, or None for no document mask."""
    return None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]


@torch.library.custom_op("rust_attention::forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bottom_right: bool, window_left: int,
    window_right: int, scale: float, deterministic: bool, softcap: float, alibi: float, sinks: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[B, Hq, Sq, D]` and LSE `[B, Hq, Sq]` (float32) of BHSD Q, K, V (`deterministic` is for the
    backward; `softcap`, `alibi` 0 for none; `sinks` `[Hq]` float32 or None; `cu_seqlens` the
    document offsets of a packed row, B = 1, or None; `cu_seqlens_k` the keys' own offsets, or
    None when they are the queries'; `bias` an additive float32 bias `[B or 1, Hq or 1, Sq, Sk]`
    or None)."""
    q, k, v = _ready(q), _ready(k), _ready(v)
    sinks = None if sinks is None else _ready(sinks)
    bias = None if bias is None else _ready(bias)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _native.forward(_device_index(q), _stream(q), _DTYPES[q.dtype], _sizes(q, k), q.data_ptr(), k.data_ptr(),
                    v.data_ptr(), o.data_ptr(), lse.data_ptr(), causal, bottom_right, window_left, window_right, scale,
                    softcap, alibi, _address(sinks), _offsets(cu_seqlens), _offsets(cu_seqlens_k), _address(bias),
                    _bias_dims(bias))
    return o, lse


@_forward.register_fake
def _forward_fake(q, k, v, causal, bottom_right, window_left, window_right, scale, deterministic, softcap, alibi,
                  sinks, cu_seqlens=None, cu_seqlens_k=None, bias=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("rust_attention::backward", mutates_args=())
def _backward(
    d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, bottom_right: bool, window_left: int, window_right: int, scale: float, deterministic: bool,
    softcap: float, alibi: float, sinks: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the forward above for dO (O's shape), dSinks (`[Hq]` float32; empty without
    sinks) and dBias (the bias's shape, float32; empty without a bias)."""
    d_o, q, k, v, o, lse = (_ready(t) for t in (d_o, q, k, v, o, lse))
    sinks = None if sinks is None else _ready(sinks)
    bias = None if bias is None else _ready(bias)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_sinks = torch.empty(0 if sinks is None else q.shape[1], dtype=torch.float32, device=q.device)
    d_bias = torch.empty(0 if bias is None else bias.shape, dtype=torch.float32, device=q.device)
    _native.backward(_device_index(q), _stream(q), _DTYPES[q.dtype], _sizes(q, k), q.data_ptr(), k.data_ptr(),
                     v.data_ptr(), o.data_ptr(), lse.data_ptr(), d_o.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                     dv.data_ptr(), causal, bottom_right, window_left, window_right, deterministic, scale, softcap,
                     alibi, _address(sinks), 0 if sinks is None else d_sinks.data_ptr(), _offsets(cu_seqlens),
                     _offsets(cu_seqlens_k), _address(bias), _bias_dims(bias),
                     0 if bias is None else d_bias.data_ptr())
    return dq, dk, dv, d_sinks, d_bias


@_backward.register_fake
def _backward_fake(d_o, q, k, v, o, lse, causal, bottom_right, window_left, window_right, scale, deterministic,
                   softcap, alibi, sinks, cu_seqlens=None, cu_seqlens_k=None, bias=None):
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)
    return (like(q), like(k), like(v), q.new_empty(0 if sinks is None else q.shape[1], dtype=torch.float32),
            q.new_empty(0 if bias is None else bias.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, causal, bottom_right, window_left, window_right, scale, deterministic, softcap, alibi, sinks, cu_seqlens,
     cu_seqlens_k, bias) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks, cu_seqlens, cu_seqlens_k, bias)
    ctx.mask = (causal, bottom_right, window_left, window_right)
    ctx.scale, ctx.deterministic, ctx.score = scale, deterministic, (softcap, alibi)
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, d_o, _d_lse):
    q, k, v, o, lse, sinks, cu_seqlens, cu_seqlens_k, bias = ctx.saved_tensors
    dq, dk, dv, d_sinks, d_bias = _backward(d_o, q, k, v, o, lse, *ctx.mask, ctx.scale, ctx.deterministic, *ctx.score,
                                            sinks, cu_seqlens, cu_seqlens_k, bias)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, (None if sinks is None else d_sinks), None, None,
            None if bias is None else d_bias)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_tensors(q, k, v, rank):
    """q, k, v: tensors of `rank` dimensions, of one dtype the kernels take, on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-dimensional tensor")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} is {t.dtype}; the kernels take float32, float16 and bfloat16")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must have one dtype and one device")


def _score_options(hq, d, device, scale, window, deterministic, softcap, alibi, sinks):
    """The options both entry points share, checked and in the ops' form: the scale, the window's
    reaches (-1: no edge), the dQ mode, the cap and ALiBi's max_bias (0: none), the sinks (float32)."""
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
    cap = 0.0 if softcap is None else float(softcap)
    if softcap is not None and not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a positive finite number, not {softcap!r}")
    max_bias = 0.0 if alibi is None or alibi is False else 8.0 if alibi is True else float(alibi)
    if alibi not in (None, False, True) and not (math.isfinite(max_bias) and max_bias > 0):
        raise ValueError(f"alibi must be True or a positive finite max_bias, not {alibi!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,) or sinks.device != device:
            raise ValueError(f"sinks must be a tensor of shape ({hq},) (one per query head) on q's device")
        sinks = sinks.float()
    return scale, left, right, bool(deterministic), cap, max_bias, sinks


def _prepare_bias(attn_mask, b, hq, sq, sk, device):
    """SDPA's `attn_mask` as the kernels' additive bias: float32 `[B or 1, Hq or 1, Sq, Sk]` (an
    expanded view; the op makes it contiguous), or None. A boolean mask becomes 0 where True (the
    key takes part) and -inf where False; a float mask is the bias itself. Autograd carries dBias
    back through these steps, so a broadcast mask's gradient is summed over what it was
    broadcast to, and a mask of another float dtype gets its gradient in that dtype."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.device != device:
        raise ValueError("attn_mask must be a tensor on q's device")
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=device).masked_fill(~attn_mask, float("-inf"))
    elif attn_mask.dtype.is_floating_point:
        bias = attn_mask.float()
    else:
        raise ValueError(f"attn_mask is {attn_mask.dtype}; it must be boolean (True: the key takes part) or float "
                         f"(added to the scaled scores)")
    want = (b, hq, sq, sk)
    if bias.dim() > 4 or any(n not in (1, w) for n, w in zip(bias.shape[::-1], want[::-1])):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, Sq, Sk] = "
                         f"{list(want)}")
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return bias.expand(bias.shape[0], bias.shape[1], sq, sk)


def attention(q, k, v, attn_mask=None, *, is_causal=False, causal_alignment="top-left", scale=None, enable_gqa=False,
              layout="bhsd", window=None, deterministic=None, return_lse=False, softcap=None, alibi=None,
              sinks=None):
    """Scaled dot-product attention on our kernels: softmax(Q Kᵀ · scale) V.

    Args:
        q: `[B, Hq, Sq, D]` (or `[B, Sq, Hq, D]` with `layout="bshd"`), float32/float16/bfloat16.
        k, v: `[B, Hkv, Sk, D]` (or BSHD), Q's dtype and device; Hkv = Hq unless `enable_gqa`.
        attn_mask: as SDPA's, broadcastable to `[B, Hq, Sq, Sk]` (whatever `layout`), on Q's
            device: boolean (True: the key takes part) or float, an additive bias on the scaled
            scores (`softmax(Q Kᵀ · scale + attn_mask)`: T5's and Swin's position biases), read
            as float32 and differentiable (dBias comes from our backward kernels, summed over
            what the mask was broadcast to). A row it hides throughout gives 0, not SDPA's NaN.
            Not together with `softcap`. It runs on the sm_80-class kernels on every GPU (the
            Hopper kernels do not read a bias yet).
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
        softcap: `cap` for logit softcapping, `cap * tanh(s / cap)` on each scaled score (Gemma 2's
            50, Grok's 30); `None` for none.
        alibi: ALiBi's linear biases, `s - slope_h * |i + Sk - Sq - j|` with the paper's slopes per
            query head: `True` (max_bias 8, as the paper, BLOOM and MPT) or a `max_bias`; not
            together with `softcap`.
        sinks: attention sinks (GPT-OSS), a tensor of `Hq` logits (natural log, not scaled) that
            join every row's softmax with no value; differentiable (its gradient is float32, cast
            to the tensor's dtype by autograd).

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
    _check_tensors(q, k, v, 4)
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
    scale, left, right, deterministic, cap, max_bias, sinks = _score_options(
        hq, d, q.device, scale, window, deterministic, softcap, alibi, sinks)
    bias = _prepare_bias(attn_mask, b, hq, sq, k.shape[2], q.device)
    bottom_right = causal_alignment == "bottom-right"
    o, lse = torch.ops.rust_attention.forward(q, k, v, bool(is_causal), bottom_right, left, right, scale,
                                              bool(deterministic), cap, max_bias, sinks, None, None, bias)
    if layout == "bshd":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def _host_offsets(cu_seqlens, name, total):
    """`cu_seqlens` (a tensor or a list) as a CPU int64 tensor, checked: integers, 1-dimensional,
    starting at 0, never decreasing, ending at `total`."""
    offsets = torch.as_tensor(cu_seqlens).detach()
    if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, not {offsets.dtype}")
    if offsets.dim() != 1:
        raise ValueError(f"{name} must be 1-dimensional (batch + 1 offsets), not of shape {tuple(offsets.shape)}")
    # On the host once: a CUDA tensor is read back here (a synchronisation), and the backward
    # reuses the host copy.
    offsets = offsets.to("cpu", torch.int64)
    if not torch.compiler.is_compiling():  # traced, the values are unknown; the native side checks them
        if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != total \
                or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"{name} must start at 0, never decrease and end at the {total} tokens; "
                             f"got {offsets.tolist()[:8]}{'...' if offsets.numel() > 8 else ''}")
    if total > 2**31 - 1:
        raise ValueError(f"{total} tokens exceed the 2**31 - 1 a packed row holds")
    return offsets


def attention_varlen(q, k, v, cu_seqlens, *, cu_seqlens_k=None, is_causal=False, scale=None, window=None,
                     deterministic=None, return_lse=False, softcap=None, alibi=None, sinks=None):
    """Attention over a variable-length batch packed end to end, FlashAttention's
    `flash_attn_varlen_func` layout: sequence `s` holds tokens `cu_seqlens[s] .. cu_seqlens[s + 1]`
    of Q, K and V, and each token attends only to the tokens of its own sequence.

    The batch runs as one packed row with a document mask (`Context::document_mask_from_cu_seqlens`
    in the Rust library, built and uploaded for the forward and again for the backward): the
    kernels skip every key tile outside a query tile's sequences and mask only the tiles that
    straddle a boundary, so the work follows the real tokens, not the longest sequence times the
    batch. Q, K, V are copied to `[1, H, total, D]` for the kernels (they read that layout). By
    default queries and keys share the lengths (self-attention: training and prefill); with
    `cu_seqlens_k` the keys have lengths of their own (chunked prefill against a cache,
    cross-attention: `Context::varlen_mask`). A sequence of length 0 is allowed.

    Args:
        q: `[total, Hq, D]`, float32/float16/bfloat16, `total = cu_seqlens[-1]`.
        k, v: `[total_k, Hkv, D]`, Q's dtype and device; Hkv divides Hq (grouped-query attention);
            `total_k` is `total`, or `cu_seqlens_k[-1]` with `cu_seqlens_k`.
        cu_seqlens: the `batch + 1` prefix sums of the lengths, starting at 0 and non-decreasing
            (an integer tensor or a list). Read to the host once per call: a CPU tensor costs no
            synchronisation, a CUDA one waits for the work before it.
        cu_seqlens_k: the keys' `batch + 1` offsets, as `cu_seqlens`; None: the queries'.
        is_causal: each sequence causal on its own (key j hidden from query i when j > i; with
            `cu_seqlens_k`, aligned bottom-right as FlashAttention's: a sequence's last query sees
            all of its keys, key j hidden when j > i + len_k - len_q).
        scale, window, deterministic, return_lse, softcap, alibi, sinks: as in `attention`
            (a window and ALiBi's distances are counted inside each sequence; with
            `cu_seqlens_k` the window is aligned bottom-right too, and ALiBi is refused).

    Returns:
        O `[total, Hq, D]` (and with `return_lse` the LSE `[Hq, total]`, float32, natural log, as
        FlashAttention's varlen functions return it). Its backward runs our backward kernels.

    Raises:
        ValueError: for shapes, dtypes, devices, offsets or options these kernels do not take.
    """
    _check_tensors(q, k, v, 3)
    total, hq, d = q.shape
    total_k = total if cu_seqlens_k is None else k.shape[0]
    if k.shape != v.shape or k.shape[0] != total_k or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [total, Hkv, D] with q's total "
                         f"(or cu_seqlens_k's) and D")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the {hkv} key/value heads must divide the {hq} query heads")
    offsets = _host_offsets(cu_seqlens, "cu_seqlens", total)
    offsets_k = None if cu_seqlens_k is None else _host_offsets(cu_seqlens_k, "cu_seqlens_k", total_k)
    if offsets_k is not None and offsets_k.numel() != offsets.numel():
        raise ValueError(f"cu_seqlens_k has {offsets_k.numel()} offsets and cu_seqlens {offsets.numel()}; "
                         f"both are the batch + 1 offsets of the same sequences")
    if offsets_k is not None and alibi not in (None, False):
        raise ValueError("alibi with cu_seqlens_k: ALiBi's distances would count across the packed row, "
                         "not inside each sequence; it is not supported there")
    scale, left, right, deterministic, cap, max_bias, sinks = _score_options(
        hq, d, q.device, scale, window, deterministic, softcap, alibi, sinks)
    # [total, H, D] is BSHD with B = 1: the kernels read it as [1, H, total, D].
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    bottom_right = offsets_k is not None
    o, lse = torch.ops.rust_attention.forward(q4, k4, v4, bool(is_causal), bottom_right, left, right, scale,
                                              deterministic, cap, max_bias, sinks, offsets.to(torch.int32),
                                              None if offsets_k is None else offsets_k.to(torch.int32))
    # Contiguous, as FlashAttention's varlen output (a model reshapes it to [total, Hq·D] next).
    o = o.transpose(1, 2).squeeze(0).contiguous()
    return (o, lse.squeeze(0)) if return_lse else o


def device_name(device=None):
    """The name of the device the kernels run on: a CUDA ordinal or `torch.device`, or "cpu" for the emulator."""
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return _native.device_name(-1 if device.type == "cpu" else (device.index or 0))


def forward_kernel(q, k, is_causal=False, causal_alignment="top-left", attn_mask=None):
    """The forward kernel `attention(q, k, ...)` runs for these BHSD tensors (and `attn_mask`), e.g.
    `sm_90a m128_n128_s2 persistent`."""
    bias = _prepare_bias(attn_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    bias = None if bias is None else _ready(bias)
    return _native.forward_kernel(_device_index(q), _DTYPES[q.dtype], _sizes(q, k), bool(is_causal),
                                  causal_alignment == "bottom-right", _address(bias), _bias_dims(bias))

#!/usr/bin/env python3
"""Our attention kernels against PyTorch, on the same tensors, through files.

For each case (shape x dtype x mask) the script makes random Q, K, V and dO with
torch, rounds them to the dtype, writes them (.npy files, or one .safetensors
file), runs our binary on them:

    rust-attention attn --q q.npy --k k.npy --v v.npy --do do.npy \\
        --causal MASK --dtype DTYPE --out OUTDIR --check

reads back O, LSE, dQ, dK, dV, and compares them with

  * the reference: torch.nn.functional.scaled_dot_product_attention and autograd
    in float64 on the same rounded inputs (LSE: torch.logsumexp of the scaled,
    masked scores in float64);
  * PyTorch's own result in the low precision (SDPA + autograd in the dtype),
    so that our error can be read next to PyTorch's against the same reference
    (its LSE through the private efficient-attention op, where that op runs;
    "n/a" otherwise).

It prints one row per case with the relative L2 errors ||x - ref|| / ||ref||,
ours / PyTorch's, and exits with status 1 if any of ours exceeds the tolerance
of its dtype (below) or our binary fails.

Tolerances (relative L2 against float64 on the rounded inputs) are the ones our
own test suite enforces on the kernels (README, "Numerics"): f32 O and LSE 1e-5,
dQ/dK/dV 1e-4; f16 O 3e-3, LSE 1e-4, gradients 1e-2; bf16 O 1e-2, LSE 1e-4,
gradients 2e-2. The 16-bit ones are a few times the error that rounding the
output alone to 16 bits causes (about 3e-4 for f16, 2e-3 for bf16), which
PyTorch's low-precision kernels show too. A '*' marks an error of ours more
than twice PyTorch's (FlashAttention's own test oracle), for reading, not for
the exit status: at f32 both are near 1e-7 and their ratio says little.

Conventions, matched on both sides:
  * layout [batch, heads, seqlen, head_dim]; GQA when K/V have fewer heads (the
    torch side repeats each K/V head over its group with repeat_interleave, so
    autograd sums the group's gradients as our kernels do);
  * masks: "top-left" is SDPA's is_causal (query i sees keys j <= i);
    "bottom-right" (j <= i + seqlen_k - seqlen_q) is an explicit boolean mask;
  * scale 1/sqrt(head_dim) unless the case sets one, rounded to float32 on both
    sides (our binary takes an f32);
  * LSE: natural log, ln sum_j exp(scale * q.k_j), float32 from our binary;
  * bf16 in .npy: numpy has no bfloat16, so the bit patterns are stored as
    uint16 in a file named NAME.bf16.npy (our binary's convention, both ways).

Needs Python 3, numpy and PyTorch (a CUDA build for the GPU; on a machine
without one it runs the references on the CPU, and our binary falls back to its
own CPU reference). The .safetensors format is written and read by a few lines
here, so the `safetensors` package is not needed.

    python3 benches/peers/torch_attn_compare.py                    # .npy files
    python3 benches/peers/torch_attn_compare.py --format safetensors
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:
    sys.exit(f"torch_attn_compare: needs NumPy and PyTorch ({e})")

TOLERANCES = {  # (O, LSE, dQ/dK/dV)
    "f32": (1e-5, 1e-5, 1e-4),
    "f16": (3e-3, 1e-4, 1e-2),
    "bf16": (1e-2, 1e-4, 2e-2),
}
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# name, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, masks, scale (None: 1/sqrt(D))
SHAPES = [
    ("mha d64", 2, 4, 4, 333, 333, 64, ["none", "top-left"], None),
    ("gqa 2:1 d128", 2, 4, 2, 333, 333, 128, ["none", "top-left"], None),
    ("gqa cross d64", 2, 4, 2, 200, 333, 64, ["bottom-right"], 0.1),
]
OUTPUTS = ["o", "lse", "dq", "dk", "dv"]


# ------------------------------------------------------------------ files
def npy_name(name, dtype):
    return f"{name}.bf16.npy" if dtype == torch.bfloat16 else f"{name}.npy"


def save_npy(path, t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        np.save(path, t.view(torch.int16).numpy().view(np.uint16))
    else:
        np.save(path, t.numpy())


def load_npy(path):
    a = np.load(path)
    if path.endswith(".bf16.npy"):
        assert a.dtype == np.uint16, f"{path}: {a.dtype}"
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def raw_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()


def save_safetensors(path, tensors):
    """The safetensors layout: u64 header length, JSON header, the data."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = raw_bytes(t)
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[8 + n + start:8 + n + end]
        np_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<i2"}[info["dtype"]]
        t = torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy()).reshape(info["shape"])
        out[name] = t.view(torch.bfloat16) if info["dtype"] == "BF16" else t
    return out


# ------------------------------------------------------------- reference
def visible_mask(mask, sq, sk, device):
    """Boolean [sq, sk], True where query i may see key j; None without a mask."""
    if mask == "none":
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    offset = 0 if mask == "top-left" else sk - sq
    return j <= i + offset


def torch_attention(q, k, v, d_o, mask, scale):
    """O and dQ, dK, dV by SDPA + autograd in q's dtype, on q's device."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask == "bottom-right":
        bool_mask = visible_mask(mask, q.shape[2], k.shape[2], q.device)
        o = F.scaled_dot_product_attention(q, ke, ve, attn_mask=bool_mask, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, ke, ve, is_causal=(mask == "top-left"), scale=scale)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o)
    return o.detach(), dq, dk, dv


def reference_lse(q, k, mask, scale):
    """ln sum_j exp(scale q.k_j) over the visible keys, float64."""
    group = q.shape[1] // k.shape[1]
    ke = k.double().repeat_interleave(group, dim=1)
    s = (q.double() @ ke.transpose(-1, -2)) * scale
    m = visible_mask(mask, q.shape[2], k.shape[2], q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def torch_lse(q, k, v, mask, scale):
    """PyTorch's own low-precision LSE, from the efficient-attention op (a
    private op; None where it does not run)."""
    try:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        bias = None
        if mask == "bottom-right":
            m = visible_mask(mask, q.shape[2], k.shape[2], q.device)
            bias = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], *m.shape)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, ke, ve, bias, True, 0.0, mask == "top-left", scale=scale)
        lse = out[1]
        if lse.dim() != 3 or tuple(lse.shape[:2]) != tuple(q.shape[:2]) or lse.shape[2] < q.shape[2]:
            return None
        return lse[..., :q.shape[2]].double()
    except Exception:  # noqa: BLE001 - best effort, reported as n/a
        return None


def rel_l2(x, ref):
    """||x - ref|| / ||ref|| in float64, over the entries where ref is finite."""
    if x is None:
        return None
    x, ref = x.double().to(ref.device), ref.double()
    keep = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), keep):
        return float("inf")
    diff = (x[keep] - ref[keep]).norm().item()
    norm = ref[keep].norm().item()
    return diff / norm if norm > 0 else diff


# -------------------------------------------------------------------- run
def run_case(args, workdir, index, shape, dtype_name, mask):
    name, b, hq, hkv, sq, sk, d, _, scale = shape
    dtype = TORCH_DTYPES[dtype_name]
    case_dir = os.path.join(workdir, f"case{index:02d}")
    os.makedirs(case_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed + index)
    inputs = {
        "q": torch.randn(b, hq, sq, d, generator=gen),
        "k": torch.randn(b, hkv, sk, d, generator=gen),
        "v": torch.randn(b, hkv, sk, d, generator=gen),
        "do": torch.randn(b, hq, sq, d, generator=gen),
    }
    inputs = {k: t.to(dtype) for k, t in inputs.items()}  # what both sides see
    scale32 = float(np.float32(scale if scale is not None else 1.0 / d ** 0.5))

    cmd = [args.bin, "attn", "--causal", mask, "--dtype", dtype_name, "--check", "--device", args.ours_device]
    if scale is not None:
        cmd += ["--scale", repr(scale)]
    if args.format == "npy":
        for key, t in inputs.items():
            path = os.path.join(case_dir, npy_name(key, dtype))
            save_npy(path, t)
            cmd += [f"--{key}", path]
        out = os.path.join(case_dir, "out")
    else:
        path = os.path.join(case_dir, "inputs.safetensors")
        save_safetensors(path, inputs)
        cmd += ["--input", path]
        out = os.path.join(case_dir, "out.safetensors")
    cmd += ["--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if args.verbose or proc.returncode != 0:
        print("$ " + " ".join(cmd))
        print(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1]}
    device_line = next((l for l in proc.stdout.splitlines() if l.startswith("device: ")), "device: ?")
    if args.device.startswith("cuda") and args.ours_device not in ("cpu", "cpu-emulated") \
            and "CPU reference" in device_line:
        return {"error": "our binary found no CUDA device and ran its CPU reference instead of the kernels"}
    times = {}
    for line in proc.stdout.splitlines():
        found = re.match(r"^\| *(?:flash|naive|CPU reference) (forward|backward)[^|]*\| *([0-9.]+)", line)
        if found:
            times[found.group(1)] = float(found.group(2))

    if args.format == "npy":
        ours = {k: load_npy(os.path.join(out, npy_name(k, torch.float32 if k == "lse" else dtype)))
                for k in OUTPUTS}
    else:
        ours = load_safetensors(out)

    dev = torch.device(args.device)
    x = {k: t.to(dev) for k, t in inputs.items()}
    ref = dict(zip(["o", "dq", "dk", "dv"], torch_attention(
        *(x[k].double() for k in ("q", "k", "v", "do")), mask, scale32)))
    ref["lse"] = reference_lse(x["q"], x["k"], mask, scale32)
    low = dict(zip(["o", "dq", "dk", "dv"], torch_attention(x["q"], x["k"], x["v"], x["do"], mask, scale32)))
    low["lse"] = torch_lse(x["q"], x["k"], x["v"], mask, scale32)

    for key in OUTPUTS:
        want_dtype = torch.float32 if key == "lse" else dtype
        assert ours[key].dtype == want_dtype, f"{key}: {ours[key].dtype}, expected {want_dtype}"
        assert tuple(ours[key].shape) == tuple(ref[key].shape), f"{key}: {tuple(ours[key].shape)}"
    return {
        "ours": {k: rel_l2(ours[k], ref[k]) for k in OUTPUTS},
        "torch": {k: rel_l2(low[k], ref[k]) for k in OUTPUTS},
        "times": times,
        "device": device_line,
    }


def fmt(e):
    return "n/a" if e is None else f"{e:.1e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=".gpu/bin/rust-attention", help="our binary (default %(default)s)")
    parser.add_argument("--format", choices=["npy", "safetensors"], default="npy",
                        help="files in and out: .npy per tensor, or one .safetensors file each way")
    parser.add_argument("--dtypes", default="f32,f16,bf16", help="comma list (default %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device of the references (default %(default)s)")
    parser.add_argument("--ours-device", default="0", help="our binary's --device (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the files here (default: a temporary directory, removed)")
    parser.add_argument("--verbose", action="store_true", help="print our binary's output for every case")
    args = parser.parse_args()
    if not os.path.exists(args.bin):
        sys.exit(f"no binary at {args.bin}: build it (cargo build --release, or ../shared/tools/gpu-bundle) "
                 "or pass --bin")

    workdir = args.workdir or tempfile.mkdtemp(prefix="torch_attn_compare-")
    os.makedirs(workdir, exist_ok=True)
    print(f"torch {torch.__version__}, references on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
          + f"; our binary {args.bin} --device {args.ours_device}; files: {args.format} in {workdir}")
    header = ["case [B, Hq, Hkv, Sq, Sk, D]", "dtype", "mask", "fwd ms", "bwd ms"] + \
             [f"{k} ours / torch" for k in ("O", "LSE", "dQ", "dK", "dV")] + ["status"]
    rows, failures, index, devices = [], 0, 0, set()
    for dtype_name in args.dtypes.split(","):
        for shape in SHAPES:
            for mask in shape[7]:
                name, b, hq, hkv, sq, sk, d = shape[:7]
                label = f"{name} [{b}, {hq}, {hkv}, {sq}, {sk}, {d}]" + (f" scale {shape[8]}" if shape[8] else "")
                result = run_case(args, workdir, index, shape, dtype_name, mask)
                index += 1
                if "error" in result:
                    failures += 1
                    rows.append([label, dtype_name, mask, "", ""] + [""] * 5 + ["FAILED: " + result["error"]])
                    continue
                devices.add(result["device"])
                tol_o, tol_lse, tol_grad = TOLERANCES[dtype_name]
                tolerance = {"o": tol_o, "lse": tol_lse, "dq": tol_grad, "dk": tol_grad, "dv": tol_grad}
                cells, bad = [], []
                for key in OUTPUTS:
                    ours, peer = result["ours"][key], result["torch"][key]
                    mark = "*" if peer is not None and ours > 2 * peer else ""
                    cells.append(f"{fmt(ours)}{mark} / {fmt(peer)}")
                    if not ours <= tolerance[key]:
                        bad.append(f"{key} {fmt(ours)} > {tolerance[key]:.0e}")
                failures += bool(bad)
                times = result["times"]
                rows.append([label, dtype_name, mask, f"{times.get('forward', float('nan')):.3f}",
                             f"{times.get('backward', float('nan')):.3f}"] + cells
                            + ["ok" if not bad else "FAILED: " + ", ".join(bad)])
                print(f"  {label} {dtype_name} {mask}: {rows[-1][-1]}", flush=True)

    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print()
    print("ours: " + "; ".join(sorted(devices)))
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    print("errors: relative L2 against SDPA + autograd in float64 on the same rounded inputs (LSE: "
          "logsumexp in float64); ours = our binary, torch = SDPA + autograd in the dtype; "
          "* = ours > 2x torch's; times: our binary's kernel medians")
    print("tolerances (ours): " + "; ".join(f"{k} O {o:.0e}, LSE {l:.0e}, grads {g:.0e}"
                                            for k, (o, l, g) in TOLERANCES.items()))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{len(rows) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peer baseline: PyTorch scaled_dot_product_attention, per SDPA backend.

Times the forward and the backward pass of
``torch.nn.functional.scaled_dot_product_attention`` on one NVIDIA GPU, for each
requested shape / dtype / causal mode / backend, and writes one CSV row per pass:

    impl,backend,dtype,batch,heads,seqlen_q,seqlen_k,head_dim,causal,pass,ms,tflops,status,note

Our Rust benchmark writes the same columns, so ``--merge OURS.csv`` can put the
two side by side in one markdown table (also written to bench-results/merged.md).

Method (see README.md next to this file):
  * inputs [batch, heads, seqlen, head_dim], torch.randn with seed 0;
  * each backend is forced with torch.nn.attention.sdpa_kernel(SDPBackend.X);
  * forward: the SDPA call alone, under torch.no_grad() (inference forward);
  * backward: per iteration one untimed forward with grad enabled, then only
    torch.autograd.grad(out, (q, k, v), dO) is timed (autograd.grad returns the
    gradients instead of accumulating into .grad, so nothing grows between runs);
  * CUDA events around each iteration, `--warmup` untimed runs first, median
    of `--repeats` timed runs;
  * FLOPs: forward 4*B*H*Sq*Sk*D (halved when causal), backward 2.5x forward.

The merge code needs only the standard library; torch is imported lazily.
"""
import argparse
import csv
import datetime
import os
import re
import statistics
import subprocess
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from merge import COLUMNS, attention_flops, merge_attention, tflops  # noqa: E402  (beside this file)

DEFAULT_SHAPES = "4x16x4096x64,2x16x8192x128,256x12x197x64"
# Reference pairing of the default shapes; without --dtype each shape is also
# run in the other 16-bit dtype (listed after the reference pairs).
DEFAULT_PAIRS = [("4x16x4096x64", "f16"), ("2x16x8192x128", "bf16"), ("256x12x197x64", "f16")]
OTHER_DTYPE = {"f16": "bf16", "bf16": "f16"}
BACKENDS = {"fa2": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def our_times(args, what):
    """{pass: ms} from one run of our binary (`rust-attention attn ...`, the command in `args`):
    the times of its "flash forward" and "flash backward" lines; `what` names the row in a
    failure message."""
    run = subprocess.run(args, capture_output=True, text=True)
    found = {}
    for line in run.stdout.splitlines():
        m = re.match(r"\|\s*flash (forward|backward)[^|]*\|\s*([\d.]+)\s*\|", line)
        if m:
            found[m.group(1)] = float(m.group(2))
    if run.returncode != 0:
        print(f"our binary failed on {what}: {run.stderr.strip()[-300:]}", file=sys.stderr)
    return found


def row_arguments(doc, rows, warmup, repeats):
    """The command line of the scripts that time rows of ours beside the peers (decode.py,
    windows.py): --ours, --rows (defaulting to `rows`), --warmup and --repeats."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True, help="path of the rust-attention binary")
    p.add_argument("--rows", default=rows, help="comma list of rows (see above)")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--repeats", type=int, default=repeats)
    return p


def parse_shape(s):
    parts = [int(x) for x in s.lower().split("x")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape {s!r} is not BxHxNxD")
    return tuple(parts)


def build_cases(args):
    """List of ((B, H, N, D), dtype) in run order."""
    if args.dtype is None and args.shapes is None:
        pairs = DEFAULT_PAIRS + [(s, OTHER_DTYPE[d]) for s, d in DEFAULT_PAIRS]
        return [(parse_shape(s), d) for s, d in pairs]
    shapes = [parse_shape(s) for s in (args.shapes or DEFAULT_SHAPES).split(",") if s]
    dtype = args.dtype or "both"
    dtypes = ["f16", "bf16"] if dtype == "both" else dtype.split(",")
    return [(s, d) for s in shapes for d in dtypes]


# ----------------------------------------------------------------- measuring
def first_line(text):
    return (str(text).strip().splitlines() or [""])[0]


def classify_error(torch, exc, caught):
    """-> (status, note) for an exception raised by a backend."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc):
        return "out of memory", first_line(exc)
    # With a single backend forced, the reasons arrive as UserWarnings.
    reasons = [first_line(w.message) for w in caught]
    reasons = [r for r in reasons if r and "not used because" not in r]
    note = first_line(exc) or type(exc).__name__
    if reasons:
        note += " | " + "; ".join(dict.fromkeys(reasons))
    return "unsupported", note[:300]


def time_it(torch, fn, setup, warmup, repeats):
    """Median ms of fn(setup()) over `repeats`, CUDA events around fn only."""
    for _ in range(warmup):
        fn(setup())
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        arg = setup()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check(torch, sdpa_kernel, SDPBackend, backend, q, k, v, do, is_causal, label):
    """Compare output and gradients against MATH in float32; prints one line."""
    F = torch.nn.functional
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            msg = _check(torch, F, sdpa_kernel, SDPBackend, backend, q, k, v, do, is_causal)
        except Exception as exc:  # report and carry on; timing decides the status
            msg = "skipped (" + classify_error(torch, exc, caught)[1] + ")"
    print(f"check {label}: {msg}")
    torch.cuda.empty_cache()


def _check(torch, F, sdpa_kernel, SDPBackend, backend, q, k, v, do, is_causal):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=is_causal)
        ref_g = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        got_g = torch.autograd.grad(out, (q, k, v), do)
    errs = [rel_l2(out, ref)] + [rel_l2(a, b) for a, b in zip(got_g, ref_g)]
    flag = "ok" if max(errs) < 5e-2 else "LARGE ERROR"
    return (f"rel L2 out {errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} "
            f"dv {errs[3]:.2e} -> {flag}")


def measure(args):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        sys.exit(f"sdpa_bench: measuring needs PyTorch with CUDA ({e}); "
                 "--peers-csv FILE --merge OURS.csv merges without it")
    F = torch.nn.functional
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    impl = f"pytorch-{torch.__version__}"
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            sys.exit(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    causals = {"none": ["none"], "both": ["none", "top-left"], "only": ["top-left"]}[args.causal_mode]

    print(f"device: {torch.cuda.get_device_name()}   date: "
          f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}  cuda {torch.version.cuda}  "
          f"cudnn {torch.backends.cudnn.version()}  warmup {args.warmup}  repeats {args.repeats}")
    widths = [10, 5, 16, 9, 9, 10, 8, 14]
    head = ["backend", "dtype", "B,H,N,D", "causal", "pass", "ms", "TFLOP/s", "status", "note"]
    print(" ".join(h.ljust(w) for h, w in zip(head, widths + [0])).rstrip())

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for (b, h, n, d), dt in build_cases(args):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtypes[dt])
                           for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            for causal in causals:
                is_causal = causal != "none"
                for backend in backends:
                    label = f"{backend} {dt} {b},{h},{n},{d} causal={causal}"
                    if args.check:
                        check(torch, sdpa_kernel, SDPBackend, backend, q, k, v, do, is_causal, label)
                    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

                    def fwd(_):
                        with torch.no_grad():
                            run()

                    def bwd(out):
                        torch.autograd.grad(out, (q, k, v), do)

                    for pass_, fn, setup in (("forward", fwd, lambda: None),
                                             ("backward", bwd, run)):
                        ms = tf = ""
                        status, note = "ok", ""
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            try:
                                with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
                                    t = time_it(torch, fn, setup, args.warmup, args.repeats)
                                ms = f"{t:.4f}"
                                tf = f"{tflops(attention_flops(b, h, n, n, d, causal, pass_), t):.2f}"
                            except Exception as exc:
                                status, note = classify_error(torch, exc, caught)
                        torch.cuda.empty_cache()
                        writer.writerow([impl, backend, dt, b, h, n, n, d, causal, pass_,
                                         ms, tf, status, note])
                        fh.flush()
                        cells = [backend, dt, f"{b},{h},{n},{d}", causal, pass_, ms, tf, status]
                        print((" ".join(c.ljust(w) for c, w in zip(cells, widths))
                               + " " + note[:70]).rstrip())
            del q, k, v, do
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help=f"comma list of BxHxNxD (default {DEFAULT_SHAPES})")
    p.add_argument("--dtype", help="f16 | bf16 | f32 | both, or a comma list (default: the "
                   "reference pairs 4x16x4096x64 f16, 2x16x8192x128 bf16, 256x12x197x64 f16, "
                   "then each shape in the other dtype; with --shapes: both)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--causal", dest="causal_mode", action="store_const", const="both",
                   help="also run causal (is_causal=True) rows")
    g.add_argument("--causal-only", dest="causal_mode", action="store_const", const="only",
                   help="run only causal rows")
    p.set_defaults(causal_mode="none")
    p.add_argument("--backends", default="fa2,cudnn",
                   help="comma subset of fa2,cudnn,efficient,math (default fa2,cudnn)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations per case (default 10)")
    p.add_argument("--repeats", type=int, default=30, help="timed iterations per case; the median is reported (default 30)")
    p.add_argument("--check", action="store_true",
                   help="first compare each backend with MATH in float32")
    p.add_argument("--out", default="bench-results/peers_sdpa.csv", help="CSV of the measured rows")
    p.add_argument("--merge", nargs="+", metavar="OURS.csv", help="our CSV file(s) to merge")
    p.add_argument("--peers-csv", help="merge this peers CSV instead of measuring")
    p.add_argument("--merged-out", default="bench-results/merged.md", help="markdown of the merged table")
    args = p.parse_args()
    if args.peers_csv is None:
        measure(args)
    if args.merge or args.peers_csv:
        merge_attention(args.merge or [], args.peers_csv or args.out, args.merged_out)


if __name__ == "__main__":
    main()

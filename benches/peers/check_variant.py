#!/usr/bin/env python3
"""Correctness of one variant of our forward on the awkward problems, before `ab.py` times it.

A tile or schedule experiment is forced with a selection knob (RUST_ATTENTION_HOPPER_BLOCK_M, a
branch's own knob) or built into a binary of its own; either way the test suite runs the policy's
choice, not the forced one. This script runs the forced variant on the problems where tiling
code goes wrong — lengths that are not multiples of any tile (1, 17, 197, 333, 577, 1023), cross
attention both ways with bottom-right causal and GQA, a head_dim padded to the next compiled one,
each score modification, a window, a negative scale — under each persistent-grid mode, with the
CPU reference (`attn --check`: float64, the suite's tolerances), and prints one row each:

    python3 benches/peers/check_variant.py --variant m64=target/release/rust-attention:RUST_ATTENTION_HOPPER_BLOCK_M=64 \
        --expect m64_

A variant is written as in `ab.py` (`NAME=BINARY[:KEY=VALUE;...]`). `--expect REGEX` also fails a
row whose kernel label (e.g. `sm_90a m64_n128_s2`) does not match, so a knob that silently falls
back to another tile is caught. `--persistent` lists the RUST_ATTENTION_PERSISTENT modes (default
`1,static,0`); `--head-dims` the head dims of the main problems (default 64; the padded problem
runs at 40 besides). `--only SUBSTRING` keeps the problems whose arguments contain it. Exits 1
if any row fails.
"""
import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import variant  # noqa: E402  (beside this file)

# `attn --check` prints one row per pass:
# | flash forward f16 (sm_90a m64_n64_s2) | 0.412 | 12.3 | O 2.3e-4, LSE 6.4e-8 | PASS |
ROW = re.compile(r"\|\s*flash forward[^|]*\(([^)]*)\)\s*\|[^|]*\|[^|]*\|\s*([^|]*?)\s*\|\s*(PASS|FAIL)\s*\|")


def problems(head_dims):
    """The awkward problems: `attn` arguments after `--random`, one list each."""
    found = []
    for d in head_dims:
        found += [
            [f"4x12x1x{d}", "--dtype", "f16"],
            [f"4x12x17x{d}", "--dtype", "f16"],
            [f"8x12x197x{d}", "--dtype", "f16"],
            [f"3x12x333x{d}", "--dtype", "bf16", "--causal", "top-left"],
            [f"2x8x577x{d}", "--dtype", "bf16"],
            [f"2x4x1023x{d}", "--dtype", "f16", "--causal", "top-left"],
            [f"1x8x2x17x700x{d}", "--dtype", "f16", "--causal", "bottom-right"],
            [f"1x8x2x700x17x{d}", "--dtype", "bf16", "--causal", "bottom-right"],
            [f"2x4x197x{d}", "--dtype", "f16", "--scale", "-0.2"],
            [f"2x4x197x{d}", "--dtype", "bf16", "--softcap", "30"],
            [f"2x4x197x{d}", "--dtype", "f16", "--alibi"],
            [f"2x4x197x{d}", "--dtype", "f16", "--sinks", "0.5"],
            [f"2x4x300x{d}", "--dtype", "f16", "--window", "50,20"],
        ]
    # A head_dim that is not compiled: it runs on the next one up, with padded columns.
    return found + [["2x4x200x40", "--dtype", "f16"]]


def check(binary, env, args, extra):
    """(kernel label, errors, verdict) of one `attn --check --forward-only` run."""
    cmd = [binary, "attn", "--check", "--forward-only", "--warmup", "0", "--repeats", "1", "--random", *args, *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    m = ROW.search(run.stdout)
    if not m:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return "—", tail[0][:120], "FAIL"
    label, errors, verdict = m.groups()
    return label, errors, verdict if run.returncode == 0 else "FAIL"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", type=variant, required=True, help="NAME=BINARY[:KEY=VALUE;...]")
    p.add_argument("--expect", help="regex the kernel label of every row must match")
    p.add_argument("--persistent", default="1,static,0", help="RUST_ATTENTION_PERSISTENT modes (comma list)")
    p.add_argument("--head-dims", default="64", help="head dims of the main problems (comma list)")
    p.add_argument("--only", help="keep the problems whose arguments contain this")
    p.add_argument("extra", nargs="*", help="more `attn` arguments after --, e.g. -- --device cpu-emulated")
    args = p.parse_args()
    name, binary, env = args.variant
    cases = problems([int(d) for d in args.head_dims.split(",") if d])
    cases = [c for c in cases if args.only is None or args.only in " ".join(c)]
    modes = [m for m in args.persistent.split(",") if m]

    print(f"variant {name}: {binary} {' '.join(f'{k}={v}' for k, v in env.items())}")
    print("| problem (attn --random …) | persistent | kernel | rel L2 error vs f64 | check |")
    print("|---|---|---|---|---|")
    failed = 0
    for mode in modes:
        for case in cases:
            label, errors, verdict = check(binary, {**env, "RUST_ATTENTION_PERSISTENT": mode}, case, args.extra)
            if verdict == "PASS" and args.expect and not re.search(args.expect, label):
                verdict = f"FAIL (kernel not /{args.expect}/)"
            failed += not verdict.startswith("PASS")
            print(f"| {' '.join(case)} | {mode} | {label} | {errors} | {verdict} |", flush=True)
    total = len(cases) * len(modes)
    print(f"check_variant {name}: {total - failed} of {total} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

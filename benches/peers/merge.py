#!/usr/bin/env python3
"""Merges our benchmark CSVs with the peers' into one markdown file and two pictures.

    python3 benches/peers/merge.py            # defaults: everything under bench-results/

* attention: bench-results/ours.csv (`cargo bench --bench tile_sweep`: our fastest tile per row)
  and bench-results/peers_sdpa.csv (`sdpa_bench.py`: PyTorch SDPA per backend), one row per
  (shape, dtype, causal, pass), TFLOP/s per implementation, and ours / FA2, ours / cuDNN;
* vector add: bench-results/vector_add.csv (`cargo bench --bench vector_add`: Rust, CUDA C++,
  the driver's copy) and bench-results/peers_vector_add.csv (`vector_add_bench.py`: Triton,
  PyTorch add and copy), GB/s per N.

Writes bench-results/merged.md, merged_attention.png and merged_vector_add.png (the pictures need
matplotlib; without it only the markdown is written). The table code needs only the standard
library.
"""
import argparse
import csv
import os
import sys

COLUMNS = ["impl", "backend", "dtype", "batch", "heads", "seqlen_q", "seqlen_k",
           "head_dim", "causal", "pass", "ms", "tflops", "status", "note"]
def attention_flops(b, h, sq, sk, d, causal, pass_):
    f = 4.0 * b * h * sq * sk * d
    if causal != "none":
        f /= 2
    return f * 2.5 if pass_ == "backward" else f


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def read_rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            sys.exit(f"{path}: missing columns {', '.join(missing)}")
        rows = list(reader)
    for r in rows:
        for c in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"):
            r[c] = int(r[c])
        r["tf"] = None
        if r["status"].strip() == "ok":
            if r["tflops"].strip():
                r["tf"] = float(r["tflops"])
            elif r["ms"].strip():
                r["tf"] = tflops(attention_flops(r["batch"], r["heads"], r["seqlen_q"],
                                                 r["seqlen_k"], r["head_dim"], r["causal"],
                                                 r["pass"]), float(r["ms"]))
    return rows


def merge_attention(ours_paths, peers_paths, md_out=None):
    """The side-by-side markdown table; also written to `md_out` if given."""
    ours = [r for p in ours_paths for r in read_rows(p)]
    if isinstance(peers_paths, str):
        peers_paths = [peers_paths]
    peers = [r for p in peers_paths for r in read_rows(p)]
    key = lambda r: (r["batch"], r["heads"], r["seqlen_q"], r["seqlen_k"], r["head_dim"],
                     r["dtype"], r["causal"], r["pass"])
    keys, cols, cells = [], [], {}
    for r in peers + ours:                      # row order: peers first
        if key(r) not in keys:
            keys.append(key(r))
    tiles = {}                                  # our fastest tile per row
    for r in ours + peers:                      # column order: ours first
        # One column per Rust implementation (its tile goes in the "our tile" column), one per
        # peer backend.
        col = r["impl"] if r["impl"].startswith("rust-") else f"{r['impl']}/{r['backend']}"
        if col not in cols:
            cols.append(col)
        prev = cells.get((key(r), col))
        if r["tf"] is not None:
            if not isinstance(prev, float) or r["tf"] > prev:
                cells[(key(r), col)] = r["tf"]
                if r["impl"].startswith("rust-"):
                    tiles[(key(r), col)] = f"{r['impl'][5:]} {r['backend']}"
        elif prev is None:
            cells[(key(r), col)] = "oom" if r["status"] == "out of memory" else "n/a"

    def best(k, pred):
        vals = [cells.get((k, c)) for c in cols if pred(c)]
        vals = [x for x in vals if isinstance(x, float)]
        return max(vals) if vals else None

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    header = ["shape (B,H,N,D)", "dtype", "causal", "pass"] + cols + ["ours / fa2", "ours / cudnn", "our tile"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * 4 + "---:|" * (len(cols) + 2) + "---|"]
    for k in keys:
        b, h, sq, sk, d, dt, causal, pass_ = k
        n = str(sq) if sq == sk else f"{sq}/{sk}"
        vals = [cells.get((k, c), "-") for c in cols]
        vals = [(f"{x:.1f}" if x >= 10 else f"{x:.3g}") if isinstance(x, float) else x
                for x in vals]
        mine = best(k, lambda c: c.startswith("rust-"))
        peer = lambda name: best(k, lambda c: not c.startswith("rust-") and c.endswith("/" + name))
        tile = " / ".join(tiles[(k, c)] for c in cols if (k, c) in tiles)
        row = [f"{b},{h},{n},{d}", dt, causal, pass_] + vals + [ratio(mine, peer("fa2")),
                                                                ratio(mine, peer("cudnn")), tile or "-"]
        lines.append("| " + " | ".join(row) + " |")
    text = ("TFLOP/s, higher is better; \"ours\" = best `rust-*` column for the row.\n\n"
            + "\n".join(lines) + "\n")
    if md_out:
        print(text)
        os.makedirs(os.path.dirname(md_out) or ".", exist_ok=True)
        with open(md_out, "w") as fh:
            fh.write(text)
        print(f"wrote {md_out}")
    return text



def read_bandwidth(path):
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["n"] = int(r["n"])
        r["gb_per_s"] = float(r["gb_per_s"]) if r["status"] == "ok" else None
    return rows


def merge_vector_add(paths, png_out):
    rows = [r for p in paths if os.path.exists(p) for r in read_bandwidth(p)]
    if not rows:
        return ""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    sizes = sorted({r["n"] for r in rows})
    cell = {(r["impl"], r["n"]): r["gb_per_s"] for r in rows}
    lines = ["| N | " + " | ".join(f"{i} (GB/s)" for i in impls) + " | rust / copy |",
             "|---:|" + "---:|" * (len(impls) + 1)]
    for n in sizes:
        vals = [cell.get((i, n)) for i in impls]
        copies = [cell.get((i, n)) for i in impls if i.startswith("copy") and cell.get((i, n))]
        rust = cell.get(("rust", n))
        share = f"{100 * rust / max(copies):.1f} %" if rust and copies else "-"
        lines.append(f"| 2^{n.bit_length() - 1} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in vals)
                     + f" | {share} |")
    text = ("### Vector add c = a + b (f32), GB/s (12 B/element; copies 8 B/element); "
            "rust / copy: against the faster copy of the run\n\n" + "\n".join(lines) + "\n")
    plot(png_out, lambda ax: [ax.plot(sizes, [cell.get((i, n)) for n in sizes], marker="o", label=i)
                              for i in impls],
         "N (elements)", "GB/s", "Vector add and copy bandwidth", logx=True)
    return text


def merge_attention_plot(ours_paths, peers_paths, png_out):
    """Grouped bars: TFLOP/s of ours and each peer backend per (shape, dtype, causal, pass)."""
    rows = [r for p in ours_paths if os.path.exists(p) for r in read_rows(p)]
    rows += [r for p in peers_paths for r in read_rows(p)]
    key = lambda r: f"{r['batch']}x{r['heads']}x{r['seqlen_q']}x{r['head_dim']} {r['dtype']}" \
                    f"{' causal' if r['causal'] != 'none' else ''} {'fwd' if r['pass'] == 'forward' else 'bwd'}"
    series = {}
    for r in rows:
        name = "ours" if r["impl"].startswith("rust-") else r["backend"]
        if r["tf"] is not None:
            best = series.setdefault(name, {})
            best[key(r)] = max(best.get(key(r), 0.0), r["tf"])
    labels = [k for k in dict.fromkeys(key(r) for r in rows) if "ours" in series and k in series["ours"]]

    def draw(ax):
        width = 0.8 / max(1, len(series))
        for j, (name, values) in enumerate(series.items()):
            xs = [i + j * width for i in range(len(labels))]
            ax.bar(xs, [values.get(k, 0.0) for k in labels], width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)

    plot(png_out, draw, "", "TFLOP/s", "Attention: ours vs PyTorch SDPA backends", width=max(8, len(labels) * 0.45))


def plot(path, draw, xlabel, ylabel, title, logx=False, width=8):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not found: {path} not drawn")
        return
    fig, ax = plt.subplots(figsize=(width, 5))
    draw(ax)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = "bench-results"
    p.add_argument("--ours", nargs="+", default=[f"{d}/ours.csv"], help="our attention CSV(s)")
    p.add_argument("--peers", nargs="+", default=[f"{d}/peers_sdpa.csv", f"{d}/peers_sdpa_f32.csv"],
                   help="the SDPA CSV(s); missing ones are skipped")
    p.add_argument("--vector-add", nargs="+", default=[f"{d}/vector_add.csv", f"{d}/peers_vector_add.csv"])
    p.add_argument("--out", default=f"{d}/merged.md")
    args = p.parse_args()
    parts = []
    peers = [p for p in args.peers if os.path.exists(p)]
    if peers and all(os.path.exists(o) for o in args.ours):
        parts.append(merge_attention(args.ours, peers))
        merge_attention_plot(args.ours, peers, os.path.join(d, "merged_attention.png"))
    parts.append(merge_vector_add(args.vector_add, os.path.join(d, "merged_vector_add.png")))
    text = "\n".join(x for x in parts if x)
    if not text:
        sys.exit("nothing to merge: run the benches first")
    with open(args.out, "w") as fh:
        fh.write(text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

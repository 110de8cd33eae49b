#!/usr/bin/env python3
"""Writes the guide's diagrams as SVG files into docs/guide/src/diagrams/.

Every picture is computed from the same rules the kernels use (the thread mapping of
kernels/src/simt/forward.rs, the m16n8k16 fragment layout of the PTX ISA that
kernels/src/hw/mma.rs documents, the shared-memory strides of kernels/src/layout.rs), so a
change of those rules should be made here too. Plain string formatting, no packages:

    python3 docs/guide/diagrams/make_diagrams.py
"""
import math
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "diagrams")

# Colours: one per lane of a row group (8), then the tile kinds.
LANE_COLOURS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"]
FULL, PARTIAL, SKIPPED = "#80b1d3", "#fdb462", "#eeeeee"


def svg(width, height, body):
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n{body}</svg>\n'
    )


def rect(x, y, w, h, fill, stroke="#444", sw=0.5):
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"/>\n'


def text(x, y, s, size=12, anchor="middle", weight="normal", fill="#000"):
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}">{s}</text>\n')


def write(name, content):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w") as f:
        f.write(content)
    print("wrote", os.path.join("docs/guide/src/diagrams", name))


def tiling():
    """Q in blocks of block_m rows, K and V in tiles of block_n rows, and the score matrix S of
    one head with a top-left causal mask: which (query block, key tile) pairs are skipped, fully
    visible, or cross the diagonal (masked per element)."""
    seqlen, block_m, block_n = 12, 4, 3  # rows; drawn with `cell` pixels per row
    cell = 16
    ox, oy = 150, 70
    body = text(330, 24, "One head: Q in blocks of block_m rows, K and V in tiles of block_n rows", 15, weight="bold")
    body += text(330, 44, f"(seqlen_q = seqlen_k = {seqlen}, block_m = {block_m}, block_n = {block_n}, causal top-left)", 12)
    # Q on the left, vertical
    qx = ox - 70
    for b in range(seqlen // block_m):
        body += rect(qx, oy + b * block_m * cell, 40, block_m * cell, ["#fbb4ae", "#b3cde3", "#ccebc5"][b])
        body += text(qx + 20, oy + (b + 0.5) * block_m * cell + 4, f"Q{b}", 12)
    body += text(qx + 20, oy - 8, "Q", 13, weight="bold")
    # K^T across the top
    ky = oy - 60
    for t in range(seqlen // block_n):
        body += rect(ox + t * block_n * cell, ky, block_n * cell, 40, "#decbe4")
        body += text(ox + (t + 0.5) * block_n * cell, ky + 24, f"K{t}ᵀ", 12)
    # S
    for r in range(seqlen):
        for c in range(seqlen):
            qb, kt = r // block_m, c // block_n
            first, last = qb * block_m, qb * block_m + block_m - 1
            lo, hi = kt * block_n, kt * block_n + block_n - 1
            if lo > last:
                fill = SKIPPED  # no row of the block sees any key of the tile: never loaded
            elif hi <= first:
                fill = FULL  # every row sees every key: no per-element mask
            else:
                fill = PARTIAL if c <= r else "#fff3e0"
            vis = c <= r
            body += rect(ox + c * cell, oy + r * cell, cell, cell, fill, "#999", 0.3)
            if fill in (PARTIAL, "#fff3e0") and not vis:
                body += text(ox + (c + 0.5) * cell, oy + (r + 0.5) * cell + 4, "−∞", 8, fill="#a33")
    # block and tile boundaries
    for b in range(seqlen // block_m + 1):
        y = oy + b * block_m * cell
        body += f'<line x1="{ox}" y1="{y}" x2="{ox + seqlen * cell}" y2="{y}" stroke="#000" stroke-width="1.5"/>\n'
    for t in range(seqlen // block_n + 1):
        x = ox + t * block_n * cell
        body += f'<line x1="{x}" y1="{oy}" x2="{x}" y2="{oy + seqlen * cell}" stroke="#000" stroke-width="1.5"/>\n'
    body += text(ox + seqlen * cell / 2, oy + seqlen * cell + 20, "S = Q Kᵀ · scale (never stored)", 12)
    # V on the right, vertical
    vx = ox + seqlen * cell + 40
    for t in range(seqlen // block_n):
        body += rect(vx, oy + t * block_n * cell, 40, block_n * cell, "#fed9a6")
        body += text(vx + 20, oy + (t + 0.5) * block_n * cell + 4, f"V{t}", 12)
    body += text(vx + 20, oy - 8, "V", 13, weight="bold")
    # legend
    lx, ly = vx + 70, oy + 10
    for i, (fill, label) in enumerate([(FULL, "fully visible tile: no mask"),
                                       (PARTIAL, "crosses the diagonal: masked"),
                                       (SKIPPED, "hidden from the whole block: skipped")]):
        body += rect(lx, ly + i * 26, 18, 18, fill)
        body += text(lx + 26, ly + i * 26 + 14, label, 12, anchor="start")
    body += text(lx, ly + 100, "A block (one Q block) walks its", 12, anchor="start")
    body += text(lx, ly + 116, "row of tiles left to right, loading", 12, anchor="start")
    body += text(lx, ly + 132, "K_j and V_j into shared memory once", 12, anchor="start")
    body += text(lx, ly + 148, "per tile, and stops at the last tile", 12, anchor="start")
    body += text(lx, ly + 164, "its last row may see.", 12, anchor="start")
    write("tiling.svg", svg(720, oy + seqlen * cell + 40, body))


def thread_grid():
    """The 16 x 8 thread grid of the f32 kernels (kernels/src/simt/tile.rs): which of the 128
    threads owns each score of a block_m x block_n tile, and each output column."""
    block_m, block_n, head_dim, lanes, groups = 32, 16, 64, 8, 16
    rows = block_m // groups  # ROWS: query rows per thread
    cols = block_n // lanes  # COLS: key columns per thread
    cell = 26
    ox, oy = 40, 70
    body = text(420, 22, f"Thread-to-element map, block_m = {block_m}, block_n = {block_n}, head_dim = {head_dim} "
                f"(128 threads = 16 row groups × 8 lanes)", 14, weight="bold")
    body += text(420, 42, f"thread t = 8 · row_group + lane owns rows row_group · ROWS + i (ROWS = {rows}) and "
                 f"key columns lane + 8 · j (COLS = {cols})", 12)
    for r in range(block_m):
        for c in range(block_n):
            group, lane = r // rows, c % lanes
            t = group * lanes + lane
            body += rect(ox + c * cell, oy + r * 16, cell, 16, LANE_COLOURS[lane], "#888", 0.3)
            body += text(ox + (c + 0.5) * cell, oy + r * 16 + 12, str(t), 9)
    for g in range(groups + 1):
        y = oy + g * rows * 16
        body += f'<line x1="{ox}" y1="{y}" x2="{ox + block_n * cell}" y2="{y}" stroke="#000" stroke-width="{1.6 if g % 4 == 0 else 0.8}"/>\n'
    body += text(ox + block_n * cell / 2, oy - 8, "scores s[i][j] (block_m × block_n)", 12)
    body += text(ox + block_n * cell / 2, oy + block_m * 16 + 18, "thick lines: warps (4 row groups each)", 11)
    # Output: acc columns 4*lane + 32*g .. +4
    ox2 = ox + block_n * cell + 60
    w = 6
    for r in range(block_m):
        for c in range(head_dim):
            lane = (c % 32) // 4
            group = r // rows
            body += rect(ox2 + c * w, oy + r * 16, w, 16, LANE_COLOURS[lane], "#bbb", 0.2)
        if r % rows == 0:
            body += text(ox2 - 6, oy + r * 16 + 12, f"group {r // rows}", 8, anchor="end")
    for g in range(groups + 1):
        y = oy + g * rows * 16
        body += f'<line x1="{ox2}" y1="{y}" x2="{ox2 + head_dim * w}" y2="{y}" stroke="#000" stroke-width="0.8"/>\n'
    for c in range(0, head_dim, 4):
        body += text(ox2 + (c + 2) * w, oy + block_m * 16 + 14, str((c % 32) // 4), 8)
    body += text(ox2 + head_dim * w / 2, oy - 8, "output acc[i][g] (block_m × head_dim)", 12)
    body += text(ox2 + head_dim * w / 2, oy + block_m * 16 + 30, "lane owning columns 4·lane + 32·g … +4", 11)
    write("thread_grid.svg", svg(ox2 + head_dim * w + 30, oy + block_m * 16 + 50, body))


def fragment():
    """The m16n8k16 fragments of mma.sync: which lane (and register) holds each element of
    A (16x16), B (16x8) and C/D (16x8). g = lane / 4, t = lane % 4."""
    cell = 30
    body = text(560, 22, "mma.sync.m16n8k16: which lane holds each element (g = lane / 4, t = lane % 4)", 15, weight="bold")
    colours = ["#fbb4ae", "#b3cde3", "#ccebc5", "#decbe4", "#fed9a6", "#ffffcc", "#e5d8bd", "#fddaec"]

    def a_owner(r, c):
        g, hi_r = r % 8, r // 8
        t, reg_pair = (c % 8) // 2, c // 8
        return 4 * g + t, 2 * reg_pair + hi_r  # register a0..a3

    def b_owner(k, n):
        return 4 * n + (k % 8) // 2, k // 8  # b0, b1

    def c_owner(r, c):
        return 4 * (r % 8) + c // 2, (r // 8) * 2 + c % 2  # c0..c3

    panels = [("A (16 × 16, row-major, 16-bit): lane/a_reg", 16, 16, a_owner, 20),
              ("B (16 × 8 = k × n, 16-bit): lane/b_reg", 16, 8, b_owner, 520),
              ("C, D (16 × 8, f32): lane/c_reg", 16, 8, c_owner, 800)]
    oy = 60
    for title, nr, nc, owner, ox in panels:
        body += text(ox + nc * cell / 2, oy - 10, title, 12, weight="bold")
        for r in range(nr):
            for c in range(nc):
                lane, reg = owner(r, c)
                body += rect(ox + c * cell, oy + r * 22, cell, 22, colours[lane // 4], "#777", 0.3)
                body += text(ox + (c + 0.5) * cell, oy + r * 22 + 15, f"{lane}/{reg}", 9)
    body += text(560, oy + 16 * 22 + 24, "colour = g (the lane's group of 4): a row of C is held by the 4 lanes of one group, "
                 "so row maxima and sums need only shuffles among 4 lanes", 12)
    body += text(560, oy + 16 * 22 + 42, "C's c0, c1 (columns 0–7) and those of the next 8 columns have the layout of A's a0 and a2: "
                 "P = softmax(S) feeds P·V from registers", 12)
    write("fragment_m16n8.svg", svg(1120, oy + 16 * 22 + 60, body))


def shared_memory():
    """The f32 forward block's dynamic shared memory (layout::flash_forward_strides), drawn to
    scale for block_m = block_n = head_dim = 64: four tiles one after another, each row padded
    by SMEM_PAD = 4 floats except V's."""
    block_m, block_n, head_dim, pad = 64, 64, 64, 4
    tiles = [("Q", block_m, head_dim + pad, head_dim, "#fbb4ae"), ("K", block_n, head_dim + pad, head_dim, "#decbe4"),
             ("V", block_n, head_dim, head_dim, "#fed9a6"), ("P", block_m, block_n + pad, block_n, "#b3de69")]
    sx, sy = 5, 2.2  # pixels per float column, per row
    ox, oy = 150, 60
    body = text(380, 22, "Shared memory of one f32 forward block: block_m = block_n = head_dim = 64", 15, weight="bold")
    offset = 0
    y = oy
    for name, nrows, stride, used, fill in tiles:
        h = nrows * sy
        body += rect(ox, y, used * sx, h, fill)
        if stride > used:
            body += rect(ox + used * sx, y, (stride - used) * sx, h, "#dddddd")
        nbytes = nrows * stride * 4
        body += text(ox - 10, y + h / 2 - 4, f"{name}: {nrows} × {stride}", 12, anchor="end")
        body += text(ox - 10, y + h / 2 + 12, f"bytes {offset}–{offset + nbytes - 1}", 10, anchor="end")
        body += text(ox + used * sx / 2, y + h / 2 + 4, f"{name} ({nrows} rows × {used} floats)", 12)
        offset += nbytes
        y += h + 8
    body += text(ox + (head_dim + pad) * sx + 20, oy + 20, "grey: 4 floats of padding per row", 12, anchor="start")
    body += text(ox + (head_dim + pad) * sx + 20, oy + 38, "(a row stride of 68 floats puts the 8 rows", 12, anchor="start")
    body += text(ox + (head_dim + pad) * sx + 20, oy + 54, "that 8 lanes read at once in different", 12, anchor="start")
    body += text(ox + (head_dim + pad) * sx + 20, oy + 70, "banks: no bank conflicts)", 12, anchor="start")
    body += text(ox + (head_dim + pad) * sx + 20, oy + 100, f"total: {offset} bytes = {offset / 1024:.1f} KiB", 12, anchor="start", weight="bold")
    body += text(ox + (head_dim + pad) * sx + 20, oy + 118, "(layout::flash_forward_smem_bytes)", 12, anchor="start")
    write("shared_memory.svg", svg(760, int(y) + 20, body))
    return offset


def hbm_traffic():
    """Device-memory bytes of one forward pass, naive against flash, for batch 1, 12 heads,
    head_dim 64 (the main job's "long" case at N = 4096). Naive: S written by the scores kernel,
    read three times and written once by the softmax (max, sum, normalise), read by P·V: 6 passes
    over N x N floats (PERFORMANCE.md: "6 x 805 MB" at N = 4096), plus the 4 tensors. Flash: Q, K, V read and O written once, plus the LSE
    (K/V re-reads by other query blocks of a head are served by L2 and not counted)."""
    heads, d = 12, 64
    ns = [1024, 2048, 4096, 8192, 16384]
    naive = [heads * (6 * n * n * 4 + 4 * n * d * 4) for n in ns]
    flash = [heads * (4 * n * d * 4 + n * 4) for n in ns]
    ox, oy, w, h = 90, 60, 560, 300
    lo, hi = 6, 12  # log10 bytes axis: 1 MB .. 1 TB
    body = text(380, 22, "Device-memory traffic of one forward pass (batch 1, 12 heads, head_dim 64, f32)", 15, weight="bold")
    body += text(380, 42, "naive: S = QKᵀ written, read 3× and rewritten by the softmax, read by P·V; flash: Q, K, V, O and LSE once", 11)

    def ypos(v):
        return oy + h - (math.log10(v) - lo) / (hi - lo) * h
    for e in range(lo, hi + 1):
        y = ypos(10 ** e)
        body += f'<line x1="{ox}" y1="{y:.1f}" x2="{ox + w}" y2="{y:.1f}" stroke="#ddd"/>\n'
        body += text(ox - 8, y + 4, {6: "1 MB", 7: "10 MB", 8: "100 MB", 9: "1 GB", 10: "10 GB", 11: "100 GB", 12: "1 TB"}[e], 11, anchor="end")
    slot = w / len(ns)
    for i, n in enumerate(ns):
        x = ox + i * slot + slot * 0.15
        for j, (vals, fill) in enumerate([(naive, "#fb8072"), (flash, "#80b1d3")]):
            y = ypos(vals[i])
            body += rect(x + j * slot * 0.35, y, slot * 0.33, oy + h - y, fill)
            label = f"{vals[i] / 1e9:.2f} GB" if vals[i] >= 1e9 else f"{vals[i] / 1e6:.0f} MB"
            body += text(x + j * slot * 0.35 + slot * 0.165, y - 4, label, 9)
        body += text(ox + (i + 0.5) * slot, oy + h + 16, f"N = {n}", 11)
    body += rect(ox + w - 150, oy + 8, 14, 14, "#fb8072") + text(ox + w - 130, oy + 20, "naive", 11, anchor="start")
    body += rect(ox + w - 150, oy + 28, 14, 14, "#80b1d3") + text(ox + w - 130, oy + 40, "flash", 11, anchor="start")
    write("hbm_traffic.svg", svg(700, oy + h + 40, body))
    return list(zip(ns, naive, flash))


if __name__ == "__main__":
    tiling()
    thread_grid()
    fragment()
    total = shared_memory()
    traffic = hbm_traffic()
    print("shared memory bytes (64, 64, 64):", total)
    for n, a, b in traffic:
        print(f"N = {n}: naive {a / 1e9:.3f} GB, flash {b / 1e6:.1f} MB, ratio {a / b:.0f}")

"""Draw the documentation's pictures (partition layouts, decompositions, how each primitive moves blocks).

Run: python docs/make_figures.py [OUTPUT_DIR]   (``make docs`` runs it; default docs/_static/figures)

Every picture is computed, not drawn by hand: block bounds come from distdl's balanced decomposition
(:mod:`distdl.utilities.slicing`) and which worker feeds which from NumPy broadcasting on the grid
shapes, the rule :meth:`distdl.MPIPartition.create_broadcast_partition_to` follows. A worker is a
box labelled with its rank; the small squares inside are the elements of its local tensor, coloured
by the worker whose input they came from (a blend of colours is a sum).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from distdl.utilities.slicing import compute_start_index, compute_stop_index  # noqa: E402

COLORS = np.array(plt.get_cmap("tab10").colors)[[0, 1, 2, 3, 4, 6, 8, 9]]
EMPTY = np.ones(3)
CELL, GAP = 0.28, 0.45


def color(worker: int) -> np.ndarray:
    return COLORS[worker % len(COLORS)]


def bounds(P_shape, index, shape):
    start, stop = compute_start_index(P_shape, index, shape), compute_stop_index(P_shape, index, shape)
    return tuple(slice(int(a), int(b)) for a, b in zip(start, stop))


def owners(P_shape, shape) -> np.ndarray:
    """Return the global tensor's cells coloured by the rank (row-major) of the worker holding each."""
    cells = np.zeros(tuple(shape) + (3,))
    for rank, index in enumerate(np.ndindex(*P_shape)):
        cells[bounds(P_shape, index, shape)] = color(rank)
    return cells


def as_2d(cells: np.ndarray) -> np.ndarray:
    return cells.reshape((1,) + cells.shape) if cells.ndim == 2 else cells


def draw_panel(ax, title: str, workers: list, box=None) -> tuple[float, float, float, float]:
    """Draw workers: ``(grid position (i, j), label, cells (rows, cols, 3), None (zero-volume) or False
    (nothing), note)``; return the extents ``(x0, x1, y0, y1)`` drawn."""
    drawn = [as_2d(c) for _, _, c, _ in workers if c is not None and c is not False]
    if box is None:
        rows = max([c.shape[0] for c in drawn] + [1])
        cols = max([c.shape[1] for c in drawn] + [1])
        box = (cols * CELL + 0.3, rows * CELL + 0.3)
    w, h = box
    x1 = y0 = 0.0
    for (i, j), label, cells, note in workers:
        x, y = j * (w + GAP), -i * (h + GAP + 0.25)
        x1, y0 = max(x1, x + w), min(y0, y - 0.3)
        ax.add_patch(Rectangle((x, y), w, h, fill=False, ec="0.35", lw=1))
        ax.text(x + w / 2, y + h + 0.05, label, ha="center", va="bottom", fontsize=8)
        if cells is None:
            ax.text(x + w / 2, y + h / 2, "zero-volume", ha="center", va="center", fontsize=6, color="0.45")
        elif cells is not False:
            cells = as_2d(cells)
            r, c = cells.shape[:2]
            ox, oy = x + (w - c * CELL) / 2, y + (h - r * CELL) / 2
            for a in range(r):
                for b in range(c):
                    ax.add_patch(Rectangle((ox + b * CELL, oy + (r - 1 - a) * CELL), CELL, CELL,
                                           fc=cells[a, b], ec="white", lw=0.6))
        if note:
            ax.text(x + w / 2, y - 0.05, note, ha="center", va="top", fontsize=7, color="0.25")
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    return -0.1, x1 + 0.1, y0, h + 0.45


def figure(path: Path, panels: list, box=None) -> None:
    """Draw panels ``(title, workers)`` side by side, to scale, with their tops aligned."""
    scale = 0.62  # inches per unit
    fig = plt.figure()
    axes = [fig.add_subplot(1, len(panels), k + 1) for k in range(len(panels))]
    extents = [draw_panel(ax, title, workers, box) for ax, (title, workers) in zip(axes, panels)]
    top, bottom = max(e[3] for e in extents), min(e[2] for e in extents)
    widths = [max(e[1] - e[0], 0.14 * len(title)) for e, (title, _) in zip(extents, panels)]
    fig.set_size_inches(scale * (sum(widths) + 0.8 * len(panels)), scale * (top - bottom) + 0.5)
    left = 0.0
    total = sum(widths) + 0.8 * len(panels)
    for ax, e, w in zip(axes, extents, widths):
        middle = (e[0] + e[1]) / 2
        ax.set_xlim(middle - w / 2, middle + w / 2)
        ax.set_ylim(bottom, top)
        ax.set_position([(left + 0.4) / total, 0.02, w / total, (scale * (top - bottom)) / fig.get_size_inches()[1]])
        left += w + 0.8
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grid_workers(P_shape, label, cells_of, note_of=lambda rank, index: None, ranks=None):
    out = []
    for rank, index in enumerate(np.ndindex(*P_shape)):
        position = index if len(index) == 2 else (0, index[0])
        name = label(rank if ranks is None else ranks[rank], index)
        out.append((position, name, cells_of(rank, index), note_of(rank, index)))
    return out


def fed_by(src_shape, dest_index) -> tuple[int, ...]:
    """Return the index of the source worker that broadcasts to ``dest_index`` (NumPy rules)."""
    padded = (1,) * (len(dest_index) - len(src_shape)) + tuple(src_shape)
    index = tuple(0 if s == 1 else i for s, i in zip(padded, dest_index))
    return index[len(index) - len(src_shape):]


def partitions(out: Path) -> None:
    shape = (2, 3)
    grid = grid_workers(shape, lambda r, i: f"rank {r}", lambda r, i: False, lambda r, i: f"index {i}")
    rows = grid_workers(shape, lambda r, i: f"rank {r}", lambda r, i: np.full((1, 1, 3), color(i[0])),
                        lambda r, i: f"row fibre {i[0]}")
    cols = grid_workers(shape, lambda r, i: f"rank {r}", lambda r, i: np.full((1, 1, 3), color(3 + i[1])),
                        lambda r, i: f"column fibre {i[1]}")
    figure(out / "partitions.png", [("create_cartesian_topology_partition((2, 3))", grid),
                                    ("create_subpartition([1])", rows),
                                    ("create_subpartition([0])", cols)], box=(0.95, 0.55))


def decomposition(out: Path) -> None:
    P_shape, shape = (2, 3), (7, 10)
    whole = owners(P_shape, shape)
    blocks = grid_workers(P_shape, lambda r, i: f"rank {r}, index {i}",
                          lambda r, i: whole[bounds(P_shape, i, shape)],
                          lambda r, i: "start {} shape {}".format(
                              tuple(int(v) for v in compute_start_index(P_shape, i, shape)),
                              whole[bounds(P_shape, i, shape)].shape[:2]))
    figure(out / "decomposition.png", [("global 7 x 10 tensor over a 2 x 3 partition", [((0, 0), "", whole, None)]),
                                       ("the block each worker holds", blocks)])


def all_sum_reduce(out: Path) -> None:
    P_shape, block = (2, 2), (2, 3)
    before = grid_workers(P_shape, lambda r, i: f"rank {r}", lambda r, i: np.broadcast_to(color(r), block + (3,)),
                          lambda r, i: f"x{r}")
    mix = lambda i: (color(2 * i[0]) + color(2 * i[0] + 1)) / 2  # noqa: E731
    after = grid_workers(P_shape, lambda r, i: f"rank {r}", lambda r, i: np.broadcast_to(mix(i), block + (3,)),
                         lambda r, i: f"x{2 * i[0]} + x{2 * i[0] + 1}")
    figure(out / "all_sum_reduce.png", [("before: x on a 2 x 2 partition", before),
                                        ("all_sum_reduce(x, P_x, axes_reduce=[1])", after)])


def broadcast(out: Path) -> None:
    src, dest, block = (1, 2), (2, 2), (2, 3)
    before = grid_workers(src, lambda r, i: f"P_x rank {r}", lambda r, i: np.broadcast_to(color(r), block + (3,)),
                          lambda r, i: f"x{r}")
    source = lambda i: int(np.ravel_multi_index(fed_by(src, i), src))  # noqa: E731
    after = grid_workers(dest, lambda r, i: f"P_y rank {r}",
                         lambda r, i: np.broadcast_to(color(source(i)), block + (3,)),
                         lambda r, i: f"copy of x{source(i)}")
    summed = grid_workers(src, lambda r, i: f"P_x rank {r}",
                          lambda r, i: np.broadcast_to((color(r) + 0.6) / 1.6, block + (3,)),
                          lambda r, i: f"dy{r} + dy{r + 2}")
    figure(out / "broadcast.png", [("x on P_x (1 x 2)", before), ("broadcast(x, P_x, P_y): y on P_y (2 x 2)", after),
                                   ("adjoint (sum_reduce): dx on P_x", summed)])


def sum_reduce(out: Path) -> None:
    src, dest, block = (2, 2), (1, 2), (2, 3)
    before = grid_workers(src, lambda r, i: f"P_x rank {r}", lambda r, i: np.broadcast_to(color(r), block + (3,)),
                          lambda r, i: f"x{r}")
    after = grid_workers(dest, lambda r, i: f"P_y rank {r}",
                         lambda r, i: np.broadcast_to((color(r) + color(r + 2)) / 2, block + (3,)),
                         lambda r, i: f"x{r} + x{r + 2}")
    figure(out / "sum_reduce.png", [("x on P_x (2 x 2)", before), ("sum_reduce(x, P_x, P_y): y on P_y (1 x 2)", after)])


def all_gather(out: Path) -> None:
    P_shape, shape = (2, 2), (5, 7)
    whole = owners(P_shape, shape)
    before = grid_workers(P_shape, lambda r, i: f"rank {r}", lambda r, i: whole[bounds(P_shape, i, shape)])
    after = grid_workers(P_shape, lambda r, i: f"rank {r}", lambda r, i: whole[bounds((2,), i[:1], shape[:1])])
    gathered = grid_workers(P_shape, lambda r, i: f"rank {r}",
                            lambda r, i: np.broadcast_to(color(r), whole[bounds((2,), i[:1], shape[:1])].shape))
    scattered = grid_workers(P_shape, lambda r, i: f"rank {r}", lambda r, i: (
        color(2 * i[0]) + color(2 * i[0] + 1) + 0 * whole[bounds(P_shape, i, shape)]) / 2)
    figure(out / "all_gather.png", [("blocks of a 5 x 7 tensor on 2 x 2", before),
                                    ("all_gather(x, P_x, axes_all_gather=[1])", after)])
    figure(out / "reduce_scatter.png", [("one whole tensor per worker", gathered),
                                        ("reduce_scatter(x, P_x, axes_reduce_scatter=[1])", scattered)])


def repartition(out: Path) -> None:
    shape = (7, 10)
    whole = owners((2, 2), shape)
    before = grid_workers((2, 2), lambda r, i: f"rank {r}", lambda r, i: whole[bounds((2, 2), i, shape)])
    after = grid_workers((4, 1), lambda r, i: f"rank {r}", lambda r, i: whole[bounds((4, 1), i, shape)])
    figure(out / "repartition.png", [("x over P_x (2 x 2)", before), ("repartition(x, P_x, P_y): P_y (4 x 1)", after)])


def halo_exchange(out: Path) -> None:
    n, P_shape = 10, (3,)
    signal = owners(P_shape, (n,))
    ghost = np.full(3, 0.92)
    before, after = [], []
    for rank in range(3):
        s = bounds(P_shape, (rank,), (n,))[0]
        left, right = s.start - 1, s.stop
        inner = signal[s]
        mine = np.concatenate([[ghost], inner, [ghost]])
        outer = (signal[left] if left >= 0 else ghost, signal[right] if right < n else ghost)
        filled = np.concatenate([[outer[0]], inner, [outer[1]]])
        before.append(((0, rank), f"rank {rank}: [{s.start}, {s.stop}) + ghosts", mine[None], None))
        after.append(((0, rank), f"rank {rank}", filled[None], None))
    figure(out / "halo_exchange.png", [("blocks with one ghost cell per side (grey)", before),
                                       ("halo_exchange: ghosts hold the neighbours' edges", after)])


def window_exchange(out: Path) -> None:
    n, P_shape, reach = 10, (3,), 4
    signal = owners(P_shape, (n,))
    padded = np.concatenate([np.ones((reach, 3)), signal, np.ones((reach, 3))])
    before, after = [], []
    for rank in range(3):
        s = bounds(P_shape, (rank,), (n,))[0]
        before.append(((rank, 0), f"rank {rank}: block [{s.start}, {s.stop})", signal[s][None], None))
        after.append(((rank, 0), f"window [{s.start - reach}, {s.stop + reach}) (white: past the edge)",
                      padded[s.start:s.stop + 2 * reach][None], None))
    figure(out / "window_exchange.png", [("blocks of a length-10 signal", before),
                                         ("window_exchange: windows 4 wider each side", after)])


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for draw in (partitions, decomposition, all_sum_reduce, broadcast, sum_reduce, all_gather, repartition,
                 halo_exchange, window_exchange):
        draw(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "_static" / "figures")

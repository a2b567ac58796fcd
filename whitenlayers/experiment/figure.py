"""The runner's figure (``figure.png``): the paper's accuracy, ``kappa`` and ``rho`` per epoch, and accuracy and loss
against training time, drawn from the rows of ``metrics.csv``. ``matplotlib`` is imported only to draw it (it is in
the ``experiment`` extra); :mod:`~whitenlayers.experiment.report` writes the rest of a run's outputs."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from .config import METHOD_COLORS, METHOD_LABELS, METHODS

__all__ = ["metrics_figure", "plot_metrics", "rows_by_method"]


def rows_by_method(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[int, List[Dict[str, Any]]]]:
    """The rows of ``metrics.csv`` by method, then seed, each seed's rows in epoch order."""
    out: Dict[str, Dict[int, List[Dict[str, Any]]]] = {}
    for r in rows:
        out.setdefault(r["method"], {}).setdefault(r["seed"], []).append(r)
    for seeds in out.values():
        for lst in seeds.values():
            lst.sort(key=lambda r: r["epoch"])
    return out


def plot_metrics(rows: Sequence[Dict[str, Any]], path: str, title: str,
                 methods: Optional[Sequence[str]] = None) -> None:
    """Draw :func:`metrics_figure` to the PNG ``path`` (1650 x 1034 pixels)."""
    fig = metrics_figure(rows, title, methods)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # metrics_figure imported it (or raised)

    plt.close(fig)


def _load_range(rows: Sequence[Dict[str, Any]]) -> str:
    """The time panels' note: the 1-minute load average's range during the run, which stretches their seconds."""
    loads = [r["load1"] for r in rows if math.isfinite(r.get("load1", float("nan")))]
    if not loads:
        return "machine load not recorded"
    return f"1-min load {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count() or 1} cores: load stretches these seconds"


def metrics_figure(rows: Sequence[Dict[str, Any]], title: str, methods: Optional[Sequence[str]] = None) -> Any:
    """The paper's figure: test accuracy, kappa and rho against epoch, one line per method with a spread band.

    The band is +-1 standard deviation across seeds; with a single seed, kappa
    and rho get +-1 standard error across layers and accuracy gets no band.
    When the first epochs' accuracy is far below the rest, an inset zooms on
    the second half of the run (a box marks the zoomed region; no connector
    lines, which would cross the curves). A footnote under the panels says what
    the bands are. The second row plots accuracy and loss against the cumulative
    training seconds, with the baseline's final accuracy as a dashed line and
    the run's load range under the axis (load stretches those seconds), and the
    training loss against epoch; every panel's axes hold its bands whole.

    Args:
        rows: the runs' metric rows (:func:`read_metrics`, or the runner's rows).
        title: the line above the legend (the runner's: dataset, model, epochs, seeds).
        methods: the order of the lines (default: the runner's method order, then any others in ``rows``).

    Returns the ``matplotlib`` figure (2 x 3 panels, 15 x 9.4 inches).
    """
    try:  # optional: in the 'experiment' extra
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "the figure needs matplotlib: pip install 'whitenlayers[experiment]' (or matplotlib)") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    groups = rows_by_method(rows)
    methods = [m for m in (methods or METHODS) if m in groups] + [m for m in groups if m not in (methods or METHODS)]
    panels = [("test_acc", None, "test accuracy (%)", "Test accuracy"),
              ("kappa_mean", "kappa_sem", r"normalised rank $\kappa = M_s / M$",
               r"Normalised rank $\kappa$ (higher: fuller rank)"),
              ("rho_mean", "rho_sem", r"whiteness $\rho$", r"Whiteness $\rho$ (1: uncorrelated)")]
    curves: Dict[str, Dict[str, Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]] = {}
    for key, sem_key, _, _ in panels:
        for m in methods:
            seeds = list(groups[m].values())
            length = min(len(lst) for lst in seeds)
            ep = np.array([r["epoch"] for r in seeds[0][:length]])
            vals = np.array([[r[key] for r in lst[:length]] for lst in seeds], dtype=float)
            if vals.shape[0] > 1:
                spread: Optional[np.ndarray] = vals.std(0, ddof=1)
            elif sem_key is not None:
                spread = np.array([r[sem_key] for r in seeds[0][:length]], dtype=float)
            else:
                spread = None
            curves.setdefault(key, {})[m] = (ep, vals.mean(0), spread)

    def draw(ax, key: str, markers: bool = True, bands: bool = True) -> None:
        for i, m in enumerate(methods):
            ep, mean, spread = curves[key][m]
            color = METHOD_COLORS.get(m)
            if bands:
                ax.plot(ep, mean, color=color, label=METHOD_LABELS.get(m, m), lw=2,
                        marker="o" if markers and len(ep) <= 30 else None, ms=4)
                if spread is not None and np.isfinite(spread).any():
                    ax.fill_between(ep, mean - spread, mean + spread, color=color, alpha=0.18, lw=0)
            else:  # the zoom: overlapping bands read as one block there; each method's spread as an error bar,
                # the methods side by side within an epoch
                shift = 0.08 * (i - (len(methods) - 1) / 2)
                ax.errorbar(ep + shift, mean, yerr=spread if spread is not None and np.isfinite(spread).any()
                            else None, color=color, lw=1.5, marker="o", ms=3, capsize=2, elinewidth=1)

    fig, grid = plt.subplots(2, 3, figsize=(15, 9.4))
    axes = grid[0]
    for ax, (key, _, ylabel, ptitle) in zip(axes, panels):
        draw(ax, key)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle, fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[1:]:
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(0.0, lo), min(1.02, hi))
    # Accuracy: the whole range, and an inset on the second half when the start dwarfs the differences there.
    acc = curves["test_acc"]
    n_ep = max(len(v[0]) for v in acc.values())
    late = np.concatenate([v[1][len(v[1]) // 2:] for v in acc.values()])
    allv = np.concatenate([v[1] for v in acc.values()])
    late, allv = late[np.isfinite(late)], allv[np.isfinite(allv)]
    if n_ep >= 4 and late.size and allv.size and (allv.max() - allv.min()) > 4 * max(late.max() - late.min(), 0.2):
        ax = axes[0]
        ins = ax.inset_axes([0.46, 0.07, 0.51, 0.42])
        draw(ins, "test_acc", bands=False)
        first = min(v[0][len(v[0]) // 2] for v in acc.values())
        # the zoom holds the error bars whole: a difference smaller than the seeds' spread reads as one
        lows, highs = [late.min()], [late.max()]
        for _, mean, spread in acc.values():
            if spread is not None:
                half = slice(len(mean) // 2, None)
                lows.append(float(np.nanmin(mean[half] - spread[half])))
                highs.append(float(np.nanmax(mean[half] + spread[half])))
        lo, hi = min(lows), max(highs)
        pad = max(0.1, 0.08 * (hi - lo))
        ins.set_xlim(first - 0.3, n_ep + 0.3)
        ins.set_ylim(lo - pad, hi + pad)
        ins.xaxis.get_major_locator().set_params(integer=True)
        ins.tick_params(labelsize=8)
        ins.grid(True, alpha=0.3)
        ins.set_title(f"zoom: epochs {first}-{n_ep}", fontsize=8, pad=3)  # what the bands mean: the footnote
        x0, x1 = ax.get_xlim()  # the marked region inside the panel (the zoom's margins can pass its edges)
        y0, y1 = ax.get_ylim()
        xs, ys = ins.get_xlim(), ins.get_ylim()
        box = ax.indicate_inset((max(xs[0], x0), max(ys[0], y0), min(xs[1], x1) - max(xs[0], x0),
                                 min(ys[1], y1) - max(ys[0], y0)), ins, edgecolor="0.5")
        # from the box to the zoom the connectors would cross the curves between them (matplotlib < 3.10: a tuple)
        for line in box.connectors if hasattr(box, "connectors") else box[1]:
            line.set_visible(False)
    # Second row: against training wall-clock time (the interleaved epochs' cumulative training seconds, mean over
    # seeds), where a user's decision is made; the baseline's final accuracy as a dashed line.
    base_final = None
    if "baseline" in groups:
        base_final = float(np.mean([lst[-1]["test_acc"] for lst in groups["baseline"].values()]))
    for ax, key, ylabel, ptitle in ((grid[1][0], "test_acc", "test accuracy (%)", "Test accuracy vs training time"),
                                    (grid[1][1], "train_loss", "training loss", "Training loss vs training time")):
        if key != "test_acc":
            ax.set_yscale("log")  # before the bands, which keep above 0 on it
        bottoms: List[float] = []  # each line's lowest point, its band's included
        for m in methods:
            seeds = list(groups[m].values())
            length = min(len(lst) for lst in seeds)
            t = np.array([[r.get("train_time", float("nan")) for r in lst[:length]] for lst in seeds], float).mean(0)
            v = np.array([[r[key] for r in lst[:length]] for lst in seeds], dtype=float)
            ax.plot(t, v.mean(0), color=METHOD_COLORS.get(m), lw=2, marker="o" if length <= 30 else None, ms=4,
                    label=METHOD_LABELS.get(m, m))
            bottoms.append(_band(ax, t, v, METHOD_COLORS.get(m)))
        if key == "test_acc":
            if base_final is not None:
                ax.axhline(base_final, color="0.3", ls="--", lw=1, label="baseline final")
                # above the line at the left, where the curves are still low; the top limit leaves it room
                ax.annotate("baseline final accuracy", (0.01, base_final), xycoords=ax.get_yaxis_transform(),
                            xytext=(2, 2), textcoords="offset points", ha="left", va="bottom", fontsize=8,
                            color="0.3")
            # below every plotted point and band, the first epoch's included (a run of one epoch: one point per line)
            ys = [v for v in bottoms if math.isfinite(v)]
            lo = min(ys) if ys else float(np.nanmin([r["test_acc"] for r in rows]))
            top = max(max(r["test_acc"] for r in rows), base_final if base_final is not None else -math.inf)
            lo = max(0.0, lo - 2)
            ax.set_ylim(lo, min(100.0, top) + max(1.0, 0.08 * (top - lo)))  # room for the line's label
        ax.set_xlabel(f"training time (s, cumulative; interleaved epochs)\n{_load_range(rows)}")
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle, fontsize=11)
        ax.grid(True, alpha=0.3)
    ax = grid[1][2]
    ax.set_yscale("log")
    for m in methods:
        seeds = list(groups[m].values())
        length = min(len(lst) for lst in seeds)
        ep = np.array([r["epoch"] for r in seeds[0][:length]])
        v = np.array([[r["train_loss"] for r in lst[:length]] for lst in seeds], dtype=float)
        ax.plot(ep, v.mean(0), color=METHOD_COLORS.get(m), lw=2, marker="o" if length <= 30 else None, ms=4)
        _band(ax, ep, v, METHOD_COLORS.get(m))
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss vs epoch", fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    handles, labels = axes[0].get_legend_handles_labels()
    nseeds = max(len(groups[m]) for m in methods)
    band = ("Shaded: ±1 standard deviation over seeds; where two bands overlap, the difference is within the "
            "seeds' spread (in the zoom: error bars, the methods side by side)." if nseeds > 1 else
            r"Shaded: ±1 standard error of $\kappa$ and $\rho$ over the layers (one seed: no spread over seeds).")
    fig.text(0.01, 0.008, band, fontsize=9, color="0.3", ha="left", va="bottom")
    # The panels first, below room for the title and the legend (a guess in inches: title, legend rows, gaps);
    # then the legend just above the panels' titles and the title just above the legend, measured, so no gap
    # opens under the legend. The second pass gives the panels what the guess left empty above the title.
    head = (0.45 + 0.3 * -(-len(labels) // 6)) / fig.get_figheight()
    renderer = cast(FigureCanvasAgg, fig.canvas).get_renderer()
    to_fig = fig.transFigure.inverted()
    legend = fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False, fontsize=11,
                        bbox_to_anchor=(0.5, 1.0), borderaxespad=0.0)
    heading = fig.text(0.5, 1.0, title, fontsize=13, ha="center", va="bottom")  # not a suptitle: see below
    for _ in range(2):
        fig.tight_layout(rect=(0, 0.03, 1, 1 - head))  # (tight_layout would reserve a suptitle's room again)
        panels_top = max(a.get_tightbbox(renderer).transformed(to_fig).y1 for a in axes)
        legend.set_bbox_to_anchor((0.5, panels_top + 0.004))
        heading.set_y(legend.get_window_extent(renderer).transformed(to_fig).y1 + 0.008)
        head = max(0.0, head - (0.99 - heading.get_window_extent(renderer).transformed(to_fig).y1))
    return fig


def _band(ax: Any, x: np.ndarray, values: np.ndarray, color: Optional[str]) -> float:
    """Shade ±1 standard deviation over the seeds (rows of ``values``) around their mean, with more than one seed;
    on a log axis the band's lower edge stays above 0 (the lowest seed where mean - std is not). Returns the
    lowest point of the mean and band (nan without a finite value)."""
    mean = values.mean(0)
    low = mean
    if values.shape[0] > 1:
        std = values.std(0, ddof=1)
        low = mean - std
        if ax.get_yscale() == "log":
            low = np.where(low > 0, low, np.nanmin(values, axis=0))
        ax.fill_between(x, low, mean + std, color=color, alpha=0.15, lw=0)
    return float(np.nanmin(low)) if np.isfinite(low).any() else float("nan")

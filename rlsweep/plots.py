"""The report's figures (Matplotlib, Agg backend), written as PNG files atomically."""

from __future__ import annotations

import io
from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")  # no display: the report runs in CI and over ssh

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rlsweep.layouts import CANONICAL_CELL

DPI = 100
EQUAL_COLOR = "#cdebd3"  # bitwise equal to the canonical cell: a pale green, no value to read
MISMATCH_CMAP = "OrRd"
DARK_FRACTION = 0.55  # above this point of the colour scale the cell is dark enough for white text
HEATMAP_FLOOR = 1e-8  # log scale needs a positive lower end when every differing value is tiny
HISTOGRAM_COLOR, ATOL_COLOR = "#4c72b0", "#c44e52"


def column_labels(columns: pd.DataFrame) -> list[str]:
    """Heatmap column labels: profile and tp always, model and tp_mode only when they vary."""
    varying = [name for name in ("model", "tp_mode") if columns[name].nunique() > 1]
    return [
        "\n".join([str(row.profile), f"tp={row.tp}", *(str(getattr(row, name)) for name in varying)])
        for row in columns.itertuples()
    ]


def heatmap(grid: pd.DataFrame) -> Figure:
    """Max |dlogp| vs the canonical cell of the smallest tp: rows cells, columns profile x tp (x model, tp_mode).

    ``grid`` is ``analysis.dlogp_vs_canonical``; duplicate runs of one column (a whole outputs/ tree) take the max.
    """
    keys = ["profile", "model", "tp", "tp_mode"]
    table = grid.groupby([*keys, "cell"], observed=True).agg(
        value=("max_abs_dlogp", "max"), mismatched=("mismatched_tokens", "max")
    )
    columns = table.reset_index()[keys].drop_duplicates().reset_index(drop=True)
    cells = [cell for cell in grid["cell"].cat.categories if cell in set(grid["cell"])]
    values = np.full((len(cells), len(columns)), np.nan)
    mismatched = np.zeros_like(values)
    for (j, column), (i, cell) in ((jc, ic) for jc in columns.iterrows() for ic in enumerate(cells)):
        key = (*column[keys], cell)
        if key in table.index:
            values[i, j], mismatched[i, j] = table.loc[key, "value"], table.loc[key, "mismatched"]
    differing = values[(mismatched > 0) & (values > 0)]
    vmax = max(float(differing.max()) if differing.size else 1.0, HEATMAP_FLOOR * 10)
    vmin = max(min(float(differing.min()) / 3 if differing.size else vmax / 10, vmax / 10), HEATMAP_FLOOR)
    width = max(6.0, 1.0 * len(columns) + 3.5)
    fig, ax = plt.subplots(figsize=(width, 0.42 * len(cells) + 2.2), dpi=DPI, layout="constrained")
    ax.imshow(
        np.where(mismatched == 0, 1.0, np.nan), cmap=matplotlib.colors.ListedColormap([EQUAL_COLOR]), aspect="auto"
    )
    shown = np.ma.masked_where(mismatched == 0, np.where(values > 0, values, vmin))
    image = ax.imshow(shown, cmap=MISMATCH_CMAP, norm=LogNorm(vmin=vmin, vmax=vmax), aspect="auto")
    norm = image.norm
    for i in range(len(cells)):
        for j in range(len(columns)):
            dark = False
            if np.isnan(values[i, j]):
                text = "—"
            elif mismatched[i, j] == 0:
                text = "0"
            else:
                text = f"{values[i, j]:.1e}\n{int(mismatched[i, j])} tok"
                dark = norm(max(values[i, j], vmin)) > DARK_FRACTION
            ax.text(j, i, text, ha="center", va="center", fontsize=7.5, color="white" if dark else "black")
    ax.set_xticks(range(len(columns)), column_labels(columns), fontsize=8, rotation=30, ha="left")
    ax.set_yticks(range(len(cells)), cells, fontsize=8)
    ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
    plt.setp(ax.get_xticklabels(), rotation_mode="anchor")
    ax.xaxis.set_label_position("top")
    ax.set_xlabel(
        "run: profile, tp" + "".join(f", {name}" for name in ("model", "tp_mode") if columns[name].nunique() > 1)
    )
    ax.set_ylabel("layout cell")
    legend = [
        Patch(facecolor=EQUAL_COLOR, edgecolor="#999999", label="0: bitwise equal on every active token"),
        Patch(facecolor="white", edgecolor="#999999", label="—: cell not in that run"),
    ]
    fig.legend(handles=legend, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.set_title(
        f"max |dlogp| of logp vs the canonical cell ({CANONICAL_CELL}) at the smallest tp\n"
        "'tok' = active tokens whose bits differ from the canonical cell's",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, label="max |dlogp| (log scale)", shrink=0.8)
    return fig


def histograms(accuracy: pd.DataFrame, atol: Mapping[str, float]) -> Figure:
    """dlogp = logp - ref_logp per profile (``analysis.dlogp_vs_reference``), one panel each, shared bins.

    ``atol``: the contract's forward_accuracy logp atol per profile, drawn as dashed lines.
    """
    profiles = [p for p in accuracy["profile"].cat.categories if p in set(accuracy["profile"])]
    finite = accuracy["dlogp"][np.isfinite(accuracy["dlogp"])]
    reach = max(float(finite.abs().max()) if len(finite) else 0.0, *atol.values(), 1e-12) * 1.05
    bins = np.linspace(-reach, reach, 61)
    fig, axes = plt.subplots(
        len(profiles),
        1,
        figsize=(8, 1.9 * len(profiles) + 0.9),
        dpi=DPI,
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, profile in zip(axes[:, 0], profiles, strict=True):
        values = accuracy.loc[accuracy["profile"] == profile, "dlogp"]
        tp = ", ".join(f"tp={tp}" for tp in sorted(accuracy.loc[accuracy["profile"] == profile, "tp"].unique()))
        ax.hist(values[np.isfinite(values)], bins=bins, color=HISTOGRAM_COLOR, label="active tokens")
        if profile in atol:
            for x, label in ((-atol[profile], f"contract atol ±{atol[profile]:.3g}"), (atol[profile], None)):
                ax.axvline(x, color=ATOL_COLOR, linestyle="--", linewidth=1, label=label)
        ax.legend(fontsize=7, loc="upper right")
        ax.set_title(
            f"{profile} ({tp}, {CANONICAL_CELL}): {len(values)} active tokens, max |dlogp| {values.abs().max():.2e}, "
            f"mean {values.mean():+.2e}",
            fontsize=9,
        )
        ax.set_ylabel("tokens", fontsize=8)
    axes[-1, 0].set_xlabel("dlogp = logp (candidate) - ref_logp (float64 reference)")
    return fig


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()

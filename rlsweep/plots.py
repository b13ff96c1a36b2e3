"""The report's figures (Matplotlib, Agg backend), written as PNG files atomically."""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # no display: the report runs in CI and over ssh

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, LogNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rlsweep.analysis import RUN_DIR
from rlsweep.layouts import CANONICAL_CELL
from rlsweep.verdicts import Outcome

DPI = 100
# A heatmap cell's hue is its verdict (``analysis.cell_outcomes``), its shade within the hue its max |dlogp|: the
# lightest shade is bitwise equal, darker is further apart. (lightest, darkest) per outcome:
OUTCOME_SHADES = {
    Outcome.PASSED: ("#e5f5e0", "#1b7837"),
    Outcome.FAILED_AS_DECLARED: ("#fdf1cf", "#a86f00"),  # amber: red, as the sweep declared it would be
    Outcome.NOT_AS_EXPECTED: ("#fde0dd", "#b00020"),
}
SHADE_SCALE = ("#f2f2f2", "#3a3a3a")  # the colour bar: the shades of every hue, in grey
NO_VERDICT_COLOR = "#e3e3e3"  # the baseline's own canonical cell: compared with itself, judged by no verdict
ABSENT_COLOR = "#ffffff"  # a cell the run did not compute
SHADE_FLOOR = 0.25  # the lightest shade of a cell whose bits differ: never the bitwise-equal one
DARK_FRACTION = 0.55  # above this shade the cell is dark enough for white text
HEATMAP_FLOOR = 1e-8  # log scale needs a positive lower end when every differing value is tiny
HISTOGRAM_COLOR, ATOL_COLOR = "#4c72b0", "#c44e52"


def column_labels(columns: pd.DataFrame) -> list[str]:
    """Heatmap column labels: profile and tp always, model and tp_mode only when they vary."""
    varying = [name for name in ("model", "tp_mode") if columns[name].nunique() > 1]
    return [
        "\n".join([str(row.profile), f"tp={row.tp}", *(str(getattr(row, name)) for name in varying)])
        for row in columns.itertuples()
    ]


def blend(scale: tuple[str, str], shade: float) -> np.ndarray:
    """The RGBA ``shade`` in [0, 1] of the way from a scale's lightest colour (0) to its darkest (1)."""
    light, dark = (np.array(to_rgba(color)) for color in scale)
    return light + shade * (dark - light)


@dataclass
class HeatmapCells:
    """What the heatmap draws, layout cells (rows) x runs (columns): max |dlogp| (NaN: the run lacks the cell), the
    tokens whose bits differ, the verdict (None: no verdict compares the cell) and the log scale of the shades."""

    cells: list[str]
    columns: pd.DataFrame  # profile, model, tp, tp_mode
    values: np.ndarray
    mismatched: np.ndarray
    verdicts: np.ndarray  # of Outcome or None
    norm: LogNorm

    @property
    def shades(self) -> np.ndarray:
        """0 where every active token is bitwise equal, else SHADE_FLOOR..1 by max |dlogp| on the log scale."""
        scaled = self.norm(np.where(self.values > 0, self.values, self.norm.vmin))
        return np.where(self.mismatched > 0, SHADE_FLOOR + (1 - SHADE_FLOOR) * scaled, 0.0)

    @property
    def colors(self) -> np.ndarray:
        """RGBA [cells, columns]: the verdict's hue at the cell's shade."""
        colors = np.empty((*self.values.shape, 4))
        for (i, j), shade in np.ndenumerate(self.shades):
            verdict = self.verdicts[i, j]
            if np.isnan(self.values[i, j]):
                colors[i, j] = to_rgba(ABSENT_COLOR)
            else:
                colors[i, j] = to_rgba(NO_VERDICT_COLOR) if verdict is None else blend(OUTCOME_SHADES[verdict], shade)
        return colors


def heatmap_cells(grid: pd.DataFrame, outcomes: pd.DataFrame) -> HeatmapCells:
    """``analysis.dlogp_vs_canonical`` and ``analysis.cell_outcomes`` as cells x runs; duplicate runs of one column
    (a whole outputs/ tree) take the largest values and the worst verdict."""
    keys = ["profile", "model", "tp", "tp_mode"]
    worst = list(Outcome)  # worst first; len(worst): no verdict
    judged = grid.astype({RUN_DIR: str, "cell": str}).merge(outcomes, on=[RUN_DIR, "cell"], how="left")
    judged["rank"] = [len(worst) if pd.isna(verdict) else worst.index(verdict) for verdict in judged["outcome"]]
    table = judged.groupby([*keys, "cell"], observed=True).agg(
        value=("max_abs_dlogp", "max"), mismatched=("mismatched_tokens", "max"), rank=("rank", "min")
    )
    columns = table.reset_index()[keys].drop_duplicates().reset_index(drop=True)
    cells = [cell for cell in grid["cell"].cat.categories if cell in set(grid["cell"])]
    values = np.full((len(cells), len(columns)), np.nan)
    mismatched, verdicts = np.zeros_like(values), np.full(values.shape, None, dtype=object)
    for (j, column), (i, cell) in ((jc, ic) for jc in columns.iterrows() for ic in enumerate(cells)):
        key = (*column[keys], cell)
        if key in table.index:
            values[i, j], mismatched[i, j], rank = table.loc[key, ["value", "mismatched", "rank"]]
            verdicts[i, j] = worst[int(rank)] if rank < len(worst) else None
    differing = values[(mismatched > 0) & (values > 0)]
    vmax = max(float(differing.max()) if differing.size else 1.0, HEATMAP_FLOOR * 10)
    vmin = max(min(float(differing.min()) / 3 if differing.size else vmax / 10, vmax / 10), HEATMAP_FLOOR)
    return HeatmapCells(cells, columns, values, mismatched, verdicts, LogNorm(vmin=vmin, vmax=vmax, clip=True))


def heatmap(grid: pd.DataFrame, outcomes: pd.DataFrame) -> Figure:
    """Max |dlogp| vs the canonical cell of the smallest tp: rows cells, columns profile x tp (x model, tp_mode).

    Each cell's hue is its verdict (``outcomes``), its shade within the hue the magnitude (``heatmap_cells``).
    """
    drawn = heatmap_cells(grid, outcomes)
    cells, columns, values, shades = drawn.cells, drawn.columns, drawn.values, drawn.shades
    width = max(6.0, 1.0 * len(columns) + 3.5)
    fig, ax = plt.subplots(figsize=(width, 0.42 * len(cells) + 2.4), dpi=DPI, layout="constrained")
    ax.imshow(drawn.colors, aspect="auto", interpolation="nearest")
    for i, j in np.ndindex(values.shape):
        if np.isnan(values[i, j]):
            text = "—"
        elif drawn.mismatched[i, j] == 0:
            text = "0"
        else:
            text = f"{values[i, j]:.1e}\n{int(drawn.mismatched[i, j])} tok"
        dark = drawn.verdicts[i, j] is not None and shades[i, j] > DARK_FRACTION
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
        Patch(facecolor=blend(OUTCOME_SHADES[verdict], 0.5), edgecolor="#999999", label=f"verdict {verdict}")
        for verdict in Outcome
    ]
    legend += [
        Patch(facecolor=NO_VERDICT_COLOR, edgecolor="#999999", label="no verdict: the baseline's canonical cell"),
        Patch(facecolor=ABSENT_COLOR, edgecolor="#999999", label="—: cell not in that run"),
    ]
    fig.legend(handles=legend, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    ax.set_title(
        f"max |dlogp| of logp vs the canonical cell ({CANONICAL_CELL}) at the smallest tp\n"
        "colour: the cell's forward_invariance and tp_invariance verdicts (the worst); shade: max |dlogp|\n"
        "0 = bitwise equal on every active token; 'tok' = active tokens whose bits differ from the canonical cell's",
        fontsize=9,
    )
    ramp = LinearSegmentedColormap.from_list("shade", [blend(SHADE_SCALE, shade) for shade in (SHADE_FLOOR, 1)])
    label = "max |dlogp| (log scale): the shade"
    fig.colorbar(ScalarMappable(norm=drawn.norm, cmap=ramp), ax=ax, label=label, shrink=0.8)
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


# What tells one moved cell's divergence rows from another's in a sweep: its run's profile, tp and chunk size.
DIVERGENCE_RUN = ("profile", "tp", "chunk_size", "cell")


def divergence(table: pd.DataFrame) -> Figure:
    """A whole model's divergence table (``rlsweep.divergence``, with each run's ``chunk_size``): per profile (its
    smallest tp: the body runs whole at every tp), the tokens each module's output moved in each cell that broke
    invariance, one line per cell and chunk size, modules in the canonical cell's execution order; a star marks each
    line's first diverging module."""
    smallest = table.groupby("profile", observed=True)["tp"].transform("min")
    table = table[table["tp"] == smallest]
    profiles = sorted(table["profile"].unique())
    fig, axes = plt.subplots(
        len(profiles), 1, figsize=(10, 2.6 * len(profiles) + 1.4), dpi=DPI, squeeze=False, layout="constrained"
    )
    for ax, profile in zip(axes[:, 0], profiles, strict=True):
        rows = table[table["profile"] == profile]
        order = rows.drop_duplicates("module").sort_values("order")
        position = {module: i for i, module in enumerate(order["module"])}
        several = rows["chunk_size"].nunique() > 1
        for (chunk, cell), moved in rows.groupby(["chunk_size", "cell"], observed=True, sort=True):
            moved = moved.sort_values("order")
            x = moved["module"].map(position)
            label = f"{cell} (chunk {chunk})" if several else str(cell)
            (line,) = ax.plot(x, moved["tokens_differing"], marker=".", linewidth=1, label=label)
            first = moved[moved["first_diverging"]]
            ax.plot(first["module"].map(position), first["tokens_differing"], marker="*", markersize=12,
                    linestyle="none", color=line.get_color())  # fmt: skip
        step = max(1, len(order) // 40)
        ticks = list(range(0, len(order), step))
        ax.set_xticks(ticks, [order["module"].iloc[i].removeprefix("model.") for i in ticks], fontsize=6, rotation=90)
        ax.set_ylabel("tokens differing", fontsize=8)
        ax.set_title(f"{profile} (tp={int(rows['tp'].iloc[0])}): each module's output against the canonical cell's; "
                     "* first diverging", fontsize=9)  # fmt: skip
        ax.legend(fontsize=7, loc="upper left", ncols=3)
    axes[-1, 0].set_xlabel("module, in execution order")
    return fig


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()

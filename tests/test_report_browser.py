"""report.html of a real sweep in headless Chromium (Playwright): what a reader sees, not what the HTML says.

Needs the Python package ``playwright`` (test extras) and Debian's ``chromium`` (/usr/bin/chromium); .ci/run
installs both. Without them the tests skip and say which is missing, except where RLSWEEP_BROWSER_REQUIRED=1
(.ci/run sets it once Chromium is installed): there a missing piece fails them.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from rlsweep_fixtures import heatmap_verdict, seen_verdict

from rlsweep import analysis, plots
from rlsweep.report import PLOTS, RED_GROUPS, REPORT_HTML, red_verdicts
from rlsweep.verdicts import Outcome

# One worker builds the shared small_sweep (conftest) once and runs every test that reads it.
pytestmark = pytest.mark.xdist_group("small_sweep")

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own browser download is not used
BROWSER_REQUIRED = "RLSWEEP_BROWSER_REQUIRED"
# Headless (Playwright also drops the sandbox, which root cannot use) on machines without a GPU or outside network.
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--disable-background-networking", "--disable-component-update"]


def missing_browser() -> str:
    """Why the browser test cannot run here; '' when it can."""
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the Python package playwright is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} is missing (Debian package chromium: apt-get install chromium)")
    return "; ".join(missing)


@pytest.fixture(scope="module")
def console_errors() -> list[str]:
    """What the page logged as an error or threw, while every test of this module used it."""
    return []


@pytest.fixture(scope="module")
def browser_ready() -> None:
    """Skip (fail where RLSWEEP_BROWSER_REQUIRED=1) before any sweep runs when Playwright or Chromium is missing."""
    reason = missing_browser()
    if reason and os.environ.get(BROWSER_REQUIRED) == "1":
        pytest.fail(f"{BROWSER_REQUIRED}=1 but {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def page(browser_ready, report_dir, console_errors):
    """The shared sweep's report.html (conftest's ``report_dir``) opened in headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        opened = browser.new_page(viewport={"width": 1280, "height": 900})
        opened.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
        opened.on("pageerror", lambda error: console_errors.append(str(error)))
        opened.goto((report_dir / REPORT_HTML).as_uri(), wait_until="load")
        yield opened
        browser.close()


def test_the_report_opens_with_its_title_and_no_console_error(page, small_sweep, console_errors):
    assert page.title() == f"rlsweep report: {small_sweep}"
    assert page.locator("h1").inner_text() == page.title()
    assert "Gate: RED (exit code 2)" in page.locator("p").first.inner_text()
    assert console_errors == []


def test_the_environment_table_is_visible_and_names_the_run(page, small_sweep):
    table = page.locator("xpath=//h2[normalize-space()='Environment']/following-sibling::div[1]//table")
    assert table.is_visible()
    fields = table.locator("tbody tr td:first-child").all_inner_texts()
    assert {"device", "python", "torch", "triton", "git commit", "contract", "contract sha256"} <= set(fields)
    text = table.inner_text()
    contract = analysis.load_checks(small_sweep)["contract_sha256"].unique()
    assert torch.__version__ in text and all(sha in text for sha in contract)


def test_every_plot_is_loaded_and_shown(page):
    images = page.locator("img")
    assert images.count() == len(PLOTS)
    for image in images.all():
        image.scroll_into_view_if_needed()
        loaded = image.evaluate("img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0")
        assert loaded and image.is_visible() and image.bounding_box()["height"] > 100, image.get_attribute("alt")


# The colour of each pixel of an image as the page decoded it, at (x, y) from its top left: read through a canvas.
PIXELS = """(img, points) => {
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const context = canvas.getContext("2d");
    context.drawImage(img, 0, 0);
    return points.map(([x, y]) => Array.from(context.getImageData(x, y, 1, 1).data));
}"""


def test_each_heatmap_cell_shows_the_colour_of_its_verdict(page, small_sweep):
    # The hue was the magnitude: a tp=2 run whose tp verdicts passed within their bound was drawn dark red.
    checks = analysis.load_checks(small_sweep)
    grid = analysis.dlogp_vs_canonical(analysis.load_tokens(small_sweep))
    drawn = plots.heatmap_cells(grid, analysis.cell_outcomes(checks))
    figure = plots.heatmap(grid, analysis.cell_outcomes(checks))
    data = base64.b64encode(plots.png_bytes(figure)).decode("ascii")  # laid out as saved: the transforms are the PNG's
    image = page.locator(f'img[src="data:image/png;base64,{data}"]')  # the page's heatmap is this figure's PNG
    assert image.count() == 1
    to_pixels, height = figure.axes[0].transData, figure.bbox.height
    cells = list(np.ndindex(drawn.values.shape))
    # Left of each cell's centre, clear of its text; PNG rows count from the top.
    points = [[int(x), int(height - y)] for x, y in (to_pixels.transform((j - 0.4, i)) for i, j in cells)]
    image.scroll_into_view_if_needed()
    colors = image.evaluate(PIXELS, points)
    expected = [heatmap_verdict(checks, drawn.columns.iloc[j], drawn.cells[i]) for i, j in cells]
    assert [seen_verdict(color) for color in colors] == expected
    assert {Outcome.PASSED, Outcome.NOT_AS_EXPECTED, None} <= set(expected)
    tp2 = [k for k, (i, j) in enumerate(cells) if tuple(drawn.columns.iloc[j][["profile", "tp"]]) == ("cpu_bf16", 2)]
    assert all(drawn.mismatched[cells[k]] > 0 and expected[k] == Outcome.PASSED for k in tp2) and tp2


def test_the_red_verdicts_unfold_and_every_one_is_listed(page, small_sweep, console_errors):
    red = red_verdicts(analysis.load_checks(small_sweep))
    groups = red.groupby(RED_GROUPS, sort=False).size()
    folds = page.locator("details")
    assert folds.count() == len(groups) > 0
    listed = 0
    for fold, count in zip(folds.all(), groups, strict=True):
        rows = fold.locator("tbody tr")
        assert not rows.first.is_visible()  # closed until the reader opens it
        summary = fold.locator("summary")
        assert re.search(rf": {count} verdicts?$", summary.inner_text())
        summary.click()
        assert fold.evaluate("details => details.open")
        assert rows.first.is_visible() and rows.count() == count
        listed += rows.count()
    assert listed == len(red)
    assert console_errors == []

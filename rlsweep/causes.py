"""Verdicts grouped by cause, for people: one line per cause with its count and first rows (docs/sweeps.md).

The run's and the gate's console and ``summary.md`` list red verdicts this way; the tables keep every row. A cause
is read off the rows themselves (``cause_key``): one root cause makes one line, whatever the tp degrees and cells
it failed in, and rows of other profiles, judgments, tensors or outcomes are never one cause.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlsweep.judgments import PER_METRIC
from rlsweep.verdicts import NOT_RUN_DETAIL, Judgment, Outcome, expectation, outcome, provenance_stopped

FIRST_ROWS = 3  # rows named on a cause's line
MAX_CAUSES = 10  # cause lines a console prints; summary.md has them all
NOT_RUN = NOT_RUN_DETAIL.removesuffix(": ")  # the cause of rows that never ran, whatever their judgment
# What differs from one row of a cause to the next: digests (run ids, sha256), then numbers (counts, values, tp
# degrees, token keys); a number inside a word (bf16, v2, kernel_2) or a version (2.13.0) is part of a name.
DIGEST = re.compile(r"\b[0-9a-f]{12,}\b")
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)(?![\w.])")
NUMBER_LIST = re.compile(r"\[#(?:, #)*\]")  # call rows [0, 1, 2] vs [0]: lists of any length


def one_line(detail: Any) -> str:
    """A detail as one line of a listing (a provenance error may span several)."""
    return " ".join(str(detail).split())


def normalised(detail: str) -> str:
    """``detail`` with its row-specific values replaced: 'bitwise logp: # of # active tokens differ; ...'."""
    return NUMBER_LIST.sub("[#]", NUMBER.sub("#", DIGEST.sub("<digest>", detail)))


class CauseKey(NamedTuple):
    """What one cause's rows share."""

    profile: str  # "" where the rows are one run's (the run's console)
    what: str  # judgment and tensor, or NOT_RUN
    passed: bool
    expected_pass: bool
    detail: str  # normalised


def cause_key(row: Mapping[str, Any]) -> CauseKey:
    """What one cause's rows share: the profile (where the rows name one), what failed, the outcome against the
    declarations, and the detail without its numbers.

    A row that never ran is of its reason ('not run: provenance stopped the kernels (...)'), whatever judgment it
    stood for; an ``expected_red`` row's detail names its declaration, which is kept whole (two declarations, two
    causes).
    """
    detail = one_line(row["detail"])
    why = provenance_stopped(detail)
    if why is not None:  # refused by the provenance check: the same cause as the red provenance verdict saying why
        return CauseKey(str(row.get("profile", "")), Judgment.PROVENANCE.value, False, True, normalised(why))
    if detail.startswith(NOT_RUN_DETAIL):
        what, text = NOT_RUN, normalised(detail.removeprefix(NOT_RUN_DETAIL))
    else:
        what = " ".join(str(part) for part in (row["judgment"], row["tensor"]) if part)
        text = detail if row["judgment"] == Judgment.EXPECTED_RED else normalised(detail)
    return CauseKey(str(row.get("profile", "")), what, bool(row["passed"]), bool(row["expected_pass"]), text)


@dataclass
class Cause:
    """Rows of one cause, in the order they came: the line names the first row's detail and the first rows."""

    key: CauseKey
    detail: str  # the first row's, numbers and all
    rows: list[str] = field(default_factory=list)  # each row's identifier

    @property
    def line(self) -> str:
        """'4 verdicts: <profile> <judgment> <tensor> (<outcome>) at <first rows> and 1 more; first: <detail>'."""
        key = self.key
        said = outcome(key.passed, key.expected_pass)
        said = expectation(key.expected_pass) if said == Outcome.NOT_AS_EXPECTED else said
        named = [name for name in self.rows if name]
        more = f" and {len(named) - FIRST_ROWS} more" if len(named) > FIRST_ROWS else ""
        where = f" at {', '.join(named[:FIRST_ROWS])}{more}" if named else ""
        count = f"{len(self.rows)} verdicts" if len(self.rows) > 1 else "1 verdict"
        subject = " ".join(filter(None, (key.profile, key.what)))
        first = "; first" if len(self.rows) > 1 else ""  # the rows' numbers differ: the detail is the first row's
        return f"{count}: {subject} ({said}){where}{first}: {self.detail.removeprefix(NOT_RUN_DETAIL)}"


def row_name(row: Mapping[str, Any], key: CauseKey) -> str:
    """A row's identifier on its cause's line, without what the line already says: its tp, judgment and tensor
    where the cause does not name them, its cell, and its metric where a judgment has a row per metric."""
    parts = [f"tp={row['tp']}"] if "tp" in row else []
    if key.what == NOT_RUN or row["judgment"] not in key.what.split():
        parts += [row["judgment"], row["tensor"]]
    parts.append(row["lhs_cell"])
    if row["judgment"] in PER_METRIC:
        parts.append(row["metric"])
    return " ".join(str(part) for part in parts if part)


def group_by_cause(rows: Iterable[Mapping[str, Any]]) -> list[Cause]:
    """The causes of ``rows`` (checks-table rows as mappings; ``profile`` and ``tp`` where they span runs), in the
    order of each cause's first row."""
    causes: dict[CauseKey, Cause] = {}
    for row in rows:
        key = cause_key(row)
        cause = causes.setdefault(key, Cause(key, one_line(row["detail"])))
        cause.rows.append(row_name(row, key))
    return list(causes.values())


def cause_lines(rows: Iterable[Mapping[str, Any]], *, limit: int | None = None, rest: str = "") -> list[str]:
    """One line per cause of ``rows``; with ``limit``, at most that many and a last line counting the others,
    which ``rest`` says where to find."""
    causes = group_by_cause(rows)
    lines = [cause.line for cause in causes[:limit]]
    left = causes[len(lines) :]
    if left:
        causes_left = f"{len(left)} more cause" + "s" * (len(left) > 1)
        lines.append(f"... {causes_left} ({sum(len(cause.rows) for cause in left)} verdicts) in {rest}")
    return lines

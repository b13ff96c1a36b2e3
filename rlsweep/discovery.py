"""What an output dir holds, and which of its runs the gate judges (docs/sweeps.md#complete).

A dir holds a single run or a sweep, never both (``single_run_marks``, ``sweep_marks``; a run or a sweep refuses a
dir that holds the other). A sweep records its job list when it starts (``write_job_list``), tied to Hydra's
``multirun.yaml``; ``discover`` finds every run dir under a root and sorts them into complete runs to judge and
what is missing or incomplete: a job without exactly one complete run, a run dir no job list names, a table file no
manifest names.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rlsweep.errors import ConfigError, OutputDirError, UnreadablePathError
from rlsweep.listing import Listing, list_tree, os_reason, present, readable_text
from rlsweep.manifest import (
    HYDRA_CONFIG,
    MANIFEST_FILE,
    canonical_sha256,
    plain_yaml,
    read_manifest,
    table_files,
    verify_run,
)
from rlsweep.tables import (
    PARTITION_NAME,
    RUN_TABLES,
    TableError,
    dataset_entries,
    hidden,
    is_partition,
    write_tables,
)

MULTIRUN_FILE = "multirun.yaml"  # Hydra's record of a sweep: its sweeper, parameters and overrides
JOBS_FILE = "jobs.json"  # every job's overrides, written at the sweep's start (rlsweep.callbacks)
JOBS_FORMAT = "rlsweep-sweep-jobs/2"
JOB_OVERRIDES = Path(".hydra") / "overrides.yaml"


def job_key(overrides: Sequence[str]) -> tuple[str, ...]:
    """What tells a sweep's jobs apart: the set of their overrides, as Hydra records them in each job's dir."""
    return tuple(sorted(overrides))


def check_distinct_jobs(jobs: Sequence[Sequence[str]], where: str) -> None:
    """No two jobs of a sweep with the same overrides: the gate finds a job's run dir by them."""
    first: dict[tuple[str, ...], int] = {}
    for number, job in enumerate(jobs):
        earlier = first.setdefault(job_key(job), number)
        if earlier != number:
            raise ConfigError(
                f"{where}: job #{number} ({' '.join(job)}) repeats job #{earlier}: a job's run is found by its "
                "overrides, so each job of a sweep must have its own; drop the repeated value"
            )


def job_list_sha256(sweep: Any, jobs: Sequence[Sequence[str]]) -> str:
    return canonical_sha256({"sweep": sweep, "jobs": [list(job) for job in jobs]})


def write_job_list(sweep_dir: Path, sweep: dict[str, Any], jobs: Sequence[Sequence[str]]) -> None:
    """Record at the sweep's start what Hydra expands its jobs from (``rlsweep.config.sweep_record``), every job's
    overrides, and the sha256 of both, for the gate to judge the sweep against."""
    record = {"format": JOBS_FORMAT, "sweep": sweep, "jobs": [list(job) for job in jobs]}
    text = json.dumps({**record, "sha256": job_list_sha256(sweep, jobs)}, indent=2) + "\n"
    write_tables(sweep_dir, {}, files={JOBS_FILE: text})


def hydra_sweep_record(sweep_dir: Path) -> dict[str, Any]:
    """What Hydra's ``multirun.yaml`` says the sweep's jobs are expanded from: the sweeper's params, the overrides."""
    path = sweep_dir / MULTIRUN_FILE
    try:
        hydra = plain_yaml(readable_text(path))["hydra"]
        return {"params": hydra["sweeper"]["params"], "task": hydra["overrides"]["task"]}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError) as err:
        raise TableError(
            f"{str(path)!r} cannot be read as Hydra's record of the sweep: {type(err).__name__}: "
            f"{' '.join(str(err).split())}"
        ) from err


def sweep_jobs(sweep_dir: Path) -> list[tuple[str, ...]]:
    """Every job's overrides, in job order, as the sweep recorded them at its start (``write_job_list``).

    The list must be the one rlsweep wrote (its sha256), for the sweep Hydra recorded beside it (``multirun.yaml``),
    each job once: a list edited by hand, or copied from another sweep, would judge a sweep against other jobs. One
    that exists but cannot be read (its permissions) is an ``UnreadablePathError``: the sweep is INCOMPLETE.
    """
    path = sweep_dir / JOBS_FILE
    try:
        record = json.loads(readable_text(path))
        if record.get("format") != JOBS_FORMAT or not all(
            isinstance(job, list) and all(isinstance(o, str) for o in job) for job in record["jobs"]
        ):
            raise ValueError(f"not an rlsweep job list ({JOBS_FORMAT})")
        jobs = [tuple(job) for job in record["jobs"]]
        if record.get("sha256") != job_list_sha256(record.get("sweep"), jobs):
            raise ValueError(
                "it was changed after the sweep wrote it: its sha256 does not match its jobs; rerun the sweep into "
                "this dir (the same overrides and --multirun) to write it again"
            )
        recorded = hydra_sweep_record(sweep_dir)
        if canonical_sha256(recorded) != canonical_sha256(record["sweep"]):
            raise ValueError(
                f"it lists the jobs of {json.dumps(record['sweep'], sort_keys=True)}, but {MULTIRUN_FILE} records "
                f"the sweep {json.dumps(recorded, sort_keys=True)}"
            )
        check_distinct_jobs(jobs, "its jobs")
    except UnreadablePathError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise TableError(
            f"{str(path)!r} cannot be read as the sweep's job list ({' '.join(str(err).split())}); rlsweep writes "
            "it when a sweep starts, so this sweep was not started by rlsweep or its record is damaged"
        ) from err
    return jobs


def job_overrides(run_dir: Path) -> tuple[str, ...] | None:
    """The overrides Hydra recorded for a job's run, or None where it recorded none readable; a record that exists but
    cannot be read is an ``UnreadablePathError``: which job the dir is of is unknown, not "none"."""
    path = run_dir / JOB_OVERRIDES
    try:
        overrides = plain_yaml(readable_text(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return None
    return tuple(overrides)


def sweep_marks(directory: Path) -> list[Path]:
    """What shows that ``directory`` holds a sweep: Hydra's multirun.yaml, the job list, ``job=<n>`` partitions."""
    marks = [directory / name for name in (MULTIRUN_FILE, JOBS_FILE) if present(directory / name)]
    return marks + [entry for entry in dataset_entries(directory) if is_partition(entry)]


def single_run_marks(directory: Path) -> list[Path]:
    """What shows that ``directory`` holds a single run: its manifest, Hydra's record of a run, tables outside a
    partition (a dataset folder that cannot be listed among them: it may hold anything)."""
    marks = [directory / name for name in (MANIFEST_FILE, HYDRA_CONFIG) if present(directory / name)]
    return marks + [entry for entry in dataset_entries(directory) if not is_partition(entry)]


def listed(paths: Sequence[Path], directory: Path, limit: int = 4) -> str:
    names = [str(path.relative_to(directory)) for path in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def named_dir(directory: Path, key: str | None) -> str:
    return f"output directory {str(directory)!r}" + (f" ({key})" if key else "")


def refuse_sweep_over_run(sweep_dir: Path) -> None:
    """A sweep never starts in a dir that holds a single run: the gate would take that run for one of its jobs; nor in
    a dir inside another sweep: that sweep's gate would judge it with its own jobs; nor inside a run's dir
    (``refuse_inside_a_run``)."""
    marks = single_run_marks(sweep_dir)
    if marks:
        raise OutputDirError(
            f"{named_dir(sweep_dir, 'hydra.sweep.dir')} holds a single run ({listed(marks, sweep_dir)}); a sweep "
            "there would mix its jobs' tables with that run's: choose another hydra.sweep.dir (a new one, or a "
            "sweep's to resume it), or move the run away"
        )
    outer = sweep_around(sweep_dir)
    if outer is not None:
        raise OutputDirError(
            f"{named_dir(sweep_dir, 'hydra.sweep.dir')} lies inside the sweep {str(outer)!r} "
            f"({listed(sweep_marks(outer), outer)}), whose gate would judge this sweep's runs with its own jobs: "
            "choose another hydra.sweep.dir (a new one, or a sweep's to resume it)"
        )
    refuse_inside_a_run(sweep_dir, "hydra.sweep.dir")


def refuse_run_over_sweep(run_dir: Path, key: str | None = None) -> None:
    """A single run never writes into a sweep's dir: it would replace the datasets that hold the sweep's partitions;
    nor into a dir inside one (a job's dir, a dataset folder): it would replace a job's run or be taken for one; nor
    inside another run's dir (``refuse_inside_a_run``). Its own dir may hold a run: a rerun replaces it."""
    marks = sweep_marks(run_dir)
    if marks:
        raise OutputDirError(
            f"{named_dir(run_dir, key)} holds a sweep ({listed(marks, run_dir)}); a single run there would delete the "
            "sweep's tables: write the run elsewhere (hydra.run.dir=..., tables_dir=...), or run the sweep again with "
            "--multirun to redo its jobs"
        )
    outer = sweep_around(run_dir)
    if outer is not None:
        raise OutputDirError(
            f"{named_dir(run_dir, key)} lies inside the sweep {str(outer)!r} ({listed(sweep_marks(outer), outer)}); a "
            "single run there would replace a job's run or be judged as one of the sweep's: write the run elsewhere "
            "(hydra.run.dir=..., tables_dir=...), or run the sweep again with --multirun to redo its jobs"
        )
    refuse_inside_a_run(run_dir, key)


def refuse_inside_a_run(directory: Path, key: str | None) -> None:
    """Nothing is written inside another run's dir (``run_around``): in its tokens/ or checks/ folder a dataset reader
    would load the files as that run's rows, and anywhere under it they would be judged as part of its dir."""
    outer = run_around(directory)
    if outer is not None:
        raise OutputDirError(
            f"{named_dir(directory, key)} lies inside the run dir {str(outer)!r} "
            f"({listed(single_run_marks(outer), outer)}), whose files it would break or be judged with: write "
            "elsewhere (a dir of its own outside every run's dir)"
        )


def run_around(directory: Path) -> Path | None:
    """The nearest dir above ``directory`` (by its name, then through links) that holds a single run, or None."""
    for path in (lexical(directory), directory.resolve()):
        outer = next((parent for parent in path.parents if single_run_marks(parent)), None)
        if outer is not None:
            return outer
    return None


def holder(directory: Path) -> Path | None:
    """The nearest dir at or above ``directory`` (resolved) that holds a single run or a sweep, or None."""
    path = directory.resolve()
    return next((d for d in (path, *path.parents) if single_run_marks(d) or sweep_marks(d)), None)


def candidate_dirs(listing: Listing) -> set[Path]:
    """Directories that hold, or were meant to hold, a run: a manifest or Hydra's job record."""
    found = {path.parent for path in listing.named(MANIFEST_FILE)}
    records = listing.named(HYDRA_CONFIG.name)
    return found | {path.parent.parent for path in records if path.parent.name == HYDRA_CONFIG.parent.name}


def visible_tables(listing: Listing) -> set[Path]:
    """Every file (or link) a dataset reader would load from the tokens/ and checks/ folders under the listed root,
    whatever its name, hidden names aside; as absolute paths, ``..`` resolved by name (links stay links)."""
    found = set()
    for path in listing.files():
        parts = path.relative_to(listing.root).parts
        if any(part in RUN_TABLES for part in parts) and not any(hidden(part) for part in parts):
            found.add(lexical(path))
    return found


def linked_runs(listing: Listing) -> list[str]:
    """Links under the listed root to a directory outside it that holds runs or sweeps, or that cannot be read: the
    search does not follow links (a link to a dir under the root is judged where that dir lies), so the runs there
    would be left out unseen."""
    inside = listing.root.resolve()
    lines = []
    for link in sorted(listing.links):
        target = link.resolve()
        try:
            if not stat.S_ISDIR(os.stat(link).st_mode) or target.is_relative_to(inside):
                continue
        except (FileNotFoundError, NotADirectoryError):  # a dangling link: a table file where it lies in a dataset
            continue
        except OSError as err:
            lines.append(f"{link}: a link to {str(target)!r}, which cannot be read: {os_reason(err)}; links are not "
                         f"followed, so what it holds is not judged here: python -m rlsweep.check {target} "
                         "judges it")  # fmt: skip
            continue
        there = list_tree(target)
        if candidate_dirs(there) or sweep_dirs(there):
            held = "which holds rlsweep runs"
        elif there.unreadable:  # it may hold runs
            path, reason = next(iter(there.unreadable.items()))
            held = f"part of which cannot be listed ({path}: {reason}), so it may hold rlsweep runs"
        else:
            continue
        lines.append(f"{link}: a link to {str(target)!r}, {held}; links are not followed, so they are not judged "
                     f"here: python -m rlsweep.check {target} judges them")  # fmt: skip
    return lines


def lexical(path: Path) -> Path:
    return Path(os.path.normpath(path.absolute()))


def orphan_tables(listing: Listing, candidates: set[Path]) -> list[str]:
    """Table files that no run's manifest names: left by a crash, an older sweep or a copy, never data to trust.

    A file in the folder of a table that a manifest names is that run's to report (``verify_run``).
    """
    named = set()
    for directory in candidates:
        manifest, _ = read_manifest(directory)
        if manifest is not None:
            named |= {lexical(path) for path in table_files(directory, manifest).values()}
    folders = {path.parent for path in named}
    stray = [path for path in visible_tables(listing) - named if path.parent not in folders]
    return [f"{path}: no run's {MANIFEST_FILE} names this table file (stale, partial or copied)" for path in
            sorted(stray)]  # fmt: skip


def sweep_dirs(listing: Listing) -> list[Path]:
    """Every dir under the listed root (itself included) that shows a sweep by any of its ``sweep_marks``, deepest
    first: a sweep whose Hydra record or job list is gone is still judged as one, and fails on the missing record."""
    found = {path.parent for path in listing.named(MULTIRUN_FILE, JOBS_FILE)}
    found |= {path.parent.parent for path in listing.entries
              if path in listing.directories and PARTITION_NAME.fullmatch(path.name)
              and path.parent.name in RUN_TABLES and path.parent != listing.root}  # fmt: skip
    return sorted(found, key=lambda path: len(path.parts), reverse=True)


def sweep_around(directory: Path) -> Path | None:
    """The sweep a dir about to be written lies inside, by its name or through a link (``enclosing_sweep``)."""
    return enclosing_sweep(directory) or enclosing_sweep(directory.resolve())


def enclosing_sweep(root: Path) -> Path | None:
    """The sweep dir that ``root`` lies inside (a job dir checked on its own, say), or None."""
    if sweep_marks(root):
        return None
    return next((parent for parent in root.absolute().parents if sweep_marks(parent)), None)


def discover(root: Path) -> tuple[list[Path], list[str], str]:
    """(complete run dirs to judge, what is missing or incomplete, the scope when ``root`` is part of a sweep).

    Runs inside a sweep dir are judged against that sweep's job list; runs outside any sweep stand alone. Under a
    dir inside a sweep (a job dir), its runs are judged as that sweep's jobs, and the sweep's verdict is not there
    to give (``part_of_a_sweep``): its other jobs and its cross-run verdicts are not under ``root``. A directory
    under ``root`` that cannot be listed comes first among the missing: what it holds is unknown (``list_tree``).
    """
    listing = list_tree(root)
    sweeps = sweep_dirs(listing)
    candidates = candidate_dirs(listing)
    complete: list[Path] = []
    incomplete: list[str] = listing.unreadable_lines()
    claimed: set[Path] = set()
    for sweep_dir in sweeps:
        members = sorted(d for d in candidates - claimed if d.is_relative_to(sweep_dir) and d != sweep_dir)
        claimed.update(members)
        marks = [mark for mark in single_run_marks(sweep_dir) if mark not in listing.unreadable]
        if marks:  # never one of the sweep's runs, nor a run beside it
            claimed.add(sweep_dir)
            incomplete.append(f"{sweep_dir}: a single run ({listed(marks, sweep_dir)}) in this sweep dir, whose "
                              "datasets it shares with the sweep's jobs; not judged")  # fmt: skip
        found, missing, _ = sweep_runs(sweep_dir, members)
        complete += found
        incomplete += missing
    scope = ""
    outer = enclosing_sweep(root)
    if outer is not None and (members := sorted(candidates - claimed)):
        claimed.update(members)
        found, missing, jobs = sweep_runs(outer, members, whole=False)
        complete += found
        scope = f"{', '.join(jobs) or 'no job'} of the sweep {outer} only"
        incomplete += missing
    for run_dir in sorted(candidates - claimed):
        state = verify_run(run_dir)
        if state.complete:
            complete.append(run_dir)
        else:
            incomplete.append(f"{run_dir}: {state.reason}")
    return complete, incomplete + orphan_tables(listing, candidates) + linked_runs(listing), scope


def part_of_a_sweep(root: Path, scope: str) -> str:
    """What a gate over part of a sweep (``discover``'s scope) lacks: the gate's INCOMPLETE line for it."""
    return (
        f"{root}: {scope}; its other jobs and its cross-run verdicts are not under this dir, so this is not the "
        f"sweep's verdict: python -m rlsweep.check {enclosing_sweep(root)} gives it"
    )


def sweep_runs(sweep_dir: Path, members: Sequence[Path], whole: bool = True) -> tuple[list[Path], list[str], list[str]]:
    """The complete runs of a sweep's jobs among ``members`` (the run dirs under it), what is missing or incomplete
    (a job without exactly one complete run, a run dir that is no job of the sweep's list), and the jobs found.

    ``whole``: ``members`` are all of the sweep's run dirs, so a job without one is missing; else only some are.
    A job list, or a job's record of its overrides, that cannot be read leaves the runs it would place unjudged.
    """
    complete: list[Path] = []
    incomplete: list[str] = []
    found: list[str] = []
    try:
        jobs = sweep_jobs(sweep_dir)
    except UnreadablePathError as err:
        return [], [f"{sweep_dir}: {err}, so which runs are its jobs is unknown; none of its runs is judged"], []
    by_job: dict[tuple[str, ...], list[Path]] = {}
    for member in members:
        try:
            by_job.setdefault(job_key(job_overrides(member) or ()), []).append(member)
        except UnreadablePathError as err:
            incomplete.append(f"{member}: {err}, so which job of the sweep {sweep_dir} it ran is unknown; not judged")
    for number, job in enumerate(jobs):
        dirs = by_job.pop(job_key(job), [])
        name = f"job #{number} ({' '.join(job)})"
        found += [name] if dirs else []
        label = f"{sweep_dir}: {name}"
        if not dirs:
            incomplete += [f"{label}: no run dir"] if whole else []
        elif len(dirs) > 1:
            incomplete.append(f"{label}: {len(dirs)} run dirs claim it ({', '.join(map(str, dirs))})")
        elif (state := verify_run(dirs[0])).complete:
            complete.append(dirs[0])
        else:
            incomplete.append(f"{label} in {dirs[0]}: {state.reason}")
    for key, dirs in by_job.items():  # left by an earlier sweep into the same dir, or dropped from the list
        incomplete += [
            f"{d}: not a job of {sweep_dir / JOBS_FILE} ({' '.join(key) or 'no overrides recorded'}), yet its "
            "tables may be in the sweep's datasets; remove the dir and its job=<n> partitions, or sweep into a new dir"
            for d in dirs
        ]
    return complete, incomplete, found

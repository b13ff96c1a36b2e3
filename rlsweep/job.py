"""A run's life in its directory: lock it, resume or invalidate, execute, then write the manifest last.

docs/sweeps.md ("Complete") says what a reader may trust: only tables that a matching manifest names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from rlsweep.causes import MAX_CAUSES, cause_lines
from rlsweep.discovery import lexical, refuse_run_over_sweep
from rlsweep.exitcodes import ExitCode
from rlsweep.gate import remove_sweep_outputs
from rlsweep.locks import locked
from rlsweep.manifest import RunIdentity, identify, invalidate, verify_run, write_manifest
from rlsweep.run import RunOutcome, execute
from rlsweep.spec import RunSpec
from rlsweep.tables import CHECKS_TABLE, RUN_TABLES, RunLocation, check_writable


def summary(outcome: RunOutcome) -> str:
    """The run's verdict in one line, its tables, then its verdicts not as expected, one line per cause."""
    verdicts = outcome.verdicts
    unexpected = outcome.unexpected
    lines = [
        f"rlsweep run {outcome.run_id}: {len(verdicts)} checks, {sum(v.passed for v in verdicts)} passed, "
        f"{len(unexpected)} not as expected -> {outcome.exit_code.word}",
        f"tables: {outcome.location.root}: {', '.join(str(path) for path in outcome.files.values())}",
    ]
    rows = [asdict(verdict) for verdict in unexpected]
    lines += [f"  {line}" for line in cause_lines(rows, limit=MAX_CAUSES, rest=str(outcome.files[CHECKS_TABLE]))]
    return "\n".join(lines)


def already_done(location: RunLocation, identity: RunIdentity) -> bool:
    """True when the run dir holds a complete run produced by exactly this content (config, files, code), whose tables
    are this location's: a job's run found in another job's partition (a resumed sweep's jobs in another order, their
    dirs named by their overrides) runs again, else the job that owns that partition would delete its tables."""
    state = verify_run(location.run_dir)
    return (
        state.complete
        and state.manifest.get("content_sha256") == identity.content_sha256
        and {name: lexical(path) for name, path in state.files.items()}
        == {name: lexical(location.table_file(name)) for name in RUN_TABLES}
    )


def run_job(
    read_spec: Callable[[], RunSpec],
    location: RunLocation,
    *,
    resume: bool,
    standalone: bool,
    saved_config_sha256: str | None = None,
) -> ExitCode:
    """The run ``read_spec`` parses, at ``location``, its run dir held locked; GREEN or RED, raises on bad input.

    A config that does not parse leaves nothing behind that reads as its result: the dir's old tables go first.
    ``resume``: skip the run when its manifest says the same content produced it (a sweep re-run).
    ``saved_config_sha256``: the hash of the config Hydra saved beside the run (``rlsweep.manifest``).
    """
    directory = location.run_dir
    if location.partition is None:  # a single run's tables replace its dir's datasets, a sweep's partitions too
        refuse_run_over_sweep(directory)
    check_writable(directory)
    with locked(directory):
        if location.partition is None:  # a sweep removes its own when it starts
            remove_sweep_outputs(directory)
        try:
            spec = read_spec()
            identity = identify(spec.config, saved_config_sha256)
        except BaseException:
            invalidate(location)
            raise
        if resume and already_done(location, identity):
            print(f"rlsweep: skipping: run {identity.run_id} is complete in {directory} (same content)")
            return ExitCode.GREEN
        invalidate(location)
        outcome = execute(spec, location, identity, standalone=standalone)
        write_manifest(location, identity, outcome.files)
    print(summary(outcome))
    return outcome.exit_code

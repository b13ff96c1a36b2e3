"""A run's life in its directory: lock it, resume or invalidate, execute, then write the manifest last.

docs/sweeps.md ("Complete") says what a reader may trust: only tables that a matching manifest names.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlsweep.exitcodes import ExitCode
from rlsweep.locks import locked
from rlsweep.manifest import RunIdentity, identify, invalidate, verify_run, write_manifest
from rlsweep.run import RunOutcome, execute
from rlsweep.tables import CHECKS_TABLE, RunLocation, check_writable

MAX_LISTED = 20


def summary(outcome: RunOutcome) -> str:
    verdicts = outcome.verdicts
    unexpected = outcome.unexpected
    lines = [
        f"rlsweep run {outcome.run_id}: {len(verdicts)} checks, {sum(v.passed for v in verdicts)} passed, "
        f"{len(unexpected)} not as expected -> {outcome.exit_code.word}",
        f"tables: {outcome.location.root}: {', '.join(str(path) for path in outcome.files.values())}",
    ]
    for verdict in unexpected[:MAX_LISTED]:
        expectation = "expected pass" if verdict.expected_pass else "expected red, passed"
        lines.append(
            f"  {verdict.judgment} {verdict.lhs_cell or '-'} {verdict.tensor or '-'} ({expectation}): {verdict.detail}"
        )
    if len(unexpected) > MAX_LISTED:
        lines.append(f"  ... {len(unexpected) - MAX_LISTED} more in {outcome.files[CHECKS_TABLE]}")
    return "\n".join(lines)


def already_done(directory: Path, identity: RunIdentity) -> bool:
    """True when ``directory`` holds a complete run produced by exactly this content (config, files, code)."""
    state = verify_run(directory)
    return state.complete and state.manifest.get("content_sha256") == identity.content_sha256


def run_job(cfg: DictConfig, location: RunLocation, *, resume: bool, standalone: bool) -> ExitCode:
    """One run at ``location``, its run dir held locked; returns GREEN or RED, raises on bad input.

    ``resume``: skip the run when its manifest says the same content produced it (a sweep re-run).
    """
    directory = location.run_dir
    check_writable(directory)
    with locked(directory):
        config = OmegaConf.to_container(cfg, resolve=True)
        try:
            identity = identify(config)
        except BaseException:
            invalidate(location)
            raise
        if resume and already_done(directory, identity):
            print(f"rlsweep: skipping: run {identity.run_id} is complete in {directory} (same content)")
            return ExitCode.GREEN
        invalidate(location)
        outcome = execute(cfg, location, identity, standalone=standalone)
        write_manifest(location, identity, outcome.files)
    print(summary(outcome))
    return outcome.exit_code

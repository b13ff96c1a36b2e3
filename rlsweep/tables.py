"""Parquet tables of one run (SPEC §4.10), written atomically, with the run's JSON metadata.

A run directory is complete when both tables exist: they are written to temporary files in the
same folder and renamed only after both were written, checks last (``run_is_complete``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlsweep.errors import OutputDirError

TOKENS_TABLE = "tokens.parquet"
CHECKS_TABLE = "checks.parquet"
RUN_TABLES = (TOKENS_TABLE, CHECKS_TABLE)  # written in this order; checks present => run complete
METADATA_KEY = b"rlsweep"

RUN_COLUMNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("profile", pa.string()),
        ("backend_family", pa.string()),
        ("device", pa.string()),
        ("tp", pa.int64()),
        ("tp_mode", pa.string()),
        ("model", pa.string()),
        ("config_fingerprint", pa.string()),
        ("weight_hash", pa.string()),
        ("workload", pa.string()),
        ("contract_version", pa.string()),
        ("contract_sha256", pa.string()),
    ]
)
TOKENS_SCHEMA = pa.schema(
    [
        *RUN_COLUMNS,
        ("cell", pa.string()),
        ("sample_id", pa.int64()),
        ("position", pa.int64()),
        ("target_id", pa.int64()),
        ("active", pa.bool_()),
        ("logp", pa.float32()),
        ("lse", pa.float32()),
        ("ref_logp", pa.float64()),
        ("owner_rank", pa.int64()),
    ]
)
CHECKS_SCHEMA = pa.schema(
    [
        *RUN_COLUMNS,
        ("judgment", pa.string()),
        ("tensor", pa.string()),
        ("lhs_role", pa.string()),
        ("rhs_role", pa.string()),
        ("lhs_cell", pa.string()),
        ("rhs_cell", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("threshold", pa.float64()),
        ("passed", pa.bool_()),
        ("expected_pass", pa.bool_()),
        ("first_sample_id", pa.int64()),
        ("first_position", pa.int64()),
        ("detail", pa.string()),
    ]
)


def build_table(schema: pa.Schema, run: Mapping[str, Any], columns: Mapping[str, Any], rows: int) -> pa.Table:
    """Run columns repeated ``rows`` times, then the per-row ``columns``, cast to ``schema``."""
    arrays = []
    for field in schema:
        values = [run[field.name]] * rows if field.name in RUN_COLUMNS.names else columns[field.name]
        arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def with_metadata(table: pa.Table, metadata: Mapping[str, Any]) -> pa.Table:
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True, default=str).encode()})


def check_writable(directory: Path) -> None:
    """Fail before any work if the tables cannot go to ``directory``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-", delete=True)
        probe.close()
    except OSError as err:
        raise OutputDirError(f"output directory {str(directory)!r} cannot be written: {err.strerror or err}") from err


def write_tables(
    directory: Path, tables: Mapping[str, pa.Table], *, files: Mapping[str, str | bytes] | None = None
) -> None:
    """Write every file and table to a temporary file, then rename them in order, tables last.

    On any error nothing new is left behind; the last name renamed is the completion marker. The
    files get the permissions an ordinary ``open`` would give (the temporaries are private).
    """
    check_writable(directory)
    files = files or {}
    mode = 0o666 & ~current_umask()
    temporaries: dict[str, str] = {}
    renamed: list[Path] = []
    try:
        for name in [*files, *tables]:
            handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
            os.close(handle)
            temporaries[name] = temporary
            content = files.get(name)
            if isinstance(content, str):
                Path(temporary).write_text(content)
            elif isinstance(content, bytes):
                Path(temporary).write_bytes(content)
            else:
                pq.write_table(tables[name], temporary)
            os.chmod(temporary, mode)
        for name in temporaries:
            os.replace(temporaries[name], directory / name)
            renamed.append(directory / name)
    except BaseException:
        for path in [*temporaries.values(), *renamed]:
            Path(path).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run_is_complete(directory: str | os.PathLike[str]) -> bool:
    """True when both tables of a run are present (the rename order makes this safe to trust)."""
    return all((Path(directory) / name).is_file() for name in RUN_TABLES)


def completed_run_id(directory: str | os.PathLike[str]) -> str | None:
    """The run_id of the complete run in ``directory``, or None (resume skips a job only when they match)."""
    if not run_is_complete(directory):
        return None
    run_ids = pq.read_table(Path(directory) / CHECKS_TABLE, columns=["run_id"]).column("run_id").unique()
    return str(run_ids[0]) if len(run_ids) == 1 else None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``rlsweep`` JSON metadata of one table."""
    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])

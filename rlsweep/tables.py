"""Parquet tables of one run (docs/tables.md), written atomically, with the run's JSON metadata.

Each file is written to a temporary file in the same folder and renamed into place, so no reader sees
half a table; the run's manifest (``rlsweep.manifest``), written after both, makes them valid together.
Reading checks each table against its schema, so a column of the wrong type is an error, not a verdict.
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

from rlsweep.errors import OutputDirError, TablesNotFoundError

TOKENS_TABLE = "tokens.parquet"
CHECKS_TABLE = "checks.parquet"
RUN_TABLES = (TOKENS_TABLE, CHECKS_TABLE)  # a run's tables; its manifest names both
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
        ("seed", pa.int64()),
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
        ("ref_lse", pa.float64()),
        ("logp_bound", pa.float64()),  # the rounding model's allowance of |logp - ref_logp| (kernels.rounding_bound)
        ("lse_bound", pa.float64()),
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


class TableError(TablesNotFoundError):
    """A table that cannot be read, or whose columns are not the schema's."""


def read_table(path: str | os.PathLike[str], schema: pa.Schema) -> pa.Table:
    """Read a table and check it has exactly ``schema``'s columns and types (metadata aside)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise TableError(f"{str(path)!r} cannot be read as Parquet: {' '.join(str(err).split())}") from err
    if table.schema.remove_metadata() != schema:
        wrong = [
            f"{field.name}: {table.schema.field(field.name).type if field.name in table.schema.names else 'missing'}"
            f" (expected {field.type})"
            for field in schema
            if field.name not in table.schema.names or table.schema.field(field.name).type != field.type
        ]
        extra = sorted(set(table.schema.names) - set(schema.names))
        raise TableError(f"{str(path)!r} does not have the rlsweep schema: {', '.join(wrong) or ''}"
                         f"{' extra columns ' + ', '.join(extra) if extra else ''}")  # fmt: skip
    return table


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``rlsweep`` JSON metadata of one table."""
    try:
        return json.loads((pq.read_schema(path).metadata or {})[METADATA_KEY])
    except (OSError, pa.ArrowException, KeyError, ValueError) as err:
        raise TableError(f"{str(path)!r} has no readable rlsweep metadata: {' '.join(str(err).split())}") from err

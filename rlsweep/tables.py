"""Parquet tables of one run (docs/tables.md): two datasets, written so that a reader never sees a partial run.

A run's tables go into two dataset folders under a dataset root: ``tokens/`` and ``checks/``. A single run
is its own root (``<run dir>/tokens/part-0.parquet``); a sweep's jobs share the sweep dir as root, one
hive-style partition each (``<sweep dir>/tokens/job=<n>/part-0.parquet``), so one ``pd.read_parquet``
of ``<sweep dir>/tokens`` loads the whole sweep. Each partition is written into a hidden staging folder
and renamed into place whole, and a rerun removes the old partition first (renamed away, then deleted),
so a plain reader sees a job's rows only once they are complete. The run's manifest (``rlsweep.manifest``),
written after both, is what makes them valid for rlsweep. Reading checks each table against its schema.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlsweep.errors import OutputDirError, TablesNotFoundError

TOKENS_TABLE = "tokens"  # dataset folder names; a run's manifest names its file in each
CHECKS_TABLE = "checks"
DIVERGENCE_TABLE = "divergence"  # a whole model's modules in each cell that broke invariance (empty for the head)
RUN_TABLES = (TOKENS_TABLE, CHECKS_TABLE, DIVERGENCE_TABLE)
PART_FILE = "part-0.parquet"  # the one file of a run's partition
PARTITION_KEY = "job"  # a sweep's partitions: job=<Hydra job number>, the number of the job's own dir
PARTITION_NAME = re.compile(rf"{PARTITION_KEY}=\d+")
SCHEMA_VERSION = "rlsweep-tables/6"  # in every table's metadata; bumped when a schema changes
METADATA_KEY = b"rlsweep"


@dataclass(frozen=True)
class RunLocation:
    """Where one run's files go: its manifest (and Hydra's record) in ``run_dir``, its tables under ``root``.

    ``partition`` is ``job=<n>`` for a sweep's job and None for a single run, whose dataset folders hold
    its table directly.
    """

    run_dir: Path
    root: Path
    partition: str | None = None

    @classmethod
    def single(cls, run_dir: Path) -> RunLocation:
        return cls(run_dir, run_dir)

    @classmethod
    def sweep_job(cls, run_dir: Path, sweep_dir: Path, job_num: int) -> RunLocation:
        return cls(run_dir, sweep_dir, f"{PARTITION_KEY}={job_num}")

    def table_dir(self, table: str) -> Path:
        return self.root / table / self.partition if self.partition else self.root / table

    def table_file(self, table: str) -> Path:
        return self.table_dir(table) / PART_FILE


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
        ("workload_hash", pa.string()),
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
        ("grad_norm", pa.float64()),  # grad=true: the L2 norm of the token's d hidden (NaN without grad)
        ("grad_used", pa.float64()),  # grad=true: max |d hidden - float64| / bound over the token's row
        ("grad_bits", pa.string()),  # grad=true: sha256 of the row's d hidden bits (16 hex digits); null without
        ("grad_weight_bits", pa.string()),  # grad=true: sha256 of the cell's d weight bits, on each of its rows
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
# One row per module of a whole model's body, per layout cell whose logp broke invariance, against the canonical
# cell (rlsweep.divergence); the first module to diverge has first_diverging true.
DIVERGENCE_SCHEMA = pa.schema(
    [
        *RUN_COLUMNS,
        ("cell", pa.string()),
        ("canonical_cell", pa.string()),
        ("module", pa.string()),  # its path in the model (model.layers.0.self_attn)
        ("module_class", pa.string()),
        ("order", pa.int64()),  # when it first started in the canonical cell's forward
        ("depth", pa.int64()),  # dots in its path
        ("tokens", pa.int64()),  # logical tokens both cells computed through it
        ("inputs_equal", pa.bool_()),  # every per-token input bitwise equal in both cells
        ("tokens_differing", pa.int64()),  # tokens whose output bits differ
        ("max_abs_diff", pa.float64()),
        ("first_diverging", pa.bool_()),
    ]
)
DIVERGENCE_COLUMNS = tuple(name for name in DIVERGENCE_SCHEMA.names if name not in RUN_COLUMNS.names)


def build_table(schema: pa.Schema, run: Mapping[str, Any], columns: Mapping[str, Any], rows: int) -> pa.Table:
    """Run columns repeated ``rows`` times, then the per-row ``columns``, cast to ``schema``."""
    arrays = []
    for field in schema:
        values = [run[field.name]] * rows if field.name in RUN_COLUMNS.names else columns[field.name]
        arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def with_metadata(table: pa.Table, metadata: Mapping[str, Any]) -> pa.Table:
    """``metadata`` as the table's rlsweep JSON, with the schema version every table carries."""
    document = {"schema_version": SCHEMA_VERSION, **metadata}
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(document, sort_keys=True, default=str).encode()})


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written, or None; nothing is created on disk."""
    ancestor = directory.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{str(ancestor)!r} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{str(ancestor)!r} is not writable"
    return None


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
            with writing(directory / name):
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
            with writing(directory / name):
                os.replace(temporaries[name], directory / name)
            renamed.append(directory / name)
    except BaseException:
        for path in [*temporaries.values(), *renamed]:
            Path(path).unlink(missing_ok=True)
        raise


@contextmanager
def writing(path: Path, done: str = "written") -> Iterator[None]:
    """An OSError while ``path`` is written (a full disk, a read-only file system, a permission) is one line naming
    ``path`` and the OS's reason, whichever temporary or folder the call was at."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or " ".join(str(err).split()) or type(err).__name__
        raise OutputDirError(f"{str(path)!r} cannot be {done}: {reason}") from err


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def hidden(name: str) -> bool:
    """Dataset readers (pyarrow, pandas) skip names that start with a dot: rlsweep stages and removes folders there."""
    return name.startswith(".")


def dataset_entries(root: Path) -> list[Path]:
    """What a dataset reader finds first in ``root``'s tokens/ and checks/: a single run's table file, or a sweep's
    ``job=<n>`` partitions (``is_partition``), or anything else put there (a dataset path that is not a folder too,
    a folder that cannot be listed: what it holds is unknown)."""
    entries = []
    for table in RUN_TABLES:
        folder = root / table
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                entries.append(folder)
                continue
            with os.scandir(folder) as scan:
                entries += sorted(folder / entry.name for entry in scan if not hidden(entry.name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            entries.append(folder)
    return entries


def is_partition(entry: Path) -> bool:
    """A sweep job's partition folder: ``job=<n>``, a real folder (one that cannot be looked at is not known to be)."""
    try:
        return PARTITION_NAME.fullmatch(entry.name) is not None and stat.S_ISDIR(os.lstat(entry).st_mode)
    except OSError:
        return False


def table_folder(path: Path, root: Path) -> Path | None:
    """The tables folder under ``root`` that holds ``path`` (a ``tokens/`` or ``checks/`` folder, a ``job=<n>``
    partition), or None: a file put there is read by a dataset reader as part of the table."""
    root = root.resolve()
    try:
        parts = path.resolve().relative_to(root).parts
    except ValueError:
        return None
    for depth, part in enumerate(parts):
        if part in RUN_TABLES or PARTITION_NAME.fullmatch(part):
            return root.joinpath(*parts[: depth + 1])
    return None


def hidden_sibling(path: Path, tag: str) -> Path:
    """A fresh hidden folder beside ``path`` (dataset readers skip names that start with a dot)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{tag}-"))


def remove_dir(path: Path) -> None:
    """Make ``path`` disappear at once (renamed to a hidden sibling), then delete it."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir() or path.is_symlink():
        raise OutputDirError(f"{str(path)!r} should be a table folder but is not a directory")
    with writing(path, "removed"):
        doomed = hidden_sibling(path, "stale")
        os.replace(path, doomed / path.name)
        shutil.rmtree(doomed)


def remove_tables(location: RunLocation) -> None:
    """A rerun's first step after its manifest: its old partitions go, so no reader sees stale rows."""
    for table in RUN_TABLES:
        remove_dir(location.table_dir(table))


def publish_tables(location: RunLocation, tables: Mapping[str, pa.Table]) -> dict[str, Path]:
    """Write each table into a hidden staging folder, then rename the folders into place; returns the files.

    On any error nothing new is left visible. Files get the permissions an ordinary ``open`` would give.
    """
    mode = 0o666 & ~current_umask()
    staged: dict[str, Path] = {}
    published: list[Path] = []
    try:
        for name, table in tables.items():
            with writing(location.table_file(name)):
                staged[name] = hidden_sibling(location.table_dir(name), "staging")
                pq.write_table(table, staged[name] / PART_FILE)
                os.chmod(staged[name] / PART_FILE, mode)
                os.chmod(staged[name], 0o777 & ~current_umask())
        for name, folder in staged.items():
            target = location.table_dir(name)
            remove_dir(target)
            with writing(target):
                os.replace(folder, target)
            published.append(target)
    except BaseException:
        cleanup([*staged.values(), *published])
        raise
    return {name: location.table_file(name) for name in tables}


def cleanup(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


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
        if not wrong and not extra:  # the same columns and types: their order or nullability differs
            wrong = [f"{field.name}: nullable={table.schema.field(field.name).nullable} (expected {field.nullable})"
                     for field in schema if table.schema.field(field.name).nullable != field.nullable]  # fmt: skip
            wrong += [f"column {index} is {name} (expected {expected}, in the schema's order)"
                      for index, (name, expected) in enumerate(zip(table.schema.names, schema.names, strict=True))
                      if name != expected][:1]  # fmt: skip
        raise TableError(f"{str(path)!r} does not have the rlsweep schema: {', '.join(wrong) or ''}"
                         f"{' extra columns ' + ', '.join(extra) if extra else ''}")  # fmt: skip
    return table


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``rlsweep`` JSON metadata of one table."""
    try:
        return json.loads((pq.read_schema(path).metadata or {})[METADATA_KEY])
    except (OSError, pa.ArrowException, KeyError, ValueError) as err:
        raise TableError(f"{str(path)!r} has no readable rlsweep metadata: {' '.join(str(err).split())}") from err

"""A run's manifest: written last, it is what makes a run's tables complete (docs/sweeps.md, "Complete").

``manifest.json``, in the run dir, names the content hash of everything that produced the run (resolved
config, contract, weight and replay files, code) and each table's file (relative to the run dir: a sweep
job's tables live in the sweep's datasets, docs/tables.md) with its sha256. Tables without a manifest that
matches them, or whose manifest differs from the config beside it (``.hydra/config.yaml``), are incomplete.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

import kernels
from rlsweep import CONF_DIR
from rlsweep.environment import computing_environment, git_commit
from rlsweep.errors import ConfigError, ReplayInputError, TablesNotFoundError, UnreadablePathError
from rlsweep.listing import NOT_THERE, list_tree, readable_text, unreadable
from rlsweep.tables import RUN_TABLES, RunLocation, hidden, remove_tables, write_tables, writing
from rlsweep.tensor_files import check_regular_file, refuse_irregular

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "rlsweep-run-manifest/3"
HYDRA_CONFIG = Path(".hydra") / "config.yaml"  # the config Hydra saved beside a run's tables
SOURCE_SUFFIXES = (".py", ".yaml")
CHUNK = 1 << 20


def canonical_numbers(value: Any) -> Any:
    """0 and 0.0 hash alike, so writing a number either way is the same document."""
    if isinstance(value, Mapping):
        return {str(k): canonical_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical_numbers(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def canonical_sha256(value: Any) -> str:
    """sha256 of the canonical JSON of plain containers (sorted keys, ints as floats)."""
    text = json.dumps(canonical_numbers(value), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path, what: str, key: str | None = None) -> str:
    """sha256 of a regular file's bytes, streamed; ``what`` (and the config ``key`` that names it) name it in errors.

    Opened without waiting (a FIFO would block until a writer came), then what was opened must be a regular file:
    a device such as /dev/zero would be read for ever."""
    where = f"{what} {str(path)!r}" + (f" ({key})" if key else "")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        check_regular_file(path, where)  # says what it is where it is no file at all (a socket)
        raise ReplayInputError(f"{where} cannot be read: {err.strerror or err}") from err
    try:
        refuse_irregular(os.fstat(descriptor).st_mode, path, where)
    except ReplayInputError:
        os.close(descriptor)
        raise
    digest = hashlib.sha256()
    try:
        with open(descriptor, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    except OSError as err:
        raise ReplayInputError(f"{where} cannot be read: {err.strerror or err}") from err
    return digest.hexdigest()


def module_sources(name: str) -> list[Path]:
    """Where the sources of an importable module live: its top-level package's folders (so the helpers beside it
    count), or the module's own file when it is a module of its own."""
    top = name.split(".")[0]
    try:
        module = importlib.import_module(top)
    except Exception as err:
        raise ConfigError(f"backend_module={name!r}: {top!r} cannot be imported to hash its sources ({err})") from err
    sources = list(getattr(module, "__path__", None) or [getattr(module, "__file__", None)])
    if not all(sources):
        raise ConfigError(
            f"backend_module={name!r}: {top!r} has no source file or folder to hash, so a resumed sweep could not "
            "tell an edit of it; load the backend from a .py module or a package"
        )
    return [Path(source) for source in sources]


@functools.cache
def code_version(backend_module: str | None = None) -> dict[str, Any]:
    """The code that computes a run: git commit (with +dirty) and a hash of the sources of ``kernels``, ``rlsweep``
    and ``conf`` and, where the profile loads a backend of its own, of that module (``module_sources``).

    The sources hash decides resume; the commit is for people (a dirty tree alone cannot tell two edits apart).
    """
    roots = [("kernels", Path(kernels.__file__).parent), ("rlsweep", Path(__file__).parent), ("conf", CONF_DIR)]
    if backend_module:
        roots += [(f"backend_module={backend_module}", root) for root in module_sources(backend_module)]
    digest = hashlib.sha256()
    for package, root in roots:
        if root.is_file():  # a module of its own: the file, by its name
            files, base = [root], root.parent
        else:
            listing = list_tree(root)
            if listing.unreadable:  # a source folder passed over would hash as if its code were not there
                path, reason = next(iter(listing.unreadable.items()))
                raise UnreadablePathError(f"the sources of {package} cannot be hashed: {str(path)!r}: {reason}")
            files, base = sorted(p for p in listing.files() if p.suffix in SOURCE_SUFFIXES and p.is_file()), root
        for path in files:
            digest.update(f"{package}/{path.relative_to(base).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return {"git_commit": git_commit(), "sources_sha256": digest.hexdigest()}


# Each input file by input name: what it is and the config key that names it (as TensorFile describes it).
INPUT_FILES = {"weights": ("weight file", "model.weights.path"), "replay": ("replay file", "workload.path")}


def input_paths(config: Mapping[str, Any]) -> dict[str, str]:
    """The files a run reads besides its config, by input name: ``weights`` and ``replay``, as the config names them."""
    paths = {}
    weights = config["model"]["weights"]
    if weights.get("kind") == "file" and weights.get("path"):
        paths["weights"] = str(weights["path"])
    workload = config["workload"]
    if workload.get("source") == "replay" and workload.get("path"):
        paths["replay"] = str(workload["path"])
    return paths


def input_files(config: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of the files a run reads besides its config (``input_paths``), by input name."""
    return {name: file_sha256(path, *INPUT_FILES[name]) for name, path in input_paths(config).items()}


@dataclass(frozen=True)
class RunIdentity:
    """What produced a run: its resolved config's hash and the content hash that decides resume."""

    config_sha256: str
    content_sha256: str
    inputs: Mapping[str, str]
    code: Mapping[str, Any]
    saved_config_sha256: str | None = None  # of the config text Hydra saves beside the run (config_text_sha256)
    environment: Mapping[str, Any] | None = None  # where it computes (rlsweep.environment.computing_environment)

    @property
    def run_id(self) -> str:
        """Stable per config: a re-run of the same config has the same id."""
        return self.config_sha256[:16]


def identify(config: Mapping[str, Any], saved_config_sha256: str | None = None) -> RunIdentity:
    """The identity of a resolved run config (plain containers); reads and hashes its input files.

    The content hash covers everything that would produce the run now: the config, its input files, the code (a
    backend module the profile loads included) and the environment it computes in.
    ``saved_config_sha256``: the hash of the config file Hydra saves beside the run, where it saves one.
    """
    config_hash = canonical_sha256(config)
    inputs = input_files(config)
    code = code_version(config["profile"].get("backend_module"))
    computing = computing_environment(config["profile"]["device"])
    content = canonical_sha256(
        {"config": config_hash, "inputs": inputs, "code": code["sources_sha256"], "environment": computing}
    )
    return RunIdentity(config_hash, content, inputs, code, saved_config_sha256, computing)


def write_manifest(location: RunLocation, identity: RunIdentity, tables: Mapping[str, Path]) -> dict[str, Any]:
    """Hash the run's published table files and write the manifest after them, atomically."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_id": identity.run_id,
        "config_sha256": identity.config_sha256,
        "saved_config_sha256": identity.saved_config_sha256,
        "content_sha256": identity.content_sha256,
        "inputs": dict(identity.inputs),
        "code": dict(identity.code),
        "environment": identity.environment,
        "tables": {
            name: {"path": os.path.relpath(path, location.run_dir), "sha256": file_sha256(path, "table")}
            for name, path in tables.items()
        },
        "written": datetime.now(UTC).isoformat(),
    }
    write_tables(location.run_dir, {}, files={MANIFEST_FILE: json.dumps(manifest, indent=2, sort_keys=True) + "\n"})
    return manifest


def invalidate(location: RunLocation) -> None:
    """Before a run writes anything: its old manifest first (so nothing stale reads as complete), then its tables."""
    with writing(location.run_dir / MANIFEST_FILE, "removed"):
        (location.run_dir / MANIFEST_FILE).unlink(missing_ok=True)
    remove_tables(location)


def table_files(directory: Path, manifest: Mapping[str, Any]) -> dict[str, Path]:
    """The table files a manifest in ``directory`` names, by table (``..`` by name, as ``write_manifest`` wrote it)."""
    return {name: Path(os.path.normpath(directory / entry["path"])) for name, entry in manifest["tables"].items()}


@dataclass(frozen=True)
class RunState:
    """Whether ``directory`` holds a complete run; ``reason`` says why not."""

    directory: Path
    manifest: Mapping[str, Any] | None
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.manifest is not None and not self.reason

    @property
    def files(self) -> dict[str, Path]:
        """The table files of a complete run, by table (tokens, checks)."""
        if not self.complete:
            raise TablesNotFoundError(f"{str(self.directory)!r} is not a complete run: {self.reason}")
        return table_files(self.directory, self.manifest)


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str]:
    path = directory / MANIFEST_FILE
    try:
        text = readable_text(path)
    except NOT_THERE:
        return None, f"no {MANIFEST_FILE} (the run did not finish, or was invalidated by a rerun)"
    except UnreadablePathError as err:
        return None, str(err)
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{MANIFEST_FILE} cannot be read: {err}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{MANIFEST_FILE} is not an rlsweep run manifest ({MANIFEST_FORMAT})"
    if not isinstance(manifest.get("tables"), dict) or not isinstance(manifest.get("config_sha256"), str):
        return None, f"{MANIFEST_FILE} lacks its tables or config_sha256"
    inputs = manifest.get("inputs")
    if not isinstance(inputs, dict) or not all(isinstance(v, str) for v in inputs.values()):
        return None, f"{MANIFEST_FILE} lacks the sha256 of its input files (inputs)"
    for name, entry in manifest["tables"].items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("sha256"), str)
        ):
            return None, f"{MANIFEST_FILE}: table {name!r} lacks its path or sha256"
    return manifest, ""


# PyYAML's libyaml parser where PyYAML was built with it, else its Python one: the same Python objects either way
# (both hand the document to the same constructor and resolver), and a saved run config parses in 2 ms, not 18.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def plain_yaml(text: str) -> Any:
    """``text`` as plain YAML reads it (``yaml.safe_load``)."""
    return yaml.load(text, Loader=SAFE_LOADER)


def config_text_sha256(text: str) -> str:
    """sha256 of a YAML config's content as plain YAML reads it (unresolved: interpolations stay as written)."""
    return canonical_sha256(plain_yaml(text))


def saved_config_sha256(directory: Path) -> str | None:
    """The hash of the ``.hydra/config.yaml`` beside a run's tables; None where there is none."""
    path = directory / HYDRA_CONFIG
    if not path.is_file():
        return None
    return config_text_sha256(path.read_text())


def unnamed_entries(table: Path) -> list[Path]:
    """What a dataset reader would also load from the folder of a run's ``table``: every other visible entry; a folder
    that cannot be listed is an ``UnreadablePathError`` (what a reader would load with the table is unknown)."""
    try:
        with os.scandir(table.parent) as scan:
            names = [entry.name for entry in scan]
    except OSError as err:
        raise unreadable(table.parent, err) from err
    return sorted(table.parent / name for name in names if name != table.name and not hidden(name))


def verify_run(directory: Path) -> RunState:
    """A run is complete when its manifest names every table by its sha256, each table's folder holds nothing else
    a reader would load, and the manifest matches the config beside it."""
    manifest, reason = read_manifest(directory)
    if manifest is None:
        return RunState(directory, None, reason)
    files = table_files(directory, manifest)
    for name in RUN_TABLES:
        if name not in files:
            return RunState(directory, manifest, f"{MANIFEST_FILE} does not name its {name} table")
        path = files[name]
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise FileNotFoundError(path)
        except (FileNotFoundError, NotADirectoryError):
            return RunState(directory, manifest, f"its {name} table {str(path)!r} is missing")
        except OSError as err:
            return RunState(directory, manifest, f"its {name} table {unreadable(path, err)}")
        try:
            actual = file_sha256(path, "table")
            others = unnamed_entries(path)
        except (ReplayInputError, UnreadablePathError) as err:
            return RunState(directory, manifest, str(err))
        if actual != manifest["tables"][name]["sha256"]:
            return RunState(directory, manifest, f"{str(path)!r} is not the table its manifest names (sha256 differs)")
        if others:
            return RunState(
                directory,
                manifest,
                f"{', '.join(repr(str(other)) for other in others)} beside its {name} table: {MANIFEST_FILE} does "
                "not name it, yet a dataset reader would load it with the run's table",
            )
    try:
        beside = saved_config_sha256(directory)
    except Exception as err:
        return RunState(directory, manifest, f"{HYDRA_CONFIG} cannot be read: {' '.join(str(err).split())}")
    if beside is None and manifest.get("saved_config_sha256") is not None:
        gone = f"its manifest names the config saved beside it ({HYDRA_CONFIG}), which is gone"
        return RunState(directory, manifest, f"{gone}: the tables cannot be tied to the config that produced them")
    if beside is not None and beside != manifest.get("saved_config_sha256"):
        return RunState(directory, manifest, f"the tables are not from the config beside them ({HYDRA_CONFIG})")
    return RunState(directory, manifest)

"""One walk of a directory tree that names every directory it could not read, and reading a file that says why it
could not (docs/sweeps.md#complete).

``Path.rglob`` passes over a directory it cannot list (a ``PermissionError``) without a word, so the runs under it
were left out of a verdict unseen. Every reader of an output tree (the gate, ``rlsweep.check``, the report,
``rlsweep.analysis``) lists it here instead: links are listed, never followed, and a directory that cannot be listed
is a line naming it and why, which the gate reports as INCOMPLETE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlsweep.errors import UnreadablePathError


def os_reason(err: OSError) -> str:
    """An OS error's reason alone (``Permission denied``): the path is named by the message that says it."""
    return err.strerror or " ".join(str(err).split()) or type(err).__name__


def unreadable(path: Path, err: OSError) -> UnreadablePathError:
    """The error of a file or directory that exists but cannot be read, naming it and why."""
    return UnreadablePathError(f"{str(path)!r} cannot be read: {os_reason(err)}")


NOT_THERE = (FileNotFoundError, NotADirectoryError, IsADirectoryError)  # no such file: the caller's "missing"


def readable_text(path: Path) -> str:
    """A file's text; one that is there but cannot be read (its permissions) is an ``UnreadablePathError`` naming it,
    one that is not there raises as ``NOT_THERE`` says, for the caller to call missing."""
    try:
        return path.read_text()
    except NOT_THERE:
        raise
    except OSError as err:
        raise unreadable(path, err) from err


def present(path: Path) -> bool:
    """Whether something is at ``path`` (a link too); one that cannot be looked at counts: it may be there."""
    try:
        os.lstat(path)
    except NOT_THERE:
        return False
    except OSError:
        return True
    return True


@dataclass(frozen=True)
class Listing:
    """What lies under ``root``: every entry (``root`` excluded, in walk order), which are real directories, which
    are links, and each directory that could not be listed with its reason (what it holds is unknown)."""

    root: Path
    entries: tuple[Path, ...]
    directories: frozenset[Path]
    links: frozenset[Path]
    unreadable: dict[Path, str]

    def named(self, *names: str) -> list[Path]:
        """The entries called any of ``names``, whatever they are (a file, a directory, a link)."""
        return [path for path in self.entries if path.name in names]

    def files(self) -> list[Path]:
        """The entries that are not real directories: files, links and anything else a reader could open."""
        return [path for path in self.entries if path not in self.directories]

    def unreadable_lines(self) -> list[str]:
        """One line per directory that could not be listed: the gate's INCOMPLETE lines for them."""
        return [
            f"{path}: cannot be listed: {reason}; the runs and tables it may hold are not judged (make it readable "
            "and check again)"
            for path, reason in self.unreadable.items()
        ]


def list_tree(root: Path) -> Listing:
    """Walk ``root`` (itself followed where it is a link, nothing under it), depth first in name order."""
    entries: list[Path] = []
    directories, links = {root}, set()
    failed: dict[Path, str] = {}
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as scan:
                found = sorted(scan, key=lambda entry: entry.name)
        except OSError as err:
            failed[directory] = os_reason(err)
            continue
        below = []
        for entry in found:
            path = directory / entry.name
            entries.append(path)
            try:
                if entry.is_symlink():
                    links.add(path)
                elif entry.is_dir(follow_symlinks=False):
                    directories.add(path)
                    below.append(path)
            except OSError as err:
                failed[path] = os_reason(err)
        stack.extend(reversed(below))
    return Listing(root, tuple(entries), frozenset(directories), frozenset(links), failed)

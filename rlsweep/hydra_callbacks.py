"""Hydra callbacks: checks that must happen before Hydra itself touches the output directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


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


class OutputDirCheck(Callback):
    """A run or sweep dir that cannot be written ends with one paragraph and exit 1, not a traceback.

    Hydra swallows ordinary exceptions raised in callbacks, so this exits through SystemExit.
    """

    def check(self, directory: str, key: str) -> None:
        reason = unwritable_reason(Path(directory))
        if reason:
            print(
                f"rlsweep: error: output directory {directory!r} ({key}) cannot be written: {reason}", file=sys.stderr
            )
            sys.exit(1)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check(config.hydra.sweep.dir, "hydra.sweep.dir")

"""Errors raised while loading a checkpoint directory from local disk."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint directory cannot be used as-is; the message names the file and what is wrong.

    Loading never guesses or downloads: a missing, malformed or inconsistent file refuses the
    whole load so a half-loaded model never serves a request.
    """

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

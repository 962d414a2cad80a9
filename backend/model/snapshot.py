"""`--model` may name a Hugging Face cache entry as well as a plain checkpoint directory.

The hub cache (``~/.cache/huggingface/hub``) keeps a repository ``org/name`` as
``models--org--name/`` with ``refs/<branch>`` (a commit hash), ``snapshots/<hash>/`` (the files
as symlinks) and ``blobs/`` (their contents). Accepted:
- a snapshot directory ``.../models--org--name/snapshots/<hash>``: used as is;
- the repository directory ``.../models--org--name``: its ``refs/main`` snapshot, or its only
  snapshot when there is no ``refs/main``;
- any other directory: used as is.
The model's default served name is ``org/name`` for a cache entry (what clients send as
``model``), else the directory's name. A symlink into a missing blob (an interrupted download)
is refused by the loaders, naming the file.
"""

from __future__ import annotations

from pathlib import Path

from backend.model.errors import CheckpointError

_PREFIX = "models--"


def resolve_checkpoint_dir(path: Path | str) -> Path:
    directory = Path(path)
    if not directory.name.startswith(_PREFIX) or not (directory / "snapshots").is_dir():
        return directory
    ref = directory / "refs" / "main"
    if ref.is_file():
        snapshot = directory / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if not snapshot.is_dir():
            raise CheckpointError(
                ref, f"names snapshot {snapshot.name}, which is not in snapshots/"
            )
        return snapshot
    snapshots = sorted(p for p in (directory / "snapshots").iterdir() if p.is_dir())
    if len(snapshots) != 1:
        raise CheckpointError(
            directory / "snapshots",
            f"{len(snapshots)} snapshots and no refs/main: pass the snapshot directory itself",
        )
    return snapshots[0]


def default_served_name(path: Path | str) -> str:
    """``org/name`` for a hub cache entry (repository or snapshot directory), else the dir name."""
    directory = Path(path)
    for candidate in (directory, directory.parent.parent):
        if candidate.name.startswith(_PREFIX) and (candidate / "snapshots").is_dir():
            return candidate.name.removeprefix(_PREFIX).replace("--", "/", 1)
    return directory.name

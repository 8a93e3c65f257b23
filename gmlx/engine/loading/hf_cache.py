"""``hf:`` model references, resolved from the local Hugging Face cache only.

A config's ``models:`` entry may name ``hf:org/repo`` (the repo's snapshot folder: an
MLX model, or a folder holding one GGUF file) or ``hf:org/repo/path/in/repo`` (a GGUF
file, or a sub-folder, inside the repo). The reference resolves to the cached
snapshot of the repo's ``main`` ref, the layout ``hf download`` writes::

    $HF_HUB_CACHE/models--org--repo/refs/main            (the commit hash)
    $HF_HUB_CACHE/models--org--repo/snapshots/<hash>/...  (the files)

gmlx never downloads a model: every lookup here is ``local_files_only``, whatever
``HF_HUB_OFFLINE`` says, and a reference that is not cached is a ModelSourceError
that says where it looked and how to fetch it.
"""

from __future__ import annotations

import os
from pathlib import Path

from gmlx.engine.errors import ModelSourceError

PREFIX = "hf:"


def is_ref(ref: str | Path) -> bool:
    """Whether a model reference is an ``hf:`` one."""
    return isinstance(ref, str) and ref.startswith(PREFIX)


def cache_dir() -> Path:
    """The hub cache huggingface_hub reads: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    its default. Read from the environment at each call, because huggingface_hub reads it
    once, at import, and a server may be configured after that."""
    if explicit := os.environ.get("HF_HUB_CACHE"):
        return Path(explicit).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def split_ref(ref: str) -> tuple[str, str]:
    """``hf:org/repo[/path]`` as (``org/repo``, ``path`` or ``""``).

    Raises ModelSourceError for a reference that names no valid repo id.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    parts = ref.removeprefix(PREFIX).strip("/").split("/")
    if len(parts) < 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise ModelSourceError(
            f"{ref!r} is not a Hugging Face reference: write hf:org/repo or hf:org/repo/file.gguf."
        )
    repo_id, path = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ModelSourceError(f"{ref!r} does not name a Hugging Face repo: {e}") from e
    return repo_id, path


def resolve(ref: str) -> Path:
    """The local path of a cached ``hf:`` reference: the snapshot folder of the repo, or
    the file or folder it names inside that snapshot.

    Never touches the network. Raises ModelSourceError naming the reference, the cache
    searched and that gmlx never downloads, when the repo, the file or the folder is
    not cached (or the snapshot is known to be incomplete).
    """
    from huggingface_hub import snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, path = split_ref(ref)
    cache = cache_dir()
    if path:
        # A single file, as `hf download org/repo file.gguf` leaves it: the rest of the
        # repo need not be cached.
        found = try_to_load_from_cache(repo_id, path, cache_dir=cache)
        if isinstance(found, str):
            return Path(found)
    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                cache_dir=cache,
                local_files_only=True,
                allow_patterns=[f"{path}/*"] if path else None,  # judge only that folder
            )
        )
    except LocalEntryNotFoundError as e:  # IncompleteSnapshotError included
        raise _not_cached(ref, cache, repo_id, path) from e
    target = snapshot / path if path else snapshot
    if not target.exists():
        raise _not_cached(ref, cache, repo_id, path)
    return target


def _not_cached(ref: str, cache: Path, repo_id: str, path: str) -> ModelSourceError:
    what = f"{path} of {repo_id}" if path else repo_id
    fetch = f"hf download {repo_id}" + (f" {path}" if path else "")
    return ModelSourceError(
        f"Model {ref} is not in the local Hugging Face cache: {what} was not found in {cache}. "
        f"gmlx never downloads models; fetch it first (`{fetch}`), or set HF_HUB_CACHE "
        "or HF_HOME to the cache that holds it."
    )

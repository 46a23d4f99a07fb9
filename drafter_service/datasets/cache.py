"""Where benchmark inputs live and where their derived artefacts are cached on disk."""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import os
import pathlib
import tempfile
from collections.abc import Iterator
from importlib.resources.abc import Traversable

logger = logging.getLogger(__name__)

#: Environment variable that overrides the cache folder.
CACHE_ENV = "DRAFTER_CACHE_DIR"

#: The package whose ``data/`` folder holds the bundled data sets.
DATA_PACKAGE = "drafter_service.datasets"

#: Repository root (this file is ``<repo>/drafter_service/datasets/cache.py``).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def cache_dir() -> pathlib.Path:
    """The cache folder, created when missing.

    Returns:
        ``$DRAFTER_CACHE_DIR`` when set, otherwise ``<repo>/.cache/drafter`` (git-ignored).
    """
    env = os.environ.get(CACHE_ENV)
    path = pathlib.Path(env).expanduser() if env else REPO_ROOT / ".cache" / "drafter"
    if not path.is_dir():
        logger.debug("creating cache folder %s", path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def bundled_data(name: str) -> Traversable:
    """A data set shipped inside this package: the folder ``drafter_service/datasets/data/<name>``.

    Its files are package data, read through :mod:`importlib.resources` (open them with
    ``(folder / filename).open(encoding="utf-8")``), so they are found wherever the package is installed.

    Args:
        name: the data set's folder, e.g. ``"mtbench"``.

    Raises:
        FileNotFoundError: when the package ships no such folder.
    """
    folder = importlib.resources.files(DATA_PACKAGE) / "data" / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no bundled data set {name!r} in {DATA_PACKAGE}")
    return folder


@contextlib.contextmanager
def atomic_output(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield a temporary path next to ``path`` that replaces it only when the block succeeds.

    Readers never see a half-written cache file, and concurrent writers do not corrupt each other
    (the last one to finish wins).

    Args:
        path: the final file.

    Yields:
        The temporary file to write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp creates 0600 files
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

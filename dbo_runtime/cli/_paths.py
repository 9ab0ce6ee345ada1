"""Output paths of the real-engine commands (``verify --workdir``, ``tune --workdir`` / ``--png``), checked
before any engine starts and created only when one is about to.

Why checked early: a path that cannot be written would otherwise fail after the whole run, when the result
is already measured. Why created late: a run refused for another reason (a bad ``VLLM_DBO_COMM_SMS``, no
GPU) must leave nothing on disk. So the check creates nothing that outlives it: it looks for the nearest
existing folder on the way to the path and makes and removes one unnamed file there (root passes every
permission test, so only a real write says whether the file system takes one).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import tempfile
from pathlib import Path

from dbo_runtime.core.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(os.sep)


def _writable_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` (or the folders that would be made on the way to it) cannot hold a new file; None when it can.

    The reason is the operating system's, except where its words would mislead: a kernel file system such as
    ``/proc`` refuses a new file with ``ENOENT``, and "No such file or directory" about a folder that exists
    sends the operator looking for a typo."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder" if existing.is_file() else f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return f"{existing} is not writable: its file system takes no new files"
        return f"{existing} is not writable: {exc.strerror or exc}"
    return None


def check_dir(raw: str, parameter: str, command: str) -> Path:
    """``raw`` as a folder ``command`` can create (with its parents) and write; nothing is created. An empty path
    is refused: it is what an unset shell variable gives, and it would mean the current folder."""
    if not raw.strip():
        raise ConfigError(parameter, raw, f"a non-empty path of a folder {command} can create and write")
    path = Path(raw)
    problem = _writable_folder_problem(path)
    if problem is not None:
        raise ConfigError(parameter, raw, f"a folder {command} can create and write ({problem})")
    return path


def matplotlib_installed() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


FORMATS_WITHOUT_MATPLOTLIB = ("pdf", "png", "svg")
"""The formats accepted where matplotlib cannot be asked (not installed): ones every matplotlib writes."""


def plot_formats() -> tuple[str, ...]:
    """The file suffixes matplotlib can write (``FigureCanvasBase.get_supported_filetypes``), imported only when
    matplotlib is installed; else ``FORMATS_WITHOUT_MATPLOTLIB``."""
    if not matplotlib_installed():
        return FORMATS_WITHOUT_MATPLOTLIB
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except Exception:
        return FORMATS_WITHOUT_MATPLOTLIB
    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def check_png(raw: str, command: str) -> Path:
    """``raw`` as a file a curve can be drawn into: its folder creatable and writable, not a folder itself, a
    suffix matplotlib writes, and matplotlib importable. Nothing is created.

    Returns the path matplotlib will write: without a suffix it appends ``.png`` (its default format), so
    ``--png /tmp/x`` is drawn, and reported, as ``/tmp/x.png``. A suffix it has no writer for (``.txt``) is
    refused here, not after the sweep, where matplotlib would only then say so."""
    path = Path(raw)
    allowed = f"a file path whose folder {command} can create and write, with matplotlib installed"
    if not raw.strip():  # an unset shell variable; Path('') is the current folder
        raise ConfigError("--png", raw, f"a non-empty {allowed[2:]}")
    if path.is_dir():
        raise ConfigError("--png", raw, f"{allowed} ({path} is a folder)")
    suffix = path.suffix[1:].lower()
    formats = plot_formats()
    if not suffix:
        path = path.with_name(path.name + ".png")
    elif suffix not in formats:
        raise ConfigError("--png", raw, f"a file name ending in a format matplotlib writes: {', '.join('.' + f for f in formats)}")
    problem = _writable_folder_problem(path.parent)
    if problem is not None:
        raise ConfigError("--png", raw, f"{allowed} ({problem})")
    if not matplotlib_installed():
        raise ConfigError("--png", raw, f"{allowed} (matplotlib is not installed: pip install matplotlib, or leave --png out)")
    return path


def make_dir(path: Path, parameter: str, command: str) -> Path:
    """Create the checked folder, right before the first engine starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # changed since the check
        raise ConfigError(parameter, str(path), f"a folder {command} can create and write ({exc.strerror or exc})") from exc
    return path


__all__ = ["check_dir", "check_png", "make_dir"]

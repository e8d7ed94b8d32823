"""How emit writes its output directory: all or nothing, and never over what it must not touch.

The files are written into a temporary directory beside the output, named as emit's own with
its process id (``.OUT.transfuse-emit-PID-XXXXXXXX``), created with the umask's mode as
``save_pretrained``'s would be. At the end it takes the output's place in one step: swapped
with an existing output where the filesystem can exchange two names atomically (Linux's
``renameat2``), else by two renames, the old directory kept aside (``...XXXXXXXX.old``) until
the new one is in place. Without ``force`` the output is checked again at the move, which never
replaces a directory that appeared meanwhile (``RENAME_NOREPLACE`` where there is one).

A failure removes the temporary directories and puts a kept one back; a crash cannot, so the
next emit to the same output (``recover``) first restores a kept directory whose output is
missing, and removes the leftovers of emits whose process is gone. Either way the output is
the old directory or the new one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from typing import Callable

__all__ = ["TAG", "EmitError", "check_destination", "link_target", "recover", "write_directory"]

TAG = "transfuse-emit"
_KEPT = ".old"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
# The temporary directories of this process's emits in progress (not leftovers of a crash).
_ACTIVE: set[str] = set()


class EmitError(Exception):
    """Emission cannot proceed; the message is one line meant for the user."""


def _libc_renameat2():
    """The C library's ``renameat2`` (Linux, glibc 2.28 and later), or None."""
    if os.name != "posix":
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:  # the process's own symbols cannot be opened
        return None


_renameat2 = _libc_renameat2()


def _rename2(source: str, target: str, flags: int) -> bool:
    """``renameat2(source, target, flags)``: True if done, False where the system or filesystem
    cannot; an ``OSError`` for any other failure."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), target)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pattern(out_dir: str) -> re.Pattern:
    name = re.escape(os.path.basename(out_dir))
    return re.compile(rf"\.{name}\.{TAG}-(\d+)-[a-z0-9_]{{8}}({re.escape(_KEPT)})?")


def _process_gone(pid: int, path: str) -> bool:
    if pid == os.getpid():
        return path.removesuffix(_KEPT) not in _ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, and belongs to someone else
        return False
    return False


def _leftovers(out_dir: str) -> list[str]:
    """The temporary directories of emits to ``out_dir`` whose process is gone."""
    parent, pattern = os.path.dirname(out_dir), _pattern(out_dir)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found = []
    for name in sorted(names):
        match = pattern.fullmatch(name)
        if match and _process_gone(int(match.group(1)), os.path.join(parent, name)):
            found.append(os.path.join(parent, name))
    return found


def _settle(out_dir: str, paths: list[str]) -> list[str]:
    """Restore the newest kept directory among ``paths`` if ``out_dir`` is missing; remove the rest
    (what cannot be removed now is left to the next emit's ``recover``)."""
    notes = []
    kept = [p for p in paths if p.endswith(_KEPT) and os.path.isdir(p)]
    if kept and not os.path.lexists(out_dir):
        newest = max(kept, key=os.path.getmtime)
        os.rename(newest, out_dir)
        paths = [p for p in paths if p != newest]
        notes.append(f"restored {out_dir} from the copy an interrupted emit had kept aside ({newest}).")
    for path in paths:
        if not os.path.lexists(path):
            continue
        try:
            _remove(path)
        except OSError as exc:
            notes.append(f"could not remove {path} ({exc}); the next emit to {out_dir} tries again.")
        else:
            notes.append(f"removed {path}, left by an interrupted emit.")
    return notes


def recover(out_dir: str) -> list[str]:
    """Put right what interrupted emits to ``out_dir`` left (see the module docstring); notes
    saying what was done."""
    return _settle(os.path.abspath(out_dir), _leftovers(os.path.abspath(out_dir)))


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def check_destination(out_dir: str, *, force: bool, source: str | None = None, force_is: str = "force=True") -> list[str]:
    """Recover ``out_dir`` (notes returned), then refuse it where it is, holds or lies inside
    ``source`` (the checkpoint directory or file the model came from), or exists without ``force``
    (which the caller passes as ``force_is``)."""
    notes = recover(out_dir)
    out = os.path.realpath(out_dir)
    if source is not None:
        src = os.path.realpath(source)
        relation = "is" if out == src else "is inside" if _within(out, src) else "contains" if _within(src, out) else None
        if relation is not None:
            raise EmitError(
                f"The output {out_dir} {relation} the checkpoint {src}; emit never writes into or over "
                "its source: choose an output directory apart from it."
            )
    if os.path.lexists(out_dir) and not force:
        raise EmitError(f"{out_dir} already exists; pass {force_is} to replace it.")
    return notes


def link_target(path: str, out_dir: str) -> str:
    """Where a link to the checkpoint file ``path`` points (the file itself, links resolved);
    an ``EmitError`` where that lies inside ``out_dir``, which the emit replaces."""
    target = os.path.realpath(path)
    if _within(target, os.path.realpath(out_dir)):
        raise EmitError(
            f"--link would link {os.path.basename(path)} to {target}, inside {out_dir}, which this emit "
            "replaces; emit without --link to copy it."
        )
    return target


def write_directory(out_dir: str, fill: Callable[[str], None], *, force: bool) -> None:
    """Make ``out_dir`` hold what ``fill(directory)`` writes, all or nothing (module docstring)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.{TAG}-{os.getpid()}-", dir=parent)
    _ACTIVE.add(staging)
    try:
        os.chmod(staging, 0o777 & ~_umask())
        fill(staging)
        _move_into_place(staging, out_dir, force)
    finally:
        _ACTIVE.discard(staging)
        _settle(out_dir, [staging + _KEPT, staging])


def _move_into_place(staging: str, out_dir: str, force: bool) -> None:
    if os.path.lexists(out_dir):
        if not force:
            raise _appeared(out_dir)
        if not _rename2(staging, out_dir, _RENAME_EXCHANGE):
            os.rename(out_dir, staging + _KEPT)
            os.rename(staging, out_dir)
        return  # after an exchange the old directory is under the temporary name, which is removed
    try:
        moved = _rename2(staging, out_dir, _RENAME_NOREPLACE)
    except FileExistsError:
        raise _appeared(out_dir) from None
    if not moved:  # no atomic check here: a directory appearing in this instant, if empty, is replaced
        os.rename(staging, out_dir)


def _appeared(out_dir: str) -> EmitError:
    return EmitError(
        f"{out_dir} appeared while emitting and is left as it is; nothing was written there "
        "(force replaces it)."
    )

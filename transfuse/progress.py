"""How transfuse reports progress, in transformers' conventions, so it is silenced the same way.

* ``bar``: a progress bar (tqdm, through ``transformers.utils.logging.tqdm`` where transformers is
  installed) that appears only once its work has taken ``BAR_DELAY_S``: quick rewrites print
  nothing. It counts items and time spent, with no estimate of the time left, and is redrawn while
  a long item runs. ``transformers.logging.disable_progress_bar()`` or ``TRANSFUSE_PROGRESS=0``
  turn bars off.
* ``note``: a one-line message to the ``transfuse`` logger, shown when transformers' verbosity
  allows its level (by default warnings are shown and info is not, as for transformers' own
  messages): ``transformers.logging.set_verbosity_error()`` silences it, and
  ``TRANSFUSE_VERBOSITY`` (``error``, ``warning``, ``info``) overrides it.
* ``step``: a line saying what a long wait (compiling, capturing) is doing, so that none is silent:
  shown as a warning-level note (by default, then), or, where a caller set the ``transfuse``
  logger's level (the ``transfuse`` command: info, or warning with ``-q``), at info level.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Iterator, TypeVar

from . import settings

__all__ = ["BAR_DELAY_S", "TICK_S", "bar", "note", "step"]

logger = logging.getLogger("transfuse")
T = TypeVar("T")

# A bar appears only when its work has lasted this long.
BAR_DELAY_S = 2.0
_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


def _verbosity() -> int:
    chosen = settings.value("TRANSFUSE_VERBOSITY")
    if chosen is not None:
        return _LEVELS[chosen]
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return logging.WARNING
    return hf_logging.get_verbosity()


def note(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` if the verbosity (transformers', or ``TRANSFUSE_VERBOSITY``) allows ``level``."""
    if level >= _verbosity():
        logger.log(level, message)


def step(message: str) -> None:
    """Say what a long wait is doing (see the module docstring)."""
    if logger.level != logging.NOTSET:
        logger.info(message)
    else:
        note(message, logging.WARNING)


def bar(iterable: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterable[T]:
    """``iterable`` with a progress bar that shows only after ``BAR_DELAY_S``, if bars are enabled.

    The bar shows the items done and the time spent, and no estimate of the time left: the items
    of transfuse's loops differ in cost by orders of magnitude (the first check on a machine waits
    for Triton's compiler), so an estimate from the first items reads hours. Once shown it is
    redrawn every ``TICK_S`` while an item runs, so a long item is not a silent wait."""
    if not settings.value("TRANSFUSE_PROGRESS"):
        return iterable
    try:
        from transformers.utils import logging as hf_logging

        tqdm = hf_logging.tqdm
    except ImportError:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return iterable
    return _ticking(tqdm(iterable, total=total, desc=desc, delay=BAR_DELAY_S, leave=False, bar_format=_FORMAT))


# tqdm's default, less the rate and the estimate of the time left.
_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]"
# How often a shown bar is redrawn while an item runs.
TICK_S = 1.0


def _ticking(shown: Any) -> Iterator[T]:
    """Iterate ``shown`` (a tqdm bar) while a thread redraws it every ``TICK_S`` from ``BAR_DELAY_S`` on."""
    stop = threading.Event()

    def tick() -> None:
        if stop.wait(BAR_DELAY_S):
            return
        while not stop.is_set():
            shown.refresh()
            stop.wait(TICK_S)

    threading.Thread(target=tick, name="transfuse progress", daemon=True).start()
    try:
        yield from shown
    finally:
        stop.set()

"""The TRANSFUSE_* environment switches: each declared once here, every value read by one parser.

A switch is a flag (``1``/``0``, ``true``/``false``, ``on``/``off``, in any case), one of a few
words, a count of bytes, an op priority list or a directory; unset or empty means its default.
Any other value, and any TRANSFUSE_* variable that is no switch, is a ``SettingError`` naming the
variable and the values it takes. ``validate()`` reads them all: ``transfuse.rewrite``, the
drop-in loader and the CLI call it before any work, so a bad value never surfaces mid-run. Values
are read where they are used, parsed once per value (a dict lookup after that), so a changed
variable takes effect at the next read. This module imports nothing from transfuse, so every layer
can use it. ``docs/environment.md`` says what each switch does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["PREFIX", "SWITCHES", "SettingError", "Switch", "at_import", "validate", "value"]

PREFIX = "TRANSFUSE_"


class SettingError(ValueError):
    """A TRANSFUSE_* variable with a value it does not take, or one that is no switch."""


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "on"):
        return True
    if word in ("0", "false", "off"):
        return False
    raise ValueError(text)


def _word(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in words:
            raise ValueError(text)
        return word

    return parse


def _bytes(text: str) -> int:
    count = int(text.strip())  # a ValueError for anything but an integer
    if count < 0:
        raise ValueError(text)
    return count


def _priority(text: str) -> dict[str, tuple[str, ...]]:
    """``"rms_norm=triton,native;silu_and_mul=cuda"`` as {op: provider names}."""
    result = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        op, sep, names = part.partition("=")
        providers = tuple(n.strip() for n in names.split(",") if n.strip())
        if not sep or not op.strip() or not providers:
            raise ValueError(part)
        result[op.strip()] = providers
    return result


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise ValueError(text)
    return text


@dataclass(frozen=True)
class Switch:
    name: str
    parse: Callable[[str], Any]  # raises ValueError for a value the switch does not take
    default: Any
    takes: str  # the values it takes, as the error message says them
    default_is: str  # what unset means, as the error message says it


_FLAG = "1, 0, true, false, on or off (in any case)"

SWITCHES = {
    s.name: s
    for s in (
        Switch("TRANSFUSE_FORCE_NATIVE", _flag, False, _FLAG, "off"),
        Switch("TRANSFUSE_BATCH_INVARIANT", _flag, False, _FLAG, "off"),
        Switch(
            "TRANSFUSE_OP_PRIORITY",
            _priority,
            {},
            "entries 'op=provider,provider' separated by ';', e.g. 'rms_norm=triton,native;silu_and_mul=cuda'",
            "each platform's own order",
        ),
        Switch("TRANSFUSE_COMPILE_MODE", _word("native", "library"), None, "native or library", "each op's own"),
        Switch("TRANSFUSE_VERBOSITY", _word("error", "warning", "info", "debug"), None, "error, warning, info or debug", "transformers' verbosity"),
        Switch("TRANSFUSE_PROGRESS", _flag, True, _FLAG, "on"),
        Switch("TRANSFUSE_REFERENCE_BYTES", _bytes, 2 << 30, "a whole number of bytes, 0 or more", "2147483648"),
        Switch("TRANSFUSE_STEP_GRAPHS", _flag, True, _FLAG, "on"),
        Switch("TRANSFUSE_DECODE_GRAPHS", _flag, True, _FLAG, "on"),
        Switch("TRANSFUSE_TRITON_FAST_LAUNCH", _flag, True, _FLAG, "on"),
        Switch("TRANSFUSE_CACHE_DIR", str, None, "a directory (made if missing)", "$XDG_CACHE_HOME/transfuse/compile, else ~/.cache/transfuse/compile"),
        Switch("TRANSFUSE_CSRC", _directory, None, "an existing directory holding the CUDA sources", "the installed sources"),
    )
}

# (name, the variable's text) -> its value; empty text stands for unset.
_PARSED: dict[tuple[str, str], Any] = {}


def value(name: str) -> Any:
    """The value of switch ``name`` now: its default where unset or empty; a ``SettingError`` where
    the variable holds something the switch does not take."""
    key = (name, os.environ.get(name, ""))
    try:
        return _PARSED[key]
    except KeyError:
        pass
    switch, text = SWITCHES[name], key[1]
    if not text.strip():
        parsed = switch.default
    else:
        try:
            parsed = switch.parse(text)
        except ValueError:
            raise SettingError(
                f"{name}={text!r} is not a value it takes: it takes {switch.takes}; "
                f"unset it or set it to '' for the default ({switch.default_is})."
            ) from None
    _PARSED[key] = parsed
    return parsed


def at_import(name: str) -> Any:
    """``value(name)``, or the default where the variable is bad: for reads at import, which must
    not fail (``validate()`` reports the bad value before any work)."""
    try:
        return value(name)
    except SettingError:
        return SWITCHES[name].default


def validate() -> None:
    """Read every switch; a ``SettingError`` for the first bad value or unknown TRANSFUSE_* name."""
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in SWITCHES:
            raise SettingError(
                f"{name} is not a transfuse setting; the settings are {', '.join(SWITCHES)} "
                "(docs/environment.md says what each does)."
            )
    for name in SWITCHES:
        value(name)

"""One parser for every ``HEATLIKE_*`` environment variable.

Each reader takes the variable's name and the value to use when it is unset or blank, strips
surrounding spaces, and raises ``ValueError`` naming the variable, the value found and the values
accepted when the value is not valid (never a silent fallback). Every rank reads its own
environment; launchers give all ranks the same one, so a bad value raises on every rank.

* :func:`env_flag`: ``1/0``, ``true/false``, ``on/off``, ``yes/no``, in any case;
* :func:`env_float`, :func:`env_int`: finite numbers, optionally bounded;
* :func:`env_choice`: one of a fixed set of words (any case);
* :func:`env_int_list`: comma-separated integers;
* :func:`env_str`: any text (paths).

The variables and their meaning are listed in ``docs/communication.md`` ("Environment
variables").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

__all__ = ["env_flag", "env_float", "env_int", "env_choice", "env_int_list", "env_str",
           "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")


def _raw(name: str) -> str | None:
    """The stripped value of ``name``, or None when it is unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _invalid(name: str, value: str, expected: str) -> ValueError:
    return ValueError(f"environment variable {name}={value!r} is not valid: expected "
                      f"{expected}")


def env_str(name: str, default: str | None = None) -> str | None:
    """The value of ``name`` with surrounding spaces removed (``default`` if unset or blank)."""
    value = _raw(name)
    return default if value is None else value


def env_flag(name: str, default: bool | None = False) -> bool | None:
    """``True`` for 1/true/on/yes, ``False`` for 0/false/off/no (any case, surrounding spaces
    ignored), ``default`` when unset or blank; ``ValueError`` for anything else."""
    value = _raw(name)
    if value is None:
        return default
    word = value.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise _invalid(name, value, "one of " + ", ".join(f"{t}/{f}" for t, f in
                                                    zip(TRUE_WORDS, FALSE_WORDS)) +
                   " (any case)")


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" between {minimum:g} and {maximum:g}"
    if minimum is not None:
        return f" >= {minimum:g}"
    if maximum is not None:
        return f" <= {maximum:g}"
    return ""


def env_float(name: str, default: float | None = None, *, minimum: float | None = None,
              maximum: float | None = None, meaning: str = "") -> float | None:
    """A finite number (``nan`` and ``inf`` are refused) within ``[minimum, maximum]``;
    ``default`` when unset or blank. ``meaning`` is added to the error message (the unit, what
    0 means)."""
    value = _raw(name)
    if value is None:
        return default
    expected = f"a finite number{_bounds(minimum, maximum)}" + (f" ({meaning})" if meaning
                                                                 else "")
    try:
        number = float(value)
    except ValueError:
        raise _invalid(name, value, expected) from None
    if not math.isfinite(number) or (minimum is not None and number < minimum) or \
            (maximum is not None and number > maximum):
        raise _invalid(name, value, expected)
    return number


def env_int(name: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None, meaning: str = "") -> int | None:
    """An integer (``"4"``, not ``"4.0"``) within ``[minimum, maximum]``; ``default`` when unset
    or blank."""
    value = _raw(name)
    if value is None:
        return default
    expected = f"an integer{_bounds(minimum, maximum)}" + (f" ({meaning})" if meaning else "")
    try:
        number = int(value)
    except ValueError:
        raise _invalid(name, value, expected) from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise _invalid(name, value, expected)
    return number


def env_choice(name: str, default: str | None, choices: Iterable[str]) -> str | None:
    """One of ``choices`` (compared in lower case; the choice is returned as listed);
    ``default`` when unset or blank."""
    value = _raw(name)
    if value is None:
        return default
    choices = list(choices)
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    raise _invalid(name, value, "one of " + ", ".join(choices) + " (any case)")


def env_int_list(name: str, default: list[int] | None = None, *,
                 minimum: int | None = None) -> list[int] | None:
    """Comma-separated integers (spaces allowed around them), each ``>= minimum``; ``default``
    when unset or blank."""
    value = _raw(name)
    if value is None:
        return default
    expected = f"comma-separated integers{_bounds(minimum, None)}"
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        raise _invalid(name, value, expected) from None
    if minimum is not None and any(n < minimum for n in numbers):
        raise _invalid(name, value, expected)
    return numbers

"""The one validation vocabulary of the package: every setting, size and saved field is checked
here, and a bad value is one ``ValueError`` whose message starts with the field's name and says
what was expected and what came.

Host-side only: no tensor is read, so no check synchronises a device.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "check_api_key",
    "check_band",
    "check_cap",
    "check_fields",
    "check_floor",
    "check_int",
    "check_lower_clip",
    "check_max_k3",
    "check_rank",
    "check_setting",
    "check_soft_threshold",
]


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Checks a count or a size.

    Args:
        name: The field's name, first in the error message.
        value: The value to check.
        minimum: The smallest value allowed.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not an ``int`` (a bool is not one) or is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_rank(name: str, rank: object, size_name: str, size: int) -> int:
    """Checks a rank against the size of its group.

    Args:
        name: The rank's field name, first in the error message.
        rank: The value to check.
        size_name: The name of the group size's field, also named in the message.
        size: The group size.

    Returns:
        ``rank``, unchanged.

    Raises:
        ValueError: ``rank`` is not an ``int`` in ``[0, size)``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name} must be an int in [0, {size}) for {size_name}={size}, got {rank!r}")
    return rank


def check_setting(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    integer: bool = False,
    above: bool = False,
    optional: bool = False,
) -> None:
    """Checks a numeric setting: finite, of the right kind, within its bounds.

    ``inf`` and ``nan`` are refused even without bounds: an infinite timeout would wait for a hung
    engine forever, and ``nan`` passes no comparison.

    Args:
        name: The setting's name, first in the error message.
        value: The value to check.
        low: The lower bound (inclusive unless ``above``); None for none.
        high: The upper bound, inclusive; None for none.
        integer: Require an ``int`` rather than any real number.
        above: Make ``low`` exclusive.
        optional: Let ``None`` pass.

    Raises:
        ValueError: ``value`` is a bool, not a number (an ``int`` when ``integer``), not finite, or
            out of its bounds.
    """
    if value is None and optional:
        return
    number_type = int if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, number_type) and math.isfinite(value)
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if above else '>='} {low:g}")
        if ok:
            ok = value > low if above else value >= low
    if high is not None:
        bounds.append(f"<= {high:g}" if isinstance(high, float) else f"<= {high}")
        if ok:
            ok = value <= high
    if not ok:
        kind = ("None or " if optional else "") + ("an integer" if integer else "a number")
        expected = " ".join([kind, " and ".join(bounds)]).strip()
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_fields(state: Any, rules: dict[str, tuple[type, int | None]], where: str = "") -> dict[str, Any]:
    """Checks a saved dict (a checkpoint's state) field by field.

    Args:
        state: The value to check.
        rules: ``{field: (type, minimum)}``: a minimum makes the field an ``int`` checked by
            `check_int`; None checks the exact type only (``int`` or ``bool``).
        where: The dict's own name, prefixed to each field's name in the message.

    Returns:
        ``state``, unchanged.

    Raises:
        ValueError: ``state`` is not a dict with exactly the keys of ``rules``, or a field has the
            wrong type or is below its minimum.
    """
    if not isinstance(state, dict) or set(state) != set(rules):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{where} must be a dict with the keys {sorted(rules)}, got {got}")
    for name, (kind, low) in rules.items():
        label = f"{where}.{name}" if where else name
        value = state[name]
        if low is not None:
            check_int(label, value, low)
        elif type(value) is not kind:
            raise ValueError(f"{label} must be {'an int' if kind is int else 'a bool'}, got {value!r}")
    return state


def check_api_key(api_key: Any, name: str = "api_key") -> None:
    """Refuses an API key that would authenticate anyone or could never be sent as given.

    Args:
        api_key: None (no authentication) or the bearer token.
        name: How the error names the setting (``--api-key`` on the command line).

    Raises:
        TypeError: ``api_key`` is neither None nor a string.
        ValueError: ``api_key`` is empty or blank (``Authorization: Bearer `` would match it), or
            holds whitespace or control characters (HTTP strips or refuses them in a header).
    """
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise TypeError(f"{name} must be None or a string, got {type(api_key).__name__}")
    if not api_key.strip():
        raise ValueError(
            f"{name} must be a non-empty token, got {api_key!r} (an unset variable?): an empty key "
            "would let anyone in; leave it out (None) to serve without authentication on loopback"
        )
    if any(ch.isspace() or not ch.isprintable() for ch in api_key):
        raise ValueError(
            f"{name} must hold no whitespace or control characters, got {len(api_key)} characters"
        )


def check_soft_threshold(threshold: float | None) -> float | None:
    """Checks soft replay's threshold.

    Args:
        threshold: None (plain replay) or a number >= 0, a router probability (above every
            probability, e.g. above 1, nothing is kept: native routing).

    Returns:
        ``threshold`` as a float, or None.

    Raises:
        ValueError: Anything else (a bool, a negative number, NaN).
    """
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(
            f"soft_threshold must be null or a number >= 0 (a router probability), got {threshold!r}"
        )
    return float(threshold)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def check_cap(value: float, name: str = "threshold") -> None:
    """Checks a TIS cap ``C``: a finite number >= 1 (below 1 every on-policy token would be truncated).

    Args:
        value: The cap.
        name: The setting's name in the message (``threshold``, or ``cap`` for a step).

    Raises:
        ValueError: ``value`` is not a number, is below 1 or is infinite.
    """
    if not 1 <= _number(name, value) < math.inf:
        raise ValueError(
            f"{name} must be a number >= 1 and finite (the TIS cap C; below 1 every on-policy token is truncated), "
            f"got {value!r}"
        )


def check_band(lower: float, upper: float) -> None:
    """Checks a kept ratio band: ``0 <= lower <= 1 <= upper`` and ``lower < upper`` (not empty, holds 1).

    Args:
        lower: The band's lower edge.
        upper: The band's upper edge.

    Raises:
        ValueError: Either is not a number, or the band is empty or does not hold 1.
    """
    if not (0 <= _number("lower", lower) <= 1 <= _number("upper", upper) and lower < upper):
        raise ValueError(
            f"lower and upper must satisfy 0 <= lower <= 1 <= upper and lower < upper (a non-empty band "
            f"holding ratio 1), got {lower=}, {upper=}"
        )


def check_lower_clip(lower_clip: float | None) -> None:
    """Checks a TIS lower clip.

    Args:
        lower_clip: None (no clip) or a number in ``(0, 1]``.

    Raises:
        ValueError: Anything else.
    """
    if lower_clip is not None and not 0 < _number("lower_clip", lower_clip) <= 1:
        raise ValueError(f"lower_clip must be null or a number in (0, 1], got {lower_clip!r}")


def check_floor(floor: float) -> None:
    """Checks a veto floor.

    Args:
        floor: The smallest token ratio a sequence may hold: a number in ``(0, 1)``.

    Raises:
        ValueError: Anything else.
    """
    if not 0 < _number("floor", floor) < 1:
        raise ValueError(f"floor must be a number in (0, 1) (the smallest token ratio kept), got {floor!r}")


def check_max_k3(max_k3: float) -> None:
    """Checks a K3 rejection threshold.

    Args:
        max_k3: The largest mean k3 a sequence may have: a finite number > 0.

    Raises:
        ValueError: Anything else.
    """
    if not 0 < _number("max_k3", max_k3) < math.inf:
        raise ValueError(f"max_k3 must be a finite number > 0 (the largest mean k3 kept), got {max_k3!r}")

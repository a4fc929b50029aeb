"""The checks of a user's argument (a size, a count, a switch), for every part of the layer,
and the closest name to a misspelt one, for the errors that refuse it."""

import difflib
from collections.abc import Iterable


def closest_name(name: str, names: Iterable[str]) -> str | None:
    """The name of ``names`` closest to ``name``, or ``None``: what an error refusing an
    unknown option suggests. A ratio of at least 0.75 (difflib's): a typo (``seedd``,
    ``lrr``: 0.8 and more), not another name that shares letters (``top_k_heads`` and
    ``num_kv_heads``: 0.70)."""
    found = difflib.get_close_matches(str(name), [str(n) for n in names], n=1, cutoff=0.75)
    return found[0] if found else None


def check_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is an integer (not a bool) of at least 1.

    Raises:
        TypeError: not an integer. ValueError: below 1.
    """
    check_int_in(name, value, 1)


def check_int_in(
    name: str, value: object, minimum: int, maximum: int | None = None, *, why: str = ""
) -> None:
    """Raise unless ``value`` is an integer (not a bool) in ``[minimum, maximum]``
    (``maximum=None``: no upper bound), e.g. ``minimum=0`` for a count that may be zero.

    Raises:
        TypeError: not an integer. ValueError: out of range; ``why`` follows the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if maximum is not None and not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}]{why}, got {name}={value}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: object) -> None:
    """Raise unless ``value`` is ``True`` or ``False``: a config's ``"no"``, ``"false"`` or
    ``0`` would otherwise be taken by its truth value, ``"no"`` as True.

    Raises:
        ValueError: not a bool (a user's config value, so one line, not a traceback).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")

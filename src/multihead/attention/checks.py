"""The checks of an integer argument (a size, a count), for every part of the layer."""


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

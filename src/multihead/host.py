"""Where a run or a measurement ran: the host's name and its CPU (standard library only).

Speeds mean something only next to the machine they were measured on, and runs that shared
a host at the same time slowed each other: ``summary.json`` records both, and
``scripts/compare.py`` reads them.
"""

from __future__ import annotations

import platform
import socket
from datetime import datetime, timezone
from pathlib import Path


def cpu_info() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (``model name``, ``vendor_id``,
    ``flags``, ...); empty where there is no such file."""
    info: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_model() -> str:
    """The CPU's model line, e.g. ``AMD EPYC 7B13``; ``platform.processor()`` without
    ``/proc/cpuinfo``, ``unknown CPU`` without either."""
    return cpu_info().get("model name") or platform.processor() or "unknown CPU"


def host_name() -> str:
    return socket.gethostname()


def boot_id() -> str | None:
    """The running kernel's boot id (``/proc/sys/kernel/random/boot_id``); ``None`` where
    there is none.

    What tells apart machines whose runs could slow each other: containers on one kernel
    share its cores and its boot id, while clones of one machine image (which often share
    ``/etc/machine-id`` and a host name such as ``vm``) boot kernels of their own, each
    with a fresh random id.
    """
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.is_file() else None


def utc_now() -> str:
    """The time now in ISO 8601, UTC, to the second: ``2026-11-26T12:00:00+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

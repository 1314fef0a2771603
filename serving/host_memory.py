"""The host's memory as the pinned pools see it: one reader of ``/proc/meminfo`` and the cgroup v2
limit, for the preflight, the plan's advice and the exact-size pool (patch host-pool)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class HostMemory:
    total: int  # MemTotal
    available: int  # MemAvailable (MemFree on kernels without it)
    cgroup_limit: int | None  # memory.max; None: no limit
    cgroup_usage: int  # memory.current (0 where unknown)

    @property
    def allowance(self) -> int:
        """What a process here can still take: MemAvailable, lowered to the cgroup's remaining
        allowance when a limit applies."""
        if self.cgroup_limit is None:
            return self.available
        return min(self.available, self.cgroup_limit - self.cgroup_usage)


def read_host_memory(meminfo: Path = MEMINFO, memory_max: Path = CGROUP_MEMORY_MAX) -> HostMemory:
    """Read ``meminfo`` and the cgroup files beside ``memory_max`` (``memory.current``)."""
    fields: dict[str, int] = {}
    for line in Path(meminfo).read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.split():
            fields[key] = int(rest.split()[0]) * 1024
    limit = None
    if memory_max.exists():
        text = memory_max.read_text().strip()
        limit = None if text == "max" else int(text)
    current = memory_max.with_name("memory.current")
    usage = int(current.read_text().strip()) if limit is not None and current.exists() else 0
    return HostMemory(fields.get("MemTotal", 0), fields.get("MemAvailable", fields.get("MemFree", 0)), limit, usage)

"""What a benchmark ran on: the CPU's name, and how much CPU the hypervisor took away meanwhile.

On a shared virtual machine the same code ran 3-4x slower on some days than on others (see
docs/serving_benchmark.md); the steal share and the load average next to a figure say which kind of
day it was.
"""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The first ``model name`` in /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs since boot, from the first line of /proc/stat (Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already in user.
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


class StealMeter:
    """Share of CPU time stolen by the hypervisor between construction and ``percent()``."""

    def __init__(self) -> None:
        self.start = _cpu_ticks()

    def percent(self) -> float | None:
        end = _cpu_ticks()
        if self.start is None or end is None or end[1] <= self.start[1]:
            return None
        return 100.0 * (end[0] - self.start[0]) / (end[1] - self.start[1])


def describe(steal: StealMeter) -> str:
    """One phrase for a report's header: CPU, CPU count, load average, steal share."""
    pct = steal.percent()
    stolen = "n/a" if pct is None else f"{pct:.1f} %"
    return (f"{cpu_name()} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end of the run, "
            f"CPU time stolen by the hypervisor during the run: {stolen})")

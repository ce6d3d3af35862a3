"""The processes of one data-parallel offline run meeting at the same moments (`bench offline
--barrier DIR:N`, which `bench stack --workers N` starts N of, each on its own cores).

Each process warms up at its own pace; the timed rounds of all of them must start together, or the
first to start would run part of its round with the machine to itself. So every process marks its
arrival with a file named by its pid in DIR and waits until N have arrived: before the timed rounds
("start"), and after them ("end"), before anything else runs (the machine probes would take memory
bandwidth from a process still timing its round).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.002  # how often a waiting process looks: the parties start within this of each other
TIMEOUT_S = 900.0  # a party that never comes (it failed): give up rather than wait forever


@dataclass(frozen=True)
class Barrier:
    directory: str
    parties: int

    @classmethod
    def parse(cls, text: str) -> "Barrier":
        """DIR:N -> Barrier; ValueError on anything else."""
        directory, _, parties = text.rpartition(":")
        if not directory or not parties.isdigit() or int(parties) < 1:
            raise ValueError(f"expected DIR:N with N >= 1, got {text!r}")
        return cls(directory, int(parties))

    def meet(self, name: str, timeout_s: float = TIMEOUT_S) -> list[int]:
        """Arrive at `name` and wait for the other parties -> the pids of all of them."""
        Path(self.directory, f"{name}.{os.getpid()}").touch()
        deadline = time.monotonic() + timeout_s
        while len(pids := self.arrived(name)) < self.parties:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pids)} of {self.parties} processes reached {name!r} in {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return pids

    def arrived(self, name: str) -> list[int]:
        return sorted(int(p.name.rpartition(".")[2]) for p in Path(self.directory).glob(f"{name}.*"))

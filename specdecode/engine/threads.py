"""CPU threads per step, chosen from the steps' own speed: a busy machine needs fewer.

Owns: how many threads the engine's passes use on a CPU when the user did not fix it
(``threads`` of the engine, ``--threads`` of the CLI). It starts at the cores the process
may use. OpenMP threads wait for each other at every layer: when another process takes one
of the cores, each layer waits for the thread that lost its core, and all threads together
run slower than fewer would (on 2 cores with one busy process, 2 threads ran at about a
third of their quiet speed, 1 thread at about two thirds). No setting of the wait policy
is right both ways, so the tuner measures instead.

Decode rounds are measured in windows of WINDOW rounds: seconds per round (prefill chunks
left out: a long prompt's chunk is no sign of contention). A window
markedly slower than the best one recently seen at the current count (SLOW) tries one
thread fewer for a window at once; otherwise a count one away is tried after a number of
windows that doubles each time a trial loses (up to MAX_INTERVAL windows), so a quiet
machine pays a trial rarely and a machine that became quiet again gets its threads back.
A trial wins if it is faster by MARGIN. The thread count changes no output: the kernels
compute every dot product on one thread, whatever the count (model/kernels).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

WINDOW = 16  # steps a measurement covers
SLOW = 1.4  # a window this much slower than the best recent one at its count: contention
MARGIN = 0.05  # a trial must be this much faster to be kept
START_INTERVAL = 8  # windows before the first scheduled trial: a short generation pays none
FIRST_INTERVAL = 4  # windows from a change of count to the first trial back
MAX_INTERVAL = 64  # windows between trials, at most


class ThreadTuner:
    """Chooses the thread count step by step: `apply` at the start of a step, `begin` and `end`
    around its decode round. ``clock`` and the thread setters are injectable (tests count steps)."""

    def __init__(
        self,
        max_threads: int,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        get_threads: Callable[[], int] = torch.get_num_threads,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.clock, self.set_threads, self.get_threads = clock, set_threads, get_threads
        self.current = self.max_threads  # the count in use outside trials
        self.trial: int | None = None  # the count a trial window is measuring
        self.best = math.inf  # the fastest recent window at the current count (seconds per round)
        self.last = float("inf")  # the latest window at the current count
        self.interval, self.since = START_INTERVAL, 0  # windows between trials, and since the last one
        self.down = True  # the direction of the next scheduled trial
        self._steps, self._seconds = 0, 0.0
        self._start = 0.0

    @property
    def threads(self) -> int:
        return self.trial if self.trial is not None else self.current

    def apply(self) -> None:
        """Set the step's count (torch's setting is process-wide: another engine may have moved it)."""
        if self.get_threads() != self.threads:
            self.set_threads(self.threads)

    def begin(self) -> None:
        self._start = self.clock()

    def end(self) -> None:
        self._seconds += self.clock() - self._start
        self._steps += 1
        if self._steps < WINDOW:
            return
        rate = self._seconds / self._steps
        self._steps, self._seconds = 0, 0.0
        if self.trial is not None:
            self._settle(self.trial, rate)
        else:
            self._measured(rate)

    def _measured(self, rate: float) -> None:
        """A window at the current count: note it, and start a trial when one is due."""
        slow = rate > SLOW * self.best
        self.best, self.last = min(self.best, rate), rate
        self.since += 1
        if slow and self.current > 1:  # contention: fewer threads may now be faster
            self.trial = self.current - 1
        elif self.since >= self.interval:
            step = -1 if self.down else 1
            if not 1 <= self.current + step <= self.max_threads:
                step = -step
            if 1 <= self.current + step <= self.max_threads:
                self.trial = self.current + step
            self.down = not self.down
        if self.trial is not None:
            self.since = 0

    def _settle(self, count: int, rate: float) -> None:
        """A trial window at ``count`` ends: keep it if it beat the window before it."""
        self.trial = None
        if rate < (1 - MARGIN) * self.last:  # the way back is tried soon: the change may be brief
            self.current, self.interval = count, FIRST_INTERVAL
            self.best = self.last = rate  # the machine changed: the older best no longer holds
        else:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
            self.best = self.last  # the slower level is the new normal, until it lifts

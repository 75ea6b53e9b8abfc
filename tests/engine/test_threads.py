"""The thread tuner, on a simulated machine (a clock that advances by the step's cost), and
the claim it rests on: the thread count changes no output."""

from __future__ import annotations

import torch

from specdecode.engine.threads import MAX_INTERVAL, WINDOW, ThreadTuner

# seconds per step by thread count: quiet, and with another process busy on one of 2 cores
# (its threads wait for the one that lost its core: 2 threads fall far below 1)
QUIET = {1: 1.45, 2: 1.0}
BUSY = {1: 1.6, 2: 3.5}


class Machine:
    def __init__(self) -> None:
        self.now, self.threads, self.busy, self.sets = 0.0, 2, False, 0

    def clock(self) -> float:
        return self.now

    def set_threads(self, n: int) -> None:
        self.threads, self.sets = n, self.sets + 1

    def get_threads(self) -> int:
        return self.threads

    def run(self, tuner: ThreadTuner, steps: int) -> list[int]:
        """The thread count of each step."""
        counts = []
        for _ in range(steps):
            tuner.apply()
            tuner.begin()
            self.now += (BUSY if self.busy else QUIET)[self.threads]
            counts.append(self.threads)
            tuner.end()
        return counts


def tuner_on(machine: Machine, max_threads: int = 2) -> ThreadTuner:
    return ThreadTuner(max_threads, clock=machine.clock, set_threads=machine.set_threads, get_threads=machine.get_threads)


def test_a_quiet_machine_keeps_its_threads_and_tries_fewer_rarely():
    m = Machine()
    counts = m.run(tuner_on(m), 20_000)
    assert counts[0] == 2 and counts[-1] == 2
    late = counts[5_000:]  # once the trials have backed off
    assert late.count(1) / len(late) < 1.5 / MAX_INTERVAL


def test_a_busy_core_moves_to_fewer_threads_at_once_and_back_when_it_is_free():
    m = Machine()
    m.run(tuner := tuner_on(m), 3_000)
    m.busy = True
    counts = m.run(tuner, 3_000)
    assert counts[2 * WINDOW : 3 * WINDOW] == [1] * WINDOW  # the first slow window starts a trial, which wins
    assert counts.count(1) / len(counts) > 0.95  # trials of 2 threads back off
    m.busy = False
    counts = m.run(tuner, 3 * MAX_INTERVAL * WINDOW)
    back = counts.index(2)
    assert back <= (MAX_INTERVAL + 2) * WINDOW  # the next trial of 2 threads wins, and is kept
    assert tuner.current == 2 and counts[back:].count(2) / len(counts[back:]) > 0.9


def test_one_core_never_changes_and_another_engines_setting_is_undone():
    m = Machine()
    m.threads = 1
    assert set(m.run(tuner_on(m, max_threads=1), 500)) == {1}
    m = Machine()
    tuner = tuner_on(m)
    m.run(tuner, 10)
    m.threads = 1  # another engine in the process set its own count
    assert m.run(tuner, 1) == [2]


class Alternating:
    """A tuner stand-in that switches between 1 and 2 threads every step."""

    def __init__(self) -> None:
        self.steps = 0

    def apply(self) -> None:
        torch.set_num_threads(1 + self.steps % 2)

    def begin(self) -> None:
        pass

    def end(self) -> None:
        self.steps += 1


def test_switching_threads_every_step_changes_no_output(tmp_path):
    """Our kernels compute each dot product on one thread whatever the count, so greedy tokens
    and their logprobs are the same bit for bit, drafts and all."""
    from specdecode import LLM, SamplingParams
    from tests.tiny import make_tiny_checkpoint

    path = str(make_tiny_checkpoint(tmp_path / "t", "llama", seed=0))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = [[1, 5, 9, 5, 9, 5, 9, 2], [3, 4, 3, 4, 7, 8, 3, 4], [6, 2, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        fixed = LLM(model=path, dtype="float32", device="cpu", speculative_config=spec, threads=2)
        assert fixed.engine.threads is None
        switching = LLM(model=path, dtype="float32", device="cpu", speculative_config=spec)
        switching.engine.threads = Alternating()
        want, got = fixed.generate(prompts, params), switching.generate(prompts, params)
    finally:
        torch.set_num_threads(before)
    assert switching.engine.threads.steps >= 10  # both counts ran, in turn
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]

"""The calibration's forward costs keep what it measured, a longer pass that costs less included.

A compiled target on a CPU ran a 3-token pass slower than a 4-token one; a
non-decreasing clamp had planned every 4-token verify at the 3-token cost. Here a stand-in LM
sleeps a set time per token count (far apart, so a loaded machine cannot reorder them).
"""

from __future__ import annotations

import time

import torch

from pcgtts.runtime.decode.calibrate import _forward_costs

SLEEP = {1: 0.001, 2: 0.002, 3: 0.012, 4: 0.004}  # seconds a forward of k tokens takes


class _Vocab:
    def restricted_to_token_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return codes + 10


class SleepyLM:
    max_length, device, vocab = 512, torch.device("cpu"), _Vocab()

    def __init__(self):
        self.length, self.forwards = 0, []

    def rollback(self, length: int) -> None:
        self.length = length

    def prefill(self, ids: torch.Tensor) -> None:
        self.length += len(ids)

    def forward(self, ids: torch.Tensor) -> None:
        self.forwards.append((self.length, len(ids)))
        time.sleep(SLEEP[len(ids)])
        self.length += len(ids)


def test_forward_costs_keep_a_cheaper_longer_pass():
    lm = SleepyLM()
    costs = _forward_costs(lm, range(1, 5), repeats=2, sync=None)
    assert costs[2] > costs[3] > costs[1] > costs[0]  # 3 tokens dearer than 4, as measured
    assert costs[3] < 0.5 * SLEEP[3] and costs[2] >= SLEEP[3]
    assert all(start == min(320, lm.max_length - 4) for start, _ in lm.forwards)  # after the cached context
    assert lm.length == 0  # the cache is left empty for the loop's prefill

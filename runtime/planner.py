"""Planning the adaptive draft length of a loaded model set: step costs, starting acceptance, warm caches.

`DraftLengthPlanner.plan` measures, once per decode configuration while the models live, the step
costs an adaptive draft length plans with and the acceptance every utterance starts from (a seeded
decode of `CALIBRATION_TEXT`), so that no utterance's time to first audio pays for them;
`warm_prefix` prefills the chat template's head that every utterance shares. A `Synthesizer` holds
one and plans at load and before each stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import DecodeConfig
from pcgtts.runtime.decode.calibrate import adopt_costs, keep_costs
from pcgtts.runtime.decode.cost_model import StepCosts, in_loop_costs, plans_draft_length
from pcgtts.runtime.decode.planning import measure_acceptance, prepare
from pcgtts.runtime.decode.policy import policy as policy_spec
from pcgtts.runtime.lm.protocol import LM, template_head
from pcgtts.runtime.text.prompt import build_prompt

log = logging.getLogger(__name__)

# The sentence an adaptive draft length's starting acceptance is measured on (in the model's own
# voice, `DraftLengthPlanner.starting_acceptance`), and the most tokens that measurement decodes.
CALIBRATION_TEXT = "The birch canoe slid on the smooth planks, and the wind rose over the grey water."
CALIBRATION_TOKENS = 100  # ~30-50 steps at L = 3; ~0.7 s of the built-in voice's load on a 2-core CPU
MAX_MEASURED = 16  # decode configurations whose measured acceptance is kept (oldest dropped first)


class DraftLengthPlanner:
    """The plans of one set of loaded models (target, draft, groups, the proposers on its states)."""

    def __init__(self, target: LM, draft: LM | None, groups: DeviceGroupTable | None = None, heads=None, eagle=None):
        self.target, self.draft, self.groups, self.heads, self.eagle = target, draft, groups, heads, eagle
        self._acceptance: dict[DecodeConfig, tuple[float, ...]] = {}  # `starting_acceptance`, per decode config
        self._loop_steps: dict[DecodeConfig, dict] = {}  # its calibration decode's step timings, until `plan` uses them
        # One measurement at a time: they decode on the target's own cache, and batched streams of a
        # configuration not yet measured ask for it from their threads at once.
        self._measuring = threading.RLock()

    def plan(self, decode_config: DecodeConfig) -> StepCosts | None:
        """Measure the step costs `decode_config`'s adaptive draft length plans with, and the acceptance it
        starts from (`starting_acceptance`), now rather than inside the first utterance (where they
        would add to its time to first audio); once per policy and temperature class while the
        models live (`calibrate` logs a measurement; a later call returns the kept costs). The costs
        kept are the isolated timings moved to what the calibration decode's steps took inside the
        loop (`cost_model.in_loop_costs`). -> the `StepCosts`, or None (nothing to plan). Thread-safe."""
        with self._measuring:
            return self._plan(decode_config)

    def _plan(self, decode_config: DecodeConfig) -> StepCosts | None:
        costs = prepare(self.target, self.draft, decode_config, self.groups, self.proposer(decode_config.policy))
        if costs is not None:
            self.starting_acceptance(decode_config)
            # the calibration decode's in-loop timings replace the isolated ones, once per measurement
            loop_step = self._loop_steps.pop(replace(decode_config, max_new_tokens=CALIBRATION_TOKENS), None)
            if loop_step:
                planned = in_loop_costs(costs, loop_step["length"], loop_step["seconds"])
                keep_costs(self.target, costs, planned)
                costs = planned
        return costs

    def starting_acceptance(self, decode_config: DecodeConfig) -> tuple[float, ...] | None:
        """The per-position acceptance an adaptive draft length starts every utterance from: measured
        once per decode configuration by decoding `CALIBRATION_TEXT` at the fixed draft length,
        seeded (`planning.measure_acceptance`); None when nothing is planned. Thread-safe."""
        if not plans_draft_length(decode_config):
            return None
        with self._measuring:
            return self._starting_acceptance(replace(decode_config, max_new_tokens=CALIBRATION_TOKENS))

    def _starting_acceptance(self, key: DecodeConfig) -> tuple[float, ...]:
        if key not in self._acceptance:
            started = time.perf_counter()
            prompt = build_prompt(self.target.tokenizer, self.target.vocab, CALIBRATION_TEXT)
            loop_step: dict = {}
            rates = measure_acceptance(self.target, self.draft, prompt, key, self.groups, self.proposer(key.policy),
                                       loop_step=loop_step)
            self._loop_steps[key] = loop_step
            log.info("%s at temperature %g starts from acceptance %s (measured on a calibration sentence in %.2f s)",
                     key.policy, key.sampling.temperature, " / ".join(f"{r:.2f}" for r in rates) or "-",
                     time.perf_counter() - started)
            if len(self._acceptance) >= MAX_MEASURED:
                oldest = next(iter(self._acceptance))
                del self._acceptance[oldest]
                self._loop_steps.pop(oldest, None)
            self._acceptance[key] = rates
        return self._acceptance[key]

    def warm_prefix(self) -> None:
        """Prefill the chat template's head, which every utterance and voice shares, into both
        models' caches now (after `plan`, whose timings overwrite the caches), so that the first
        utterance's prefill, like every later one's, runs only its own words (`protocol.py`:
        prefix reuse, bit for bit what a full prefill computes). A no-op with prefix reuse off."""
        head = self.template_head()
        for lm in (self.target, self.draft):
            if _holds(lm, head):
                lm.prefill(head)

    def warm_batch(self, batch) -> None:
        """Allocate a batch's caches and prefill the chat template's head into its first slot now, so that
        no stream's first audio waits for either (every slot copies the head from it:
        `BatchedLM.donor`; with prefix reuse off, none is prefilled); time a call of the EAGLE draft's
        proposals for every slot where its streams share them (`StepGate.time_proposals`)."""
        head = self.template_head()
        for lm in (batch.lm, batch.draft):
            if _holds(lm, head):
                lm.prefill(0, head)
        step = getattr(self.eagle, "step", None)
        if batch.slots > 1 and getattr(step, "stateless", False) and self.eagle.chain is None:
            batch.gate.time_proposals(step, batch.slots)  # what its streams' shared proposals cost

    def template_head(self):
        """The prompt tokens every utterance and voice shares (the chat template's head), or None when
        a prompt is all head."""
        prompt = build_prompt(self.target.tokenizer, self.target.vocab, "Warm.")
        head = prompt[:template_head(prompt, self.target.vocab)]
        return head if len(head) < len(prompt) - 1 else None

    def adopt(self, other: "DraftLengthPlanner") -> None:
        """Plan draft lengths with the step costs `other` (a copy of these models on this machine,
        e.g. another server worker) measured, instead of this one's own measurement: seeded
        utterances then give the same audio on both."""
        for mine, theirs in ((self.draft, other.draft), (self.eagle, other.eagle), (self.heads, other.heads)):
            if mine is not None and theirs is not None:
                adopt_costs(self.target, mine, other.target, theirs)
        self._acceptance.update(other._acceptance)

    def loop_arguments(self, decode_config: DecodeConfig, seeded: bool, batched: bool = False) -> dict:
        """What `loop.decode` (or a batch slot's `SlotSeat.decode`) plans a stream of `decode_config` with:
        `costs`, `proposer` and `acceptance`. A seeded stream plans its draft lengths with the costs
        measured at load, unchanged (not refined by its own timings), so its utterances repeat within
        this process; so does a batched one (its plan shares them with the batch's passes, and costs
        measured through a batch would time the other streams' work too); others refine them as they go."""
        costs = self.plan(decode_config) if seeded or (batched and plans_draft_length(decode_config)) else None
        return {"costs": costs, "proposer": self.proposer(decode_config.policy),
                "acceptance": self.starting_acceptance(decode_config)}

    def proposer(self, policy: str):
        """What proposes from the target's hidden states for `policy` (None for the other policies)."""
        return self.eagle if policy_spec(policy).uses_eagle else self.heads


def _holds(lm, head) -> bool:
    """Whether `lm` (an LM or a batch's; None: none) keeps a prefilled `head` for its next prompts."""
    return lm is not None and lm.reuse_prefix and head is not None and len(head) < lm.max_length

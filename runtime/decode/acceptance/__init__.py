"""Acceptance rules for speculative decoding: pure functions over tensors with fixed-shape outputs.

Terms (as in vLLM): the draft proposes L tokens; the leading ones the rule keeps are
*accepted*; at the first rejection one *recovered* token is sampled instead; when all L are
accepted a *bonus* token is sampled from the target's last row. Output per sequence:
`tokens[L + 1]` = accepted + one recovered/bonus token, padded with -1, and `num_accepted`.

Rules (all over the restricted vocabulary of runtime/text/vocab.py, stop token = index V - 1):
  greedy  temperature 0: accept while the draft equals the target's argmax, then emit the
          target's argmax. Every rule uses this at temperature 0, so speculative output equals
          plain greedy decoding token for token (PCG's group test would otherwise accept a
          group-mate of the argmax, which greedy decoding never emits).
  sd      standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept x with
          min(1, target(x)/draft(x)); recover from norm(max(0, target - draft)). Exact: the
          emitted token is distributed as the target.
  ssd     SSD (Lin et al., Interspeech 2025): accept if u < min(1, target/draft) + beta; recover
          as SD. beta = 0 is SD; beta > 0 trades exactness for acceptance (never for a token the
          target gives probability 0).
  pcg     Principled Coarse-Graining (Yanuka et al.), Algorithm 1 with equal-split weights.
          Groups G_k overlap; S(t) = {k : t in G_k}, N(t) = |S(t)|, and the coarse
          distributions are P_c(k) = sum_{t in G_k} draft(t)/N(t), Q_c(k) likewise for the
          target. For draft token x pick K uniformly from S(x) (so K ~ P_c), accept with
          min(1, Q_c(K)/P_c(K)) keeping x; on rejection sample K from the residual
          [Q_c - P_c]_+ (thinning, with an exact fallback) and emit t in G_K with probability
          proportional to target(t)/N(t): the kept thinning candidate's own token is such a t
          (see `_recover`). The emitted group is distributed exactly as Q_c.
          The stop token is its own singleton group, id = groups.num_groups.
  top-M   (multi-token heads, Speech-LLaMA) accept while a proposal is among the target's M
          best tokens (M = 1: strict), then sample from the target. Not exact.
  thresh  accept while the target gives a proposal probability >= tau. Not exact.

Randomness is injected: `uniforms[B, L]` decide accept/reject (tests force outcomes through
them) and `generator` draws everything else.

The rules' mathematics is written once per form: `tensor.py` (batched, any device: the reference),
`host.py` (one sequence on a CPU, NumPy views of the same rows) and `compiled.py` (SD / PCG over
digit rows as one ahead-of-time graph); the group arithmetic they share is `coarse.py`, which
training reads too. `judge.judge_for` picks a loop's backend once, when the loop starts.
"""

from pcgtts.runtime.decode.acceptance.judge import (EXACT_RULES, INEXACT_RULES, Judge, RuleParams, judge_for,
                                                    verify_one)
from pcgtts.runtime.decode.acceptance.tensor import (PLACEHOLDER, RULES, THINNING_ROUNDS, Verdict, draw_uniforms,
                                                     outcome, sd_residual, verify, verify_greedy, verify_pcg,
                                                     verify_sd, verify_threshold, verify_top_m)

__all__ = ["EXACT_RULES", "INEXACT_RULES", "Judge", "PLACEHOLDER", "RULES", "RuleParams", "THINNING_ROUNDS", "Verdict",
           "draw_uniforms", "judge_for", "outcome", "sd_residual", "verify", "verify_greedy", "verify_one", "verify_pcg",
           "verify_sd", "verify_threshold", "verify_top_m"]

"""Decode stage: prompt ids -> speech tokens, speculatively.

`loop.py` is the loop every policy runs (propose L, verify L + 1 in one pass, judge, roll back);
`policy.py` what a policy name stands for (a `Proposer`, a `Rule`, what it needs);
`proposers.py` who proposes (a draft LM, multi-token heads, a Viterbi path, an EAGLE draft);
`acceptance/` the rules (SD, SSD, PCG, top-M, threshold) in their tensor, host and compiled forms;
`rows.py` a speech head's rows as the rules read them; `steps.py` the parts of a step the loops
share; `device_loop.py` whole steps on the device (CUDA graphs); `sampling.py` turns logits into
probabilities and draws; `cost_model.py` predicts tokens/s per draft length, decides whether L is
planned and picks it (`adaptive_draft`); `calibrate.py` measures the costs it plans with;
`planning.py` measures them and the starting acceptance before the first utterance; `viterbi.py`
the Viterbi proposal over the code Markov table of `transitions.py` (.pct).
"""

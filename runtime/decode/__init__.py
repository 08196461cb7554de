"""Decode stage: prompt ids -> speech tokens, speculatively.

`speculative.py` is the loop (draft L tokens, verify L+1 in one pass, roll back);
`acceptance.py` holds the rules as pure tensor functions (ar, draft, sd, ssd, pcg);
`sampling.py` turns logits into probabilities and draws; `cost_model.py` predicts tokens/s per
draft length and picks L (`adaptive_draft`); `calibrate.py` measures the costs it plans with.
`viterbi.py` picks multi-token-head proposals over the code Markov table of `transitions.py` (.pct).
"""

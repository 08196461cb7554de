"""Decode stage: prompt ids -> speech tokens, speculatively.

`speculative.py` is the loop (draft L tokens, verify L+1 in one pass, roll back);
`acceptance.py` holds the rules as pure tensor functions (ar, draft, sd, ssd, pcg);
`sampling.py` turns logits into probabilities and draws.
"""

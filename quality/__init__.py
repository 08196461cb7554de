"""pcgtts.quality: the quality harness behind `pcgtts eval` (a tool around the runtime, never in its decode path).

    metrics.py    judges: text normalisation, WER/CER (jiwer), ASR (pocketsphinx), Sim-O (resemblyzer), STOI, MCD
    stats.py      means with 95 % t-intervals, paired differences vs target AR, plain-text tables
    testset.py    the versioned test set (testset_v1.json) and its reference voices rendered on demand
    harness.py    modes source / codec / synth (Table 1): synthesise, score, summarise
    swap.py       Table 2: intra-group vs random token swaps
    melgroups.py  Table 3: groups from the codec's decoded sound of each token
    plots.py      accuracy / speed-up curves over θ, β and draft length
    gate.py       the release gate: a new built-in voice against the shipped one (`pcgtts train package`)

The `pcgtts eval` command is cli/evaluate.py.
"""

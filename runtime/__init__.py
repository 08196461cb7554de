"""Synthesis time, one folder per stage of the data flow:

    text/    normalise + split the text, build the LLaSA prompt (vocabulary, control tokens)
    lm/      load checkpoints; the lean LLaMA with a static KV cache; backends behind one `LM` protocol
    decode/  the speculative loop, the acceptance rules (ar, sd, ssd, pcg) and sampling
    audio/   X-codec2 (encode reference audio, decode tokens), streaming window decode, voices, playback

`config.py` holds every setting; `synthesizer.py` strings the stages together behind
`Synthesizer.stream()`. Nothing here imports a tool (CLI, bench, demo builders).
"""

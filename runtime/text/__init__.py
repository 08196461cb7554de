"""Text stage: user text -> sentences -> LLaSA prompt token ids.

`vocab.py` (speech-token layout, control tokens), `split.py` (sentence splitting),
`prompt.py` (the chat prompt with reference transcript and codes; user text never becomes
control tokens).
"""

"""The speech lab: trains the built-in voice in the released formats.

Flow: `corpus` (sentences -> packaged TTS voices -> 16 kHz FLAC + manifest) -> `codec` (small
X-codec2, `Xcodec2Model` format) -> `lm` (codes -> LLaSA-layout `LlamaForCausalLM`, factorised
speech head materialised at export) -> `draft` (3-layer subset of the target, fine-tuned).
`cli.add_command` adds each step to a command group (`pcgtts train`, cli/train.py). Nothing here is
imported by the runtime.
"""

"""The speech lab: trains the built-in voice in the released formats.

Flow: `corpus` (sentences -> packaged TTS voices -> 16 kHz FLAC + manifest) -> `codec` (small
X-codec2, `Xcodec2Model` format) -> `lm` (codes -> LLaSA-layout `LlamaForCausalLM`, factorised
speech head materialised at export) -> `draft` (3-layer subset of the target, fine-tuned).
`cli.register(subparsers)` adds `pcgtts lab`. Nothing here is imported by the runtime.
"""

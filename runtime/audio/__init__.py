"""Audio stage: tokens <-> waveforms, and the sound out.

`codec.py` (X-codec2 through transformers' Xcodec2Model; the `SpeechCodec` protocol),
`onnx_codec.py` (its exported decoder), `features.py` (the encoder's fbank front end),
`streaming.py` (windowed decode with context, lookahead and cross-fade), `codec_batch.py`
(several batched streams' windows decoded together), `voice.py` (a
reference recording encoded once), `io.py` (audio files), `chunk.py` (`AudioChunk`),
`playback.py` (PortAudio, WAV and null sinks).
"""

"""Table 3's other grouping: Acoustic Similarity Groups from the codec's *sound* of each token.

Data flow: every speech token t -> the codec decodes t repeated `repeat` times (a steady 20 ms
x repeat sound) -> log-mel spectrum averaged over its frames -> centred over all tokens ->
`groups/build.py`'s `build_groups` (cosine > θ_mel, identical sets merged), the same builder the
embedding groups use. θ_mel is chosen so that the mean number of neighbours per token matches
the embedding table's (the paper compares the two at the same group-size budget), estimated on a
random sample of rows. The table is stamped with the target's identity so the runtime accepts it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE

log = logging.getLogger(__name__)


@torch.inference_mode()
def token_mel_features(codec, num_tokens: int, repeat: int = 4, batch: int = 512, n_mels: int = 40,
                       centre: bool = True, progress=lambda _: None) -> torch.Tensor:
    """[num_tokens, n_mels] mean log-mel of each decoded token, centred over the tokens unless
    `centre` is False (torch `Codec` only: it decodes a batch of sequences at once through its
    quantizer and decoder)."""
    import librosa

    if not hasattr(codec, "quantizer") or not hasattr(codec, "decoder"):
        raise ValueError("mel groups need the torch X-codec2 codec (an exported codec cannot batch-decode)")
    if repeat < 1 or batch < 1:
        raise ValueError("repeat and batch must be >= 1")
    fb = torch.as_tensor(librosa.filters.mel(sr=SAMPLE_RATE, n_fft=512, n_mels=n_mels), dtype=torch.float32)
    window = torch.hann_window(400)
    feats = []
    for start in range(0, num_tokens, batch):
        stop = min(num_tokens, start + batch)
        if start // batch % 16 == 0:
            progress(f"mel features {start}/{num_tokens}")
        codes = torch.arange(start, stop, device=codec.device).view(-1, 1, 1).expand(-1, repeat, 1).contiguous()
        audio = codec.decoder(codec.quantizer.from_codes(codes))[:, 0].float().cpu()  # [B, 320 * repeat]
        spec = torch.stft(audio, n_fft=512, hop_length=160, win_length=400, window=window, center=True,
                          return_complex=True).abs() ** 2  # [B, 257, frames]
        mel = torch.log(torch.einsum("mf,bft->bmt", fb, spec) + 1e-8)
        feats.append(mel.mean(dim=2))
    out = torch.cat(feats)
    return out - out.mean(dim=0, keepdim=True) if centre else out  # centred: cosine compares spectral shape


def mean_neighbours(features: torch.Tensor, theta: float, sample: np.ndarray) -> float:
    """Mean |G(t)| (t included) over the sampled rows at threshold θ (cosine)."""
    unit = torch.nn.functional.normalize(features.float(), dim=1)
    sims = unit[torch.as_tensor(sample)] @ unit.T
    sims[torch.arange(len(sample)), torch.as_tensor(sample)] = float("inf")
    return float((sims > theta).sum(dim=1).float().mean())


def matching_theta(features: torch.Tensor, target_mean: float, sample: np.ndarray) -> float:
    """θ at which the sampled rows have `target_mean` neighbours on average (t included)."""
    unit = torch.nn.functional.normalize(features.float(), dim=1)
    sims = unit[torch.as_tensor(sample)] @ unit.T
    sims[torch.arange(len(sample)), torch.as_tensor(sample)] = 2.0  # t itself always counts
    k = int(round(target_mean * len(sample)))
    flat = sims.flatten()
    k = min(max(k, len(sample)), flat.numel())
    kth = torch.topk(flat, k).values[-1]
    return float(min(max(kth.item() - 1e-6, -1.0), 0.999999))


def build_mel_groups(codec, embeddings: torch.Tensor, theta: float, identity: tuple[int, int, str],
                     sample_size: int = 1024, seed: int = 0, progress=lambda _: None):
    """(mel GroupTable, info) at the mean group size the embedding groups have at `theta`.
    `identity`: (speech_offset, vocab_size, fingerprint) of the target the table is for."""
    from pcgtts.groups.build import build_groups

    n = embeddings.shape[0]
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(sample_size, n), replace=False))
    target_mean = mean_neighbours(embeddings, theta, sample)
    features = token_mel_features(codec, n, progress=progress)
    theta_mel = matching_theta(features, target_mean, sample)
    achieved = mean_neighbours(features, theta_mel, sample)
    progress(f"mel groups: θ_mel={theta_mel:.4f} for {target_mean:.1f} neighbours per token")
    table = build_groups(features, theta_mel, progress=False).with_model(*identity)
    info = {"theta_embedding": theta, "theta_mel": theta_mel, "neighbours_embedding": target_mean,
            "neighbours_mel": achieved, "sample_rows": int(len(sample))}
    return table, info


__all__ = ["token_mel_features", "mean_neighbours", "matching_theta", "build_mel_groups"]

"""Digit-factorised heads (runtime/lm/digit_head.py): recognised exactly, same logits, same decoding."""

from __future__ import annotations

import shutil

import pytest
import numpy as np
import torch
from scipy.stats import chisquare

from pcgtts.runtime.lm.digit_head import (argmax_digit_code, argmax_digit_codes, code_digits, digit_count, digit_kl,
                                         digit_log_probs, expand_digit_scores, draw_digit_code, find_digit_table,
                                         host_digit_log_probs, host_draw_digit_codes, sample_digit_codes)


def test_digit_count():
    assert digit_count(65536) == 8 and digit_count(1024) == 5
    assert digit_count(1000) is None and digit_count(4) is None and digit_count(512) is None


def test_expand_matches_the_digit_sum_of_every_code():
    gen = torch.Generator().manual_seed(0)
    n, hidden = 5, 16
    table = torch.randn(1 + n * 4 + 1, hidden, generator=gen)
    h = torch.randn(3, hidden, generator=gen)
    logits = expand_digit_scores(h @ table.T, n)  # [3, 4**5 + 1]
    codes = torch.arange(4 ** n)
    rows = table[0] + table[1:-1].view(n, 4, hidden)[torch.arange(n), code_digits(codes, n)].sum(-2)
    torch.testing.assert_close(logits[:, :-1], h @ rows.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, -1], h @ table[-1])


def test_find_digit_table_reproduces_a_factorised_matrix_and_refuses_others():
    gen = torch.Generator().manual_seed(1)
    n, hidden = 5, 8
    digit_rows = torch.randn(n, 4, hidden, generator=gen)
    rows = digit_rows[torch.arange(n), code_digits(torch.arange(4 ** n), n)].sum(-2)
    stop = torch.randn(hidden, generator=gen)
    table = find_digit_table(rows, stop)
    assert table is not None and table.shape == (1 + n * 4 + 1, hidden)
    h = torch.randn(4, hidden, generator=gen)
    torch.testing.assert_close(expand_digit_scores(h @ table.T, n), torch.cat([h @ rows.T, (h @ stop)[:, None]], 1),
                               rtol=1e-5, atol=1e-5)
    perturbed = rows.clone()
    perturbed[777, 3] += 1e-3  # one entry of one row off the digit sum
    assert find_digit_table(perturbed, stop) is None
    assert find_digit_table(torch.randn(4 ** n, hidden, generator=gen), stop) is None
    assert find_digit_table(rows[:1000], stop) is None  # not a digit grid


def test_digit_sampling_draws_the_expanded_distribution():
    """200,000 draws by digit from 3-digit scores at temperature 0.7 against softmax(expanded / 0.7):
    chi-square at significance 1e-4 (false-alarm rate 1e-4; seeded, so deterministic). The same
    counts must reject the distribution at temperature 1 (power check)."""
    n, draws = 3, 200_000
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(1 + n * 4 + 1, generator=gen)
    scores[-1] = 3.0  # the stop token takes a visible share
    codes = sample_digit_codes(scores.expand(draws, -1), n, 0.7, torch.rand(draws, n + 1, generator=gen))
    counts = torch.bincount(codes, minlength=4 ** n + 1).double()
    assert len(counts) == 4 ** n + 1 and counts[-1] > 0
    for temperature, fits in ((0.7, True), (1.0, False)):
        expected = torch.softmax(expand_digit_scores(scores, n).double() / temperature, -1) * draws
        assert (chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4) == fits


def test_host_digit_functions_equal_the_tensor_ones():
    """The NumPy and plain-Python twins the CPU lane uses: the same factored log-probabilities, and
    the same draws for the same uniforms (20,000 draws from 8-digit scores; a float-rounding tie
    is ~1e-12 likely)."""
    n, draws = 8, 20_000
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 1 + n * 4 + 1, generator=gen) * 2
    for tensor_part, host_part in zip(digit_log_probs(scores, n, 0.8), host_digit_log_probs(scores.numpy(), n, 0.8)):
        np.testing.assert_allclose(tensor_part.numpy(), host_part, rtol=1e-12, atol=1e-12)
    _, speech, stop = digit_log_probs(scores[0], n, 1.0)
    scores[0, -1] += float(speech - stop) - 1.0  # this row stops about a third of the time
    rows = scores[torch.arange(draws) % 3]
    uniforms = torch.rand(draws, n + 1, generator=gen)
    expected = sample_digit_codes(rows, n, 0.8, uniforms).numpy()
    assert (expected == 4 ** n).sum() > 1000 and len(np.unique(expected)) > 1000
    per_digit, _, log_stop = host_digit_log_probs(rows.numpy(), n, 0.8)
    np.testing.assert_array_equal(host_draw_digit_codes(per_digit, log_stop, uniforms.numpy()), expected)
    one_by_one = [draw_digit_code(row, n, 0.8, u) for row, u in zip(rows.tolist(), uniforms.tolist())]
    np.testing.assert_array_equal(np.array(one_by_one), expected)


def test_the_argmax_digit_by_digit_is_the_argmax_of_the_expanded_row():
    """Greedy decoding's token without a 65,537-wide row: each digit's best level, or the stop token
    when it is strictly above the best code. Random rows (some made to stop) and integer rows full of
    exact ties, where the expanded row's argmax takes the lowest index; the plain-Python, NumPy and
    tensor forms agree with it."""
    n = 8
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(200, 1 + n * 4 + 1, generator=gen, dtype=torch.float64)
    scores[::4, -1] += 8.0  # these rows stop
    ties = torch.randint(0, 2, (200, 1 + n * 4 + 1), generator=gen).double()  # sums of small integers: exact ties
    best_code = ties[:50, 0] + ties[:50, 1:-1].view(50, n, 4).amax(-1).sum(-1)
    ties[:50, -1] = best_code  # the stop token ties the best code: the code wins (lower index)
    ties[50:60, -1] += 20.0
    for rows in (scores, ties):
        expected = expand_digit_scores(rows, n).argmax(-1)
        assert 0 < int((expected == 4 ** n).sum()) < len(rows)
        assert argmax_digit_codes(rows, n).tolist() == expected.tolist()
        assert argmax_digit_codes(rows.numpy(), n).tolist() == expected.tolist()
        assert [argmax_digit_code(row, n) for row in rows.tolist()] == expected.tolist()
    assert (expand_digit_scores(ties, n).argmax(-1)[:50] < 4 ** n).all()


def test_the_greedy_rule_on_digit_rows_is_the_dense_rule():
    """The greedy verdict from digit rows (their argmax, digit by digit) equals
    acceptance.verify_greedy on the expanded one-hot rows, for proposals accepted up to every length."""
    from pcgtts.runtime.config import SamplingConfig
    from pcgtts.runtime.decode.acceptance import outcome, verify
    from pcgtts.runtime.decode.acceptance import verify_one
    from pcgtts.runtime.decode.rows import DigitRows
    from pcgtts.runtime.decode.sampling import logits_to_probs

    n, length = 5, 4
    gen = torch.Generator().manual_seed(7)
    seen = set()
    for trial in range(40):
        scores = torch.randn(length + 1, 1 + n * 4 + 1, generator=gen)
        dense = logits_to_probs(expand_digit_scores(scores, n), SamplingConfig(temperature=0.0))
        tokens = dense.argmax(-1)[:length].clone()
        cut = trial % (length + 1)  # proposals agree with the argmax up to here
        tokens[cut:] = torch.randint(0, 4 ** n, (length - cut,), generator=gen)
        expected = outcome(verify("greedy", tokens[None], dense[None, :length], dense[None], torch.zeros(1, length),
                                  gen))
        got = verify_one("greedy", tokens, None, DigitRows(scores, n, 0.0), torch.zeros(length), gen)
        assert got == expected
        seen.add(got[0])
    assert seen == set(range(length + 1))


def test_digit_kl_equals_the_kl_of_the_expanded_rows_and_its_gradient():
    """The closed form against KL computed over all 4**5 + 1 expanded entries, value and gradient."""
    n = 5
    gen = torch.Generator().manual_seed(6)
    p_scores = torch.randn(7, 1 + n * 4 + 1, generator=gen, dtype=torch.float64) * 2
    q_scores = (p_scores + torch.randn(p_scores.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    p_scores[0, -1] = 6.0  # a row where stopping is likely
    closed = digit_kl(p_scores, q_scores, n)
    log_p = torch.log_softmax(expand_digit_scores(p_scores, n), -1)
    expanded = (log_p.exp() * (log_p - torch.log_softmax(expand_digit_scores(q_scores, n), -1))).sum(-1)
    torch.testing.assert_close(closed, expanded, rtol=1e-10, atol=1e-12)
    assert (closed > 0.01).all()
    torch.testing.assert_close(torch.autograd.grad(closed.sum(), q_scores)[0],
                               torch.autograd.grad(expanded.sum(), q_scores)[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(digit_kl(p_scores, p_scores, n), torch.zeros(7, dtype=torch.float64), atol=1e-12, rtol=0)


def test_a_factorised_checkpoint_loads_with_the_digit_table_and_gives_the_same_logits(factorised_target, tiny_lms):
    from pcgtts.runtime.lm.checkpoint import load_llama, load_tokenizer
    from pcgtts.runtime.text.vocab import SpeechVocab

    vocab = SpeechVocab.from_tokenizer(load_tokenizer(factorised_target))
    fast = load_llama(factorised_target, vocab)
    full = load_llama(factorised_target, vocab, digit_head=False)
    assert fast.digits == 5 and fast.head.out_features == 22
    assert full.digits == 0 and full.head.out_features == vocab.restricted_size
    assert load_llama(tiny_lms["target"], vocab).digits == 0  # an ordinary head is used as stored
    ids = torch.randint(0, vocab.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    for model in (fast, full):
        model.setup_cache(32)
    positions = torch.arange(12)
    torch.testing.assert_close(fast(ids, positions, end=12), full(ids, positions, end=12), rtol=1e-5, atol=1e-5)
    subset = torch.tensor([3, 40, 41, 500, vocab.restricted_size - 1])
    fast.use_head_subset(subset, vocab.restricted_size)  # a used-codes draft head: the rest get -inf
    got = fast(ids, positions, end=12)
    assert torch.isinf(got).sum(-1).eq(vocab.restricted_size - len(subset)).all()
    torch.testing.assert_close(got[..., subset], full(ids, positions, end=12)[..., subset], rtol=1e-5, atol=1e-5)


def test_greedy_and_speculative_decoding_are_unchanged_by_the_digit_table(factorised_target, tiny_lms):
    from pcgtts.runtime.config import DecodeConfig, SamplingConfig
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.lm.checkpoint import load_llama, load_tokenizer
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.vocab import SpeechVocab

    tok = load_tokenizer(factorised_target)
    vocab = SpeechVocab.from_tokenizer(tok)

    def lm(digit_head: bool) -> TorchLM:
        return TorchLM(load_llama(factorised_target, vocab, digit_head=digit_head), vocab, 256, tokenizer=tok)

    draft = TorchLM.load(tiny_lms["draft"], max_length=256, tokenizer=tok)
    prompt = torch.tensor(tok("<|begin_of_text|>hello there")["input_ids"])
    argmax = SamplingConfig(temperature=0.0)
    greedy = DecodeConfig(policy="ar", sampling=argmax, max_new_tokens=40)
    outputs = {}
    for digit_head in (True, False):
        target = lm(digit_head)
        outputs[digit_head, "ar"] = [t for chunk in decode(target, None, prompt, greedy, torch.Generator()) for t in chunk]
        target.release(); target.ensure_cache()
        spec = DecodeConfig(policy="sd", sampling=argmax, max_new_tokens=40, draft_length=3,
                              adaptive_draft=False)
        outputs[digit_head, "sd"] = [t for chunk in decode(target, draft, prompt, spec, torch.Generator()) for t in chunk]
        draft.release(); draft.ensure_cache()
    assert len(outputs[True, "ar"]) == 40
    assert outputs[True, "ar"] == outputs[False, "ar"] == outputs[True, "sd"] == outputs[False, "sd"]

    # With the digit table, greedy steps and the greedy verdict read the 34 scores alone: no model
    # forward that builds the 65,537 logits is called (a mutation back to the dense path fails here).
    target = lm(True)

    def dense(*args, **kwargs):
        raise AssertionError("a greedy step built the 65,537-wide logits")

    for lm_ in (target, draft):
        lm_.forward = lm_.forward_hidden = dense
    draft_head = TorchLM(load_llama(factorised_target, vocab, digit_head=True), vocab, 256, tokenizer=tok)
    draft_head.forward = draft_head.forward_hidden = dense
    for config, proposer in ((greedy, None), (spec, draft_head)):
        got = [t for chunk in decode(target, proposer, prompt, config, torch.Generator()) for t in chunk]
        assert got == outputs[True, "ar"]
        target.release(); target.ensure_cache()


@pytest.mark.slow
def test_the_digit_head_and_a_used_codes_mask_export_to_onnx(factorised_target, tmp_path):
    """The ONNX step graph computes the same digit head; a used-codes head's -inf entries match too
    (the export's own numeric check used to read -inf - -inf as nan and refuse such a draft)."""
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.lm.checkpoint import write_head_codes
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    draft = tmp_path / "draft"
    shutil.copytree(factorised_target, draft)
    write_head_codes(draft, [3, 40, 41, 500], num_speech=1024)
    meta, check = export_lm(draft, tmp_path / "onnx", max_length=64)
    assert check.ok and check.max_abs_diff < 2e-3 and meta.extra["head_digits"] == 0
    torch_lm, ort_lm = TorchLM.load(draft, max_length=64), OrtLM.load(tmp_path / "onnx", max_length=64)
    assert torch_lm.model.digits == 5
    ids = torch.tensor([1, 2, 3, 4, 5])
    a, b = torch_lm.prefill(ids), ort_lm.prefill(ids)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and int(torch.isfinite(b).sum()) == 5
    torch.testing.assert_close(b[torch.isfinite(b)], a[torch.isfinite(a)], rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # an ONNX export, ~13 s (the fast suite stays under 3 minutes)
def test_an_exported_digit_head_returns_its_scores_and_draws_digit_by_digit(factorised_target, tmp_path):
    """A digit head's graph returns its 34 scores, not 65,537 logits (recorded as head_digits): the
    onnxruntime LM gives torch's scores and, expanded, torch's logits; its plain steps draw by digit
    and its rules read digit rows (`drawable_digits`); greedy AR gives torch's tokens. (A used-codes
    head keeps the logits output: the test above.)"""
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.config import DecodeConfig, SamplingConfig
    from pcgtts.runtime.decode.sampling import rule_digits
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    meta, check = export_lm(factorised_target, tmp_path / "onnx", max_length=64)
    assert check.ok and meta.extra["head_digits"] == 5
    torch_lm = TorchLM.load(factorised_target, max_length=64)
    ort_lm = OrtLM.load(tmp_path / "onnx", max_length=64, tokenizer=torch_lm.tokenizer)
    assert ort_lm.drawable_digits == 5 and rule_digits(ort_lm, SamplingConfig(temperature=0.8)) == 5
    ids = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(ort_lm.prefill(ids), torch_lm.prefill(ids), rtol=1e-4, atol=1e-4)
    (a, ha), (b, hb) = torch_lm.forward_scores(ids[:3]), ort_lm.forward_scores(ids[:3])
    assert b.shape == (3, 2 + 4 * 5) and ort_lm.length == torch_lm.length == 8
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hb, ha, rtol=1e-4, atol=1e-4)
    prompt = torch.tensor(torch_lm.tokenizer("<|begin_of_text|>hello there")["input_ids"])
    greedy = DecodeConfig(policy="ar", sampling=SamplingConfig(temperature=0.0), max_new_tokens=12)
    runs = [[t for burst in decode(lm, None, prompt, greedy, torch.Generator().manual_seed(0)) for t in burst]
            for lm in (torch_lm, ort_lm)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


@pytest.mark.slow  # 2,000 one-token decodes
def test_plain_decoding_samples_a_digit_head_digit_by_digit_and_exactly(factorised_target):
    """AR on a digit-factorised target draws by digit (no 65,537-wide row); its first token
    matches softmax(prefill logits / T): chi-square over the 8 likeliest tokens + the rest pooled,
    2,000 decodes, significance 1e-4 (false-alarm rate 1e-4; seeded). Power check: the same counts
    reject the temperature-1 distribution."""
    from pcgtts.runtime.config import DecodeConfig, SamplingConfig
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.lm.torch_lm import TorchLM

    target = TorchLM.load(factorised_target, max_length=64)
    assert target.drawable_digits == 5
    prompt = torch.tensor(target.tokenizer("<|begin_of_text|>hello there")["input_ids"])
    logits = target.prefill(prompt)
    config = DecodeConfig(policy="ar", sampling=SamplingConfig(temperature=0.6), max_new_tokens=1)
    gen = torch.Generator().manual_seed(5)
    firsts = [next(iter(decode(target, None, prompt, config, gen)), [target.vocab.stop_index])[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(firsts), minlength=len(logits)).double()
    for temperature, fits in ((0.6, True), (1.0, False)):
        expected = torch.softmax(logits.double() / temperature, -1)
        top = expected.argsort(descending=True)[:8]
        rest = torch.ones_like(expected, dtype=torch.bool).index_fill_(0, top, False)
        obs = torch.cat([counts[top], counts[rest].sum()[None]])
        exp = torch.cat([expected[top], expected[rest].sum()[None]]) * len(firsts)
        assert (chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4) == fits, (temperature, obs, exp)

"""The PCG and SD rules over digit-head rows as one ahead-of-time compiled call: a compiled CPU target's verdicts.

The host lane (`host._pcg`) runs ~90 NumPy and torch calls a step; right after a target
forward has evicted the caches they cost ~0.4 ms on lab-v1, a fifth of the 4-token verify they
judge. Here the same arithmetic is one graph, compiled ahead of time by AOTInductor and called
through its loader (~40 µs on cold caches, against ~170 µs for a torch.compile graph's Python
wrappers): ~0.16 ms a step in the loop. The package does not depend on the
model or the table (both are inputs, their sizes symbolic); it is built once per torch version,
digit count and thinning-trial count (~15 s on 2 cores) and kept in the cache folder
(`runtime/aot.py`). SD is the same graph over singleton groups (PCG over
them is SD exactly).

What the graph computes is what `host._pcg` computes, from one block of uniforms drawn
on the host (`CompiledRule.__call__`):

  1. the proposed group of each proposal (K uniform over S(x_i)), its P_c and Q_c under the
     draft's and the target's rows, and n = the accepted prefix (u_i < min(1, Q_c / P_c));
  2. 1 + T draws from the target's row n, digit by digit: the bonus token, then T thinning
     candidates y_j, each kept with probability (1 - P_c / Q_c)+ over a group picked uniformly
     from S(y_j) (`tensor._recover`'s first round). The candidates are judged only after a
     rejection, the first `_STAGE` of them before the rest (torch.cond): most steps need none or few;
  3. out = [n, the emitted token, 1] or, when no candidate was kept, [n, -, 0]: the host then goes
     on with the later thinning rounds and the exact residual (`host.recover`), so the
     rule stays exact whatever T is (~2 % of lab-v1's steps).

Group member lists are gathered at the table's largest group size W (padding weighs 0); a
probability is the product of two lookups in per-row tables over a code's high and low digits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pcgtts.runtime.config import MAX_DRAFT_LENGTH
from pcgtts.runtime import aot
from pcgtts.runtime.decode.acceptance import coarse
from pcgtts.runtime.decode.acceptance.coarse import coarse_view, group_members, pick_group
from pcgtts.runtime.decode.acceptance.host import recover
from pcgtts.runtime.decode.rows import DigitRows
from pcgtts.runtime.lm.digit_head import LEVELS, digit_halves, digit_log_probs, sample_digit_codes

log = logging.getLogger(__name__)

_TINY = float(np.finfo(np.float32).tiny)
_STAGE = 4  # thinning candidates judged before the rest are (most steps keep one of the first few)


class PCGDigitRule(torch.nn.Module):
    """The graph (see the module docstring): forward(draft_scores [L, S] f32, target_scores [L + 1, S]
    f32, tokens [L] int64, accept_u [L] f32, u [L + (1 + T) * (digits + 1) + 2T] f64, the draft's and
    the target's temperatures [] f64 (a draft may propose at its own: `eagle.proposal_temperature`),
    then the table: token_span [V + 1, 2], token_shift [V + 1], token_groups [nnz] int16,
    group_span [G + 1, 2], member_shift [G + 1], group_members [nnz] int16, inv_n [V + 1] f32,
    slots [W] (0 .. W - 1)) -> int64 [3]: (n, token, ok)."""

    def __init__(self, digits: int, trials: int):
        super().__init__()
        self.digits, self.trials = digits, trials

    def forward(self, draft_scores, target_scores, tokens, accept_u, u, draft_temperature, temperature, token_span,
                token_shift, token_groups, group_span, member_shift, group_members, inv_n, slots):
        digits, trials, length = self.digits, self.trials, tokens.shape[0]
        table = (token_span, token_shift, token_groups, group_span, member_shift, group_members, inv_n, slots)
        draft, target = _tables(draft_scores, digits, draft_temperature), _tables(target_scores, digits, temperature)
        draws_end = length + (1 + trials) * (digits + 1)  # then T candidates' group picks, T keep tests
        pick_u, draw_u = u[:length], u[length:draws_end].view(1 + trials, digits + 1)

        rows = torch.arange(length, device=tokens.device)
        p_c, q_c = _coarse(draft, target, rows, _pick(table, tokens, pick_u), table)
        accept = accept_u.double() < torch.clamp(q_c / torch.clamp(p_c, min=_TINY), max=1.0)
        n = accept.long().cumprod(0).sum()

        # [1 + T]: the bonus token, then the candidates, drawn from row n as the lane draws them
        draws = sample_digit_codes(target_scores[n], digits, temperature, draw_u, precision=torch.float64)
        done = n == length
        # the branches take their tensors as operands (torch.cond refuses closures over views of one tensor)
        operands = (n, draws, u[draws_end:], *draft[:2], *target[:2], *table)
        index = torch.cond(done, lambda *_: torch.zeros_like(n), self._recover, operands)
        return torch.stack([n, draws[index], (done | (index > 0)).long()])

    def _recover(self, n, draws, u, draft_high, draft_low, target_high, target_low, *table):
        """After a rejection at n: the first kept thinning candidate's index in draws (1 .. T), or 0
        when none was; the first `_STAGE` candidates are judged before the rest."""
        trials, bits = self.trials, 2 * (self.digits // 2)
        draft, target = (draft_high, draft_low, bits), (target_high, target_low, bits)

        def first_kept(start: int, end: int) -> torch.Tensor:
            y = draws[1 + start:1 + end]
            p_y, q_y = _coarse(draft, target, n.expand(end - start), _pick(table, y, u[start:end]), table,
                               target_row=n)  # n < L here: the draft has a row n
            kept = u[trials + start:trials + end] < torch.clamp(1.0 - p_y / torch.clamp(q_y, min=_TINY), min=0.0)
            return torch.where(kept.any(), 1 + start + kept.long().argmax(), 0)

        first = first_kept(0, min(_STAGE, trials))
        if trials <= _STAGE:
            return first
        return torch.cond(first > 0, lambda: first.clone(), lambda: first_kept(_STAGE, trials))


def _tables(scores: torch.Tensor, digits: int, temperature: torch.Tensor):
    """scores [R, 1 + 4 * digits + 1] -> (high [R, 4**(digits - digits//2) + 1] (the stop's entry
    last), low [R, 4**(digits//2)], the low table's index width in bits): `rows.DigitRows`'
    factor tables, exponentiated, so that p(code) = high[code >> bits] * low[code & mask]."""
    per_digit, speech, stop = digit_log_probs(scores, digits, temperature)
    high, low = digit_halves(per_digit, speech)
    high = torch.cat([high, stop[:, None] - low[:, :1]], 1)
    return high.exp(), low.exp(), 2 * (digits // 2)


def _pick(table, tokens: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`coarse.pick_group` over the graph's table inputs: a group uniform over S(t) per token [K]."""
    return pick_group(table[0], table[1], table[2], tokens, u)


def _coarse(draft, target, rows: torch.Tensor, groups: torch.Tensor, table, target_row=None):
    """(P_c, Q_c) [K] of groups [K] under the draft's rows `rows` and the target's rows `rows`
    (`target_row` for all of them, if given): equal-split sums over the members (`coarse.group_members`), padded to W."""
    group_span, member_shift, members16, inv_n, slots = table[3:]
    members, valid = group_members(group_span, member_shift, members16, groups, slots)
    weights = inv_n[members].double() * valid
    target_rows = rows if target_row is None else target_row.expand(len(rows))
    return (_at(draft, rows, members) * weights).sum(-1), (_at(target, target_rows, members) * weights).sum(-1)


def _at(tables, rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Probabilities of codes [K, W] under rows [K]: a product of two lookups (`_tables`; both
    factors are probabilities, so neither underflows before their product)."""
    high, low, bits = tables
    return high[rows[:, None], codes >> bits] * low[rows[:, None], codes & ((1 << bits) - 1)]


class CompiledRule:
    """The PCG rule of one group table, or SD (PCG over singleton groups, the same graph), as a
    compiled call (`PCGDigitRule` through AOTInductor): the loop's judge (`judge.CompiledJudge`)
    for steps whose draft and target rows are digit rows."""

    def __init__(self, runner, groups, digits: int, trials: int, rule: str = "pcg"):
        if groups.num_tokens != LEVELS ** digits:
            raise ValueError(f"the group table covers {groups.num_tokens} codes, the digit rows {LEVELS ** digits}")
        spans = groups.spans
        self.groups, self.digits, self.trials, self.rule, self.runner = groups, digits, trials, rule, runner
        self.table = [spans.token, spans.token_shift, groups.token_groups, spans.group, spans.member_shift,
                      groups.group_members, groups.inv_groups_per_token, torch.arange(groups.max_group_size)]

    def suits(self, rule: str, groups, draft, target) -> bool:
        """Whether this rule judges `rule` over these rows (digit rows of its digit count) and groups."""
        return (rule == self.rule and (rule == "sd" or groups is self.groups) and isinstance(draft, DigitRows)
                and isinstance(target, DigitRows) and draft.digits == target.digits == self.digits)

    def __call__(self, tokens: torch.Tensor, draft, target, accept_u: torch.Tensor,
                 generator: torch.Generator) -> tuple[int, list[int]]:
        """tokens [L], draft / target `DigitRows` of L and L + 1 rows, accept_u [L] -> (n, the n + 1 tokens)."""
        length = len(tokens)
        u = torch.rand(length + (1 + self.trials) * (self.digits + 1) + 2 * self.trials, generator=generator,
                       dtype=torch.float64)
        n, token, ok = self.runner(draft.scores, target.scores, tokens, accept_u, u, aot.f64_scalar(draft.temperature),
                                   aot.f64_scalar(target.temperature), *self.table).tolist()
        if not ok:  # no thinning candidate was kept: the later rounds and the exact residual, on the host
            view = coarse_view(self.groups, target.size)
            token = recover(view, draft, target, n, self.trials, generator, first_round=1)
        return n, [*tokens[:n].tolist(), token]


# Every index the graph gathers with is in range by construction (spans of the table it is given,
# which `CompiledRule` checks covers the codes; codes below 4**digits + 1): inductor's per-gather
# bounds checks cost ~10 µs a call.
_OPTIONS = {"assert_indirect_indexing": False}
_RUNNERS: dict[tuple[int, int], object] = {}  # (digits, trials) -> the loaded package, shared by every table


def load_rule(groups, digits: int, trials: int, cache_dir: str | Path | None = None,
              rule: str = "pcg") -> CompiledRule | None:
    """The compiled `rule` over `groups` (its package built on first use, ~15-30 s, then loaded from
    the cache folder), or None, with a warning, where AOTInductor cannot build it (the host lane then runs)."""
    key = (digits, trials)
    if key not in _RUNNERS:
        try:
            _RUNNERS[key] = _load_or_build(digits, trials, Path(cache_dir) if cache_dir else aot.cache_dir("compiled-rules"))
        except Exception as err:  # noqa: BLE001 - any build failure leaves the (exact, slower) host lane
            log.warning("the compiled rule could not be built (%s); the rule runs on the host", err)
            _RUNNERS[key] = None
    runner = _RUNNERS[key]
    return CompiledRule(runner, groups, digits, trials, rule) if runner is not None else None


def _load_or_build(digits: int, trials: int, cache_dir: Path):
    sources = (Path(__file__), Path(coarse.__file__))  # the graph's code: a change rebuilds the package
    path = cache_dir / aot.package_name(f"pcg-d{digits}-t{trials}", sources, "")
    run = aot.load_or_build(path, lambda: export_rule(digits, trials), _OPTIONS, "the rule")
    return lambda *args: run(*args)[0]


def example_inputs(digits: int, trials: int, length: int = 3):
    """Inputs of the traced shapes (a 2-group table over 4**digits codes)."""
    from pcgtts.groups.device import DeviceGroupTable

    codes = LEVELS ** digits
    groups = DeviceGroupTable.from_groups([list(range(0, codes, 2)), list(range(1, codes, 2)), [0, 1, 2]], codes)
    rule = CompiledRule(None, groups, digits, trials)
    width = 1 + LEVELS * digits + 1
    return (torch.randn(length, width), torch.randn(length + 1, width), torch.zeros(length, dtype=torch.long),
            torch.rand(length), torch.rand(length + (1 + trials) * (digits + 1) + 2 * trials, dtype=torch.float64),
            torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64), *rule.table)


def export_rule(digits: int, trials: int):
    """`PCGDigitRule` through torch.export, the draft length and the table's sizes symbolic."""
    from torch.export import Dim

    length = Dim("length", min=1, max=MAX_DRAFT_LENGTH)
    # entries: both CSR directions of one table hold one entry per (group, member) pair
    tokens, groups, entries, width = (Dim(name, min=2) for name in ("tokens", "groups", "entries", "width"))
    block = (1 + trials) * (digits + 1) + 2 * trials
    shapes = ({0: length}, {0: length + 1}, {0: length}, {0: length}, {0: length + block}, {}, {},
              {0: tokens}, {0: tokens}, {0: entries}, {0: groups}, {0: groups}, {0: entries}, {0: tokens},
              {0: width})
    return torch.export.export(PCGDigitRule(digits, trials), example_inputs(digits, trials), dynamic_shapes=shapes)


def for_rows(rule: str, groups, digits: int, trials: int) -> CompiledRule | None:
    """The compiled `rule` (sd or pcg) over digit rows of `digits` digits: PCG with a group table that
    covers them, SD over singleton groups; None where it does not apply (no table, or one of another
    size: the host lane then runs and names the mismatch) or cannot be built."""
    if rule == "sd":
        groups = singletons(LEVELS ** digits)
    elif rule != "pcg" or groups is None or groups.num_tokens != LEVELS ** digits:
        return None
    return load_rule(groups, digits, trials, rule=rule)


_SINGLETONS: dict[int, object] = {}


def singletons(codes: int):
    """Every code its own group (made once per size): PCG over them is SD, exactly."""
    from pcgtts.groups.device import DeviceGroupTable

    if codes not in _SINGLETONS:
        _SINGLETONS[codes] = DeviceGroupTable.singletons(codes)
    return _SINGLETONS[codes]

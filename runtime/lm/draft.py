"""Drafts: checking one fits its target.

`check_draft_layout` refuses, before the draft's weights load, a draft whose own tokenizer or
embedding table does not match the target's: the decode loop feeds both models the same token
ids. (Drafts are made by the training side: `pcgtts.train.subset_draft`.)
"""

from __future__ import annotations

from pathlib import Path

from pcgtts.runtime.lm.checkpoint import embedding_rows, load_tokenizer, same_tokenizer_files
from pcgtts.runtime.text.vocab import SpeechVocab


def check_draft_layout(target_dir: str | Path, target_tokenizer, draft_dir: str | Path, role: str = "draft") -> None:
    """Raise a ValueError unless the draft folder's own tokenizer gives the target's token ids and
    its embedding table has the target's number of rows (exports: the tokenizer they carry); `role`
    names the second model in the errors ("draft", "clone target": any model fed the target's ids)."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    if not same_tokenizer_files(target_dir, draft_dir):  # identical files: identical token ids
        _check_same_tokenizer(target_dir, target_tokenizer, draft_dir, role)
    rows = embedding_rows(target_dir), embedding_rows(draft_dir)
    if None not in rows and rows[0] != rows[1]:
        raise ValueError(f"{role} {draft_dir} has {rows[1]} embedding rows (vocab_size), the target "
                         f"{target_dir} has {rows[0]}; the {role} was not made for this target")


def _check_same_tokenizer(target_dir: Path, target_tokenizer, draft_dir: Path, role: str) -> None:
    draft_tokenizer = load_tokenizer(draft_dir)
    target_vocab = SpeechVocab.from_tokenizer(target_tokenizer)
    try:
        draft_vocab = SpeechVocab.from_tokenizer(draft_tokenizer)
    except ValueError as err:
        raise ValueError(f"{role} {draft_dir}: {err}") from None
    target_vocab.check_same_layout(draft_vocab, f"target ({target_dir})", f"{role} ({draft_dir})")
    mine, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
        raise ValueError(f"{role} {draft_dir}: its tokenizer has the target's speech-token layout "
                         f"({target_vocab.describe()}) but maps {len(differ)} other tokens differently "
                         f"(e.g. {differ[:3]}); prompts are tokenized once for both models")

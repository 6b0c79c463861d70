"""System prompt retained past the trained context: an instruction from the system prompt still followed
after a chat of ``L`` times the trained context.

The system prompt names the assistant (an instruction a small instruct model follows: SmolLM2-135M-Instruct
answers "I'm Zorblax." to "What is your name?" when told so), then user / assistant turns about Python
topics (``pydoc_data.topics``: the user asks about a topic, the assistant's turn is the topic's text),
then the question. The name sits past the sink block, so pinning the sinks alone cannot keep it::

    <|im_start|>system\\n You are ... Your name is Zorblax. ...<|im_end|>   <- tokens 0 .. ~45 (name at ~30)
    <|im_start|>user\\n Tell me about ...<|im_end|> <|im_start|>assistant\\n <topic text><|im_end|>
    ... turns to L x ctx ...
    <|im_start|>user\\n What is your name?<|im_end|> <|im_start|>assistant\\n   -> "I'm Zorblax."

Arms (the engine, greedy, 16 new tokens; correct when the name occurs in the answer)::

    dense                no eviction: only chats that fit the trained context
    sinks_window         sliding window + sinks 0..3
    sinks_window_system  sinks_window + the ``system`` token role pinned (the engine finds the system turn
                         from the tokenizer's chat delimiters); run only where the engine resolves a
                         system span for this tokenizer, else a note says why not
    sinks_window_anchor  sinks_window + the system turn pinned as an anchor (token range 0 .. its end)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from evals import arms as A
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

NAMES = ("Zorblax", "Quillon", "Tobrik", "Belvaro", "Kestrin", "Dunmore", "Pellow", "Vantor")
QUESTION = "What is your name?"
SYSTEM = ("You are a helpful AI assistant. You answer questions about the Python programming language clearly "
          "and briefly. Your name is {name}. When someone asks for your name, you say that your name is {name}.")
TURN_TOKENS = 300  # an assistant turn is the start of a topic's text, about this many tokens

SYSTEM_ROLE = dataclasses.replace(A.SINKS_WINDOW, name="sinks_window_system", label="sinks + window + system role")
SYSTEM_ANCHOR = dataclasses.replace(A.SINKS_WINDOW_ANCHOR, label="sinks + window + system turn anchored")
ARMS = (A.DENSE, A.SINKS_WINDOW, SYSTEM_ROLE, SYSTEM_ANCHOR)


@dataclass(frozen=True)
class SystemPromptConfig:
    model: str
    lengths: tuple[float, ...]  # multiples of the trained context
    trials: int  # chats per point, one name each
    window: int
    chunk: int
    arms: tuple[str, ...] = tuple(a.name for a in ARMS)
    max_new_tokens: int = 16


@dataclass
class Chat:
    name: str
    prompt: str
    n_tokens: int
    system_end: int  # tokens of the system turn (its closing delimiter and newline included)
    name_token: int  # index of the first token of the name inside the system turn


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(k, " ".join(v.split())) for k, v in sorted(topics.items()) if len(v.split()) > 40]


def build_chat(tokenizer: Any, name: str, n_tokens: int, seed: int) -> Chat:
    """A chat of at most ``n_tokens`` tokens (its generation prompt included) whose system prompt names the
    assistant ``name``; turns cycle through the topics starting at topic ``seed``."""
    system = {"role": "system", "content": SYSTEM.format(name=name)}
    question = {"role": "user", "content": QUESTION}

    def render(messages: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    head = render([system], False)
    system_end = count(head)
    before_name = head[: head.index(f"Your name is {name}") + len("Your name is")]
    name_token = count(before_name)
    topics = _topics()
    turns: list[dict[str, str]] = []
    total = count(render([system, question], True))
    i = seed
    while True:
        title, text = topics[i % len(topics)]
        words = text.split()[: TURN_TOKENS * 3 // 4]
        pair = [{"role": "user", "content": f"Tell me about {title} in Python."},
                {"role": "assistant", "content": " ".join(words)}]
        added = count(render(pair, False))
        if total + added > n_tokens:
            break
        turns += pair
        total += added
        i += 1
    prompt = render([system, *turns, question], True)
    return Chat(name, prompt, count(prompt), system_end, name_token)


def followed(answer: str, name: str) -> bool:
    """The instruction is followed when the answer says the name."""
    return name.lower() in answer.lower()


def _system_span_resolves(model: str, chat: Chat) -> bool:
    """Whether the engine's input processor finds the system turn of ``chat`` (the ``system`` role needs
    the tokenizer's chat delimiters among its special tokens)."""
    from transformers import AutoTokenizer

    from engine.core.input_processor import InputProcessor

    tok = AutoTokenizer.from_pretrained(model)
    ids = list(tok(chat.prompt)["input_ids"])
    proc = InputProcessor(tok, len(tok), A.BLOCK_SIZE, len(ids) + 1)
    return proc.system_span(ids) is not None


def run_arm(cfg: SystemPromptConfig, arm: A.Arm, chats: list[Chat]) -> tuple[list[str], float]:
    """Greedy answers of one arm to ``chats`` (all queued at once)."""
    longest = max(c.n_tokens for c in chats) + cfg.max_new_tokens
    anchor_blocks = -(-max(c.system_end for c in chats) // A.BLOCK_SIZE) + 1
    per_seq = (A.blocks_for_stream(cfg.window, cfg.chunk, 1 + anchor_blocks) if arm.evicts
               else -(-longest // A.BLOCK_SIZE) + 1)
    policy = arm.policy(cfg.window)
    if arm.name == SYSTEM_ROLE.name:
        policy = dataclasses.replace(policy, protected_token_roles=("sink", "system"))
    seqs = len(chats)
    engine = A.make_engine(cfg.model, policy, cfg.chunk, seqs * per_seq + 1, seqs)
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0)
    for k, c in enumerate(chats):
        anchors = [(0, c.system_end)] if arm.anchor else None
        engine.add_request(str(k), c.prompt, params, anchors=anchors)
    texts = {str(k): "" for k in range(len(chats))}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text
    wall = time.perf_counter() - t0
    engine.shutdown()
    return [texts[str(k)] for k in range(len(chats))], wall


def run_system_prompt(cfg: SystemPromptConfig) -> EvalResult:
    """Every arm on the same chats at every length; returns the result (not yet written)."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    ctx = A.trained_context(cfg.model)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"--model {cfg.model}: the tokenizer has no chat template; the system-prompt eval needs a "
                         f"chat model")
    rows: list[dict[str, Any]] = []
    per_chat: list[dict[str, Any]] = []
    notes: list[str] = []
    rate: dict[tuple[str, float], float] = {}
    for mult in cfg.lengths:
        n = int(round(mult * ctx)) - cfg.max_new_tokens
        chats = [build_chat(tok, NAMES[k % len(NAMES)], n, seed=7 * k) for k in range(cfg.trials)]
        for arm in (a for a in ARMS if a.name in cfg.arms):
            if not arm.evicts and n + cfg.max_new_tokens > ctx:
                continue
            if arm.name == SYSTEM_ROLE.name and not _system_span_resolves(cfg.model, chats[0]):
                note = (f"{arm.name} not run: the engine finds no system turn in this tokenizer's chat (its special "
                        f"tokens give no chat delimiters), so the `system` role would pin nothing")
                if note not in notes:
                    notes.append(note)
                continue
            texts, wall = run_arm(cfg, arm, chats)
            ok = [followed(t, c.name) for t, c in zip(texts, chats)]
            rate[(arm.name, mult)] = sum(ok) / len(ok)
            reach = cfg.window + cfg.chunk + A.BLOCK_SIZE
            rows.append({"arm": arm.name, "L": int(round(mult * ctx)), "x_context": mult, "chats": len(chats),
                         "followed": f"{sum(ok)}/{len(ok)}", "rate": sum(ok) / len(ok),
                         "system turn out of the window": (arm.evicts and min(c.n_tokens for c in chats)
                                                           - chats[0].system_end > reach),
                         "wall_s": round(wall, 1)})
            per_chat += [{"arm": arm.name, "L": int(round(mult * ctx)), "name": c.name, "tokens": c.n_tokens,
                          "system_end": c.system_end, "name_token": c.name_token, "answer": t, "followed": o}
                         for c, t, o in zip(chats, texts, ok)]
            logger.info("system-prompt %s L=%gx: %d/%d (%.1fs)", arm.name, mult, sum(ok), len(ok), wall)
    dense = [r for (a, m), r in rate.items() if a == A.DENSE.name]
    longest = max(cfg.lengths)
    kept = rate.get((SYSTEM_ANCHOR.name, longest), rate.get((SYSTEM_ROLE.name, longest)))
    if dense and kept is not None:
        notes.append(f"system prompt retained at {longest:g}x: followed {kept:.2f} vs dense in context "
                     f"{max(dense):.2f}")
    panels = [Panel(title=f"system prompt followed vs chat length (W={cfg.window}, chunk {cfg.chunk})",
                    xlabel="chat length (x trained context)", ylabel="instruction followed", logx=True,
                    series=[Series(a.name, [m for m in cfg.lengths if (a.name, m) in rate],
                                   [rate[(a.name, m)] for m in cfg.lengths if (a.name, m) in rate])
                            for a in ARMS if any((a.name, m) in rate for m in cfg.lengths)],
                    ylim=(-0.03, 1.03))]
    meta = {"model": cfg.model, "trained_context": ctx, "lengths": list(cfg.lengths), "trials": cfg.trials,
            "window": cfg.window, "prefill_chunk": cfg.chunk, "block_size": A.BLOCK_SIZE,
            "sinks": list(A.SINK_POSITIONS), "instruction": SYSTEM, "question": QUESTION,
            "wall_s_total": round(time.perf_counter() - t0, 1)}
    columns = list(rows[0]) if rows else []
    return EvalResult("system_prompt", "System prompt retained past the trained context", columns, rows, meta,
                      notes, panels=panels, extra={"per_chat": per_chat})

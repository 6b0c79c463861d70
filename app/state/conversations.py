"""Server-side conversations (sessions): a turn sends only its new message.

The store keeps, per conversation, the token ids of every earlier turn (prompts and the model's
answers), the anchors that applied (token ranges of that history, so they stay pinned on every
later turn), the model version, and per turn the pool, its cache-policy version and how many prompt
tokens the replica's prefix cache served::

    turn 1  "The pass key is 48213. ..."   history []             -> prompt = t1           answer a1
    turn 2  "<more text>"                   history t1 a1          -> prompt = t1 a1 t2     answer a2
    turn 3  "Question: ... pass key is"     history t1 a1 t2 a2    -> prompt = t1 a1 t2 a2 t3
            (anchors of turn 1 are token ranges of that history: still pinned)

Every turn sends the whole history to the pool; the affinity router (``app/pool/affinity.py``) sends it
to the replica that served the previous turn, whose prefix cache already holds those blocks, so
only the new tokens are prefilled. If that replica is gone the next one prefills the history from
these ids. A turn is committed only when it finished; a failed or abandoned turn leaves the
conversation as it was (the client may send it again). One turn at a time per conversation
(a second one meanwhile is a 409): the turn's lock holds a random owner token, and only that
token releases it, so a turn whose lock expired cannot release the next turn's. A turn whose save
fails answers an error (a 503, or an SSE error event instead of ``[DONE]``) and leaves the
conversation as it was: the save is one write of the whole record, so the client may send the turn
again.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from app.state.base import Store

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
HEADER = "x-sinkserve-conversation"


@dataclass(frozen=True)
class Turn:
    request_id: str
    new_tokens: int  # tokens this turn's message added to the history
    prompt_tokens: int  # the whole prompt the pool received (history + new)
    completion_tokens: int
    cached_tokens: int  # of prompt_tokens, served from the replica's prefix cache
    pool: str
    policy_version: str  # the pool's cache policy (its protection set) when the turn ran
    finish_reason: str | None


@dataclass(frozen=True)
class Conversation:
    id: str
    tenant: str
    created: float
    version: str | None = None  # model version, fixed by the first turn
    kind: str | None = None  # "chat" | "completion", fixed by the first turn
    token_ids: tuple[int, ...] = ()
    anchors: tuple[tuple[int, int], ...] = ()
    turns: tuple[Turn, ...] = field(default_factory=tuple)

    def with_turn(self, prompt_ids: tuple[int, ...], completion_ids: tuple[int, ...], anchors: tuple[tuple[int, int], ...],
                  version: str, kind: str, turn: Turn) -> "Conversation":
        """The conversation after a finished turn: its prompt and answer appended."""
        return replace(self, version=version, kind=kind, token_ids=tuple(prompt_ids) + tuple(completion_ids),
                       anchors=tuple(anchors), turns=self.turns + (turn,))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Conversation":
        d = json.loads(raw)
        return cls(id=d["id"], tenant=d["tenant"], created=d["created"], version=d.get("version"), kind=d.get("kind"),
                   token_ids=tuple(d["token_ids"]), anchors=tuple(tuple(a) for a in d["anchors"]),
                   turns=tuple(Turn(**t) for t in d["turns"]))

    def summary(self) -> dict[str, Any]:
        """What ``GET /v1/conversations/{id}`` shows (no token ids)."""
        return {"id": self.id, "object": "conversation", "created": int(self.created), "model_version": self.version,
                "kind": self.kind, "tokens": len(self.token_ids), "anchors": [list(a) for a in self.anchors],
                "turns": [asdict(t) for t in self.turns]}


class ConversationStore:
    """Conversations in the store, each under ``conversation:<id>``, forgotten ``ttl_s`` after
    their last turn. A conversation belongs to the tenant that created it; to any other it does
    not exist."""

    def __init__(self, store: Store, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s

    def create(self, tenant: str) -> Conversation:
        conv = Conversation(id="conv-" + secrets.token_hex(12), tenant=tenant, created=time.time())
        self.store.put("conversation:" + conv.id, conv.to_json(), self.ttl_s)
        return conv

    def load(self, conv_id: str, tenant: str) -> Conversation | None:
        raw = self.store.get("conversation:" + conv_id)
        if raw is None:
            return None
        conv = Conversation.from_json(raw)
        return conv if conv.tenant == tenant else None

    def save(self, conv: Conversation) -> None:
        self.store.put("conversation:" + conv.id, conv.to_json(), self.ttl_s)

    def delete(self, conv_id: str, tenant: str) -> bool:
        if self.load(conv_id, tenant) is None:
            return False
        return self.store.delete("conversation:" + conv_id)

    @staticmethod
    def new_lock_token() -> str:
        """A fresh owner token for :meth:`lock`. The caller holds it before the write, so a claim
        whose reply was lost (the store died after taking it) can still be released."""
        return secrets.token_hex(16)

    def lock(self, conv_id: str, ttl_s: float, token: str | None = None) -> str | None:
        """Claim the conversation for one turn: the owner token that releases it, or None when a
        turn is already running. The lock expires after ``ttl_s`` whatever happens to its owner."""
        token = token or self.new_lock_token()
        return token if self.store.put_if_absent("conversation-turn:" + conv_id, token.encode(), ttl_s) else None

    def unlock(self, conv_id: str, token: str) -> bool:
        """Release the turn lock if ``token`` still owns it (False: it expired, maybe taken by another turn)."""
        return self.store.delete_if("conversation-turn:" + conv_id, token.encode())


MARK = "\x00sinkserve-turn\x00"


def chat_continuation(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The text that continues a chat after the model's last answer: the end of that assistant
    message, ``messages`` rendered, and the next assistant prompt -- cut out of the model's own
    template so every turn is rendered the way the template renders a whole conversation.

    Plain transcript (a tokenizer without a template)::

        "system: s\\nassistant: <answer>" + "\\nuser: hi\\nassistant:"   <- this part
    """
    base = [{"role": "system", "content": "s"}, {"role": "assistant", "content": MARK}]
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    else:
        full = "\n".join(f"{m['role']}: {m['content']}" for m in base + messages) + "\nassistant:"
    return full[full.index(MARK) + len(MARK):]

"""The engine in its own process: ``EngineProcess`` has ``AsyncLLMEngine``'s interface, while
``LLMEngine`` (scheduler, KV cache, model) steps in a child process.

Why: in one process the engine's step thread holds the GIL for most of every step (with a small
model nearly all of it is Python), so the serving loop beside it -- taking requests off the wire,
streaming tokens out -- waits up to a switch interval each time it wakes. With the engine in a child
the serving loop never waits for the model and the model never waits for the serving loop; the
price is one pipe message per step. (vLLM moved its engine core to a separate process for the same
reason.)

    serving process (asyncio loop)              engine process
    ------------------------------              --------------
    generate() --- AddRequest(id, prompt, ...) -->  receiver thread -> inbox
    abort()    --- AbortRequest(id) ------------>      |
    set_cache_policy() -- SetPolicy(p) -------->      v
                                                 main thread: drain inbox, step(),
    reader (loop.add_reader) <-- StepResult(deltas, stats) -- at most one per step, deltas held
                                                                up to STREAM_INTERVAL_S (see below)
                             <-- Rejected(id, field, message) -- invalid request
                             <-- Failed(id, reason) -- admission raised (a bug; the engine goes on)

The child exits when the pipe closes (the serving process died) and the parent marks the engine dead
when the child does, so neither outlives the other unnoticed. Start:
``python -m engine.frontend.engine_process <fd>`` with one end of a socket pair; the config is the first
message, ``Ready(stats)`` or ``LoadFailed(traceback)`` the answer. Every message is one of the
frozen dataclasses below (pickled by ``multiprocessing.connection``), never a tagged tuple.

Deltas are held in the child for up to ``STREAM_INTERVAL_S`` and go out merged (one delta per request,
``DeltaBatch``): on a small model a decode step is ~0.3 ms, and a message per step cost more than the
step's Python -- the write that wakes the serving process took a quarter of the engine process's time,
and every message wakes the pool replica and the ingress once more (docs/fast_step.md, "Fifth pass").
What a reader waits on goes out at once: a request's first delta (time to first token), its last (or
an abort), a step after requests arrived or were aborted, and everything when the engine goes idle.
A held delta waits at most about ``STREAM_INTERVAL_S``: it goes out after the step that would take it
past that, judged by the last step's length. Worked example, one request of 64 tokens, steps of
0.35 ms, interval 4 ms (a delta made after step k waits while (steps since it was made + 1) x 0.35 ms
< 4 ms)::

    after step   1    2 .. 12   13         14 .. 24   25          ...  61          62 63   64
    message      t1   (held)    t2..t13    (held)     t14..t25    ...  t50..t61    (held)  t62..t64 (finished: at once)

Seven messages instead of 64. A client sees tokens in bursts at most ~4 ms apart (a screen refreshes
every ~16 ms); the ingress's inter-token latency metric spreads a burst's gap over its tokens
(``app.http.ingress._Timing``), so its mean is unchanged. With 16 streams a step takes a few ms and every
message carries one or two steps.

Each ``StepResult`` sent carries the engine's stats snapshot only when it can matter to a reader: at
most ``STATS_INTERVAL_S`` after the last one while requests run, and always with a request's last
delta, after requests arrived or were aborted, and when the engine goes idle -- so a snapshot read
after a request's last delta, or while nothing runs, is exact. (Building and pickling the snapshot is
~20 us, a tenth of a decode step of a small model.)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, AsyncIterator, Iterable, Sequence as Seq

from engine.config import CachePolicy, EngineConfig
from engine.frontend.grammar_admission import GrammarAdmission
from engine.errors import (EngineDeadError, EngineUnavailableError, InvalidRequestError, ModelLoadError,
                           RequestAbortedError, RequestFailedError, stream_error)
from engine.core.input_processor import Anchor
from engine.frontend.deltas import ChoiceStreams
from engine.frontend.token_bus import Address, ThreadOutbox
from engine.outputs import DeltaBatch, TokenDelta
from engine.sampling_params import SamplingParams
from engine.worker.sparse_config import policy_version as sparse_policy_version
from engine.core.stats import EngineStats

logger = logging.getLogger(__name__)


# ---- messages: serving process -> engine process ------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    anchors: tuple[Anchor, ...] = ()
    session: str | None = None  # the conversation it is a turn of (session KV)
    # A token-bus inbox (engine/frontend/token_bus.py): the request's deltas, or the error that ends it,
    # go there straight from this process, and ``Done`` comes back over the pipe. None: over the pipe.
    reply_to: Address | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class SetPolicy:
    policy: CachePolicy


@dataclass(frozen=True)
class Stop:
    """Finish: shut the engine down and exit (also what a closed pipe means)."""


@dataclass(frozen=True)
class _Wake:
    """Inside the child only: a grammar compile ended (engine/frontend/grammar_admission.py)."""


# ---- messages: engine process -> serving process ------------------------------------------------


@dataclass(frozen=True)
class Ready:
    stats: EngineStats


@dataclass(frozen=True)
class LoadFailed:
    traceback: str


STATS_INTERVAL_S = 0.05
WATCHDOG_S = 60.0  # default: an engine that holds work and says nothing this long is hung (see EngineProcess)  # how stale the serving side's stats may be while requests run
STREAM_INTERVAL_S = 0.004  # how long a delta may wait in the child for the next steps' (see above)


@dataclass(frozen=True)
class StepResult:
    """The deltas of the steps since the last message, ``(request, delta)`` in order, each choice's merged
    (``DeltaBatch``), and the stats after the last step (None: unchanged as far as a reader needs, see
    above)."""

    outputs: list[tuple[str, TokenDelta]]
    stats: EngineStats | None


@dataclass(frozen=True)
class Rejected:
    request_id: str
    field: str
    message: str


@dataclass(frozen=True)
class Failed:
    """A request that could not be admitted for a reason of the engine's, not the request's, or that failed
    inside the engine alone (engine/isolation.py): a 500."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Aborted:
    """The engine aborted a request that its reader had not given up."""

    request_id: str


@dataclass(frozen=True)
class Done:
    """A token-bus request's last item -- its finished delta, or the error that ended it -- is on its way
    to the inbox (handed to the writer; the ingress waits a grace period for it)."""

    request_id: str


@dataclass(frozen=True)
class EngineDied:
    traceback: str


class EngineProcess:
    """``AsyncLLMEngine``'s interface (``generate``, ``abort``, ``stats``, ``check_health``,
    ``set_cache_policy``, ``shutdown``, ``tokenizer``, ``config``) over an engine in a child process.

    The constructor blocks until the child has loaded the model (like building the engine
    in-process would), and raises ``ModelLoadError`` with the child's traceback if it could not.

    Watchdog: while the child holds work it reports at least every ``STATS_INTERVAL_S`` after each
    step, so a child that holds work and has said nothing for ``watchdog_s`` is hung (a step that never
    returns: a deadlock, a kernel that spins). It is killed, its requests get ``EngineDeadError``
    ("engine hung ...", HTTP 503), and ``hung`` says so; the owner starts a new one. "Holds work" is the
    child's own last report (running or waiting requests) or a request sent since then.
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 900.0, watchdog_s: float = WATCHDOG_S) -> None:
        if watchdog_s <= 0:
            raise ValueError(f"watchdog_s must be > 0, got {watchdog_s}")
        # Resolved here (a GGUF converted once, here) so the child and this side's tokenizer read one directory.
        self._config = config = config.with_model_resolved()
        self.watchdog_s = watchdog_s
        self.hung = False  # the watchdog killed it
        self._heard_at = time.monotonic()  # the child's last message
        self._sent_at: float | None = None  # the first request sent since then
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.frontend.engine_process", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(config)
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise ModelLoadError(f"engine process did not load {config.model!r} within {start_timeout_s:.0f}s")
        try:
            answer = self._conn.recv()
        except EOFError:
            answer = LoadFailed(f"engine process exited with code {self._proc.wait()}")
        if not isinstance(answer, Ready):
            self._proc.wait()
            reason = answer.traceback.strip().splitlines()[-1]  # the exception line first, the traceback after
            raise ModelLoadError(f"engine process could not start: {reason}\n{answer.traceback}")
        self._stats: EngineStats = answer.stats
        self._queues: dict[str, asyncio.Queue[TokenDelta | BaseException]] = {}
        self._bus: dict[str, asyncio.Future[None]] = {}  # token-bus requests -> resolved by Done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._attach()
        logger.info("engine process %d ready (%s)", self._proc.pid, config.model)

    # ---- AsyncLLMEngine's interface -------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        anchors: Iterable[Any] | None = None,
        session: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request (its ``n`` choices: the child fans out,
        engine/frontend/deltas.py); an invalid request raises ``InvalidRequestError`` before the first
        delta, and leaving early aborts it in the engine (its blocks are freed)."""
        self.check_health()
        self._attach()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:  # the child would refuse it too, but this queue is the first one's
            raise InvalidRequestError("request_id", f"request {request_id!r} is already in flight")
        q: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        done = False  # the engine is through with it (finished, aborted, never admitted)
        try:
            self._send(AddRequest(request_id, prompt if isinstance(prompt, str) else tuple(prompt), params,
                                  tuple(anchors or ()), session))
            if self._sent_at is None:
                self._sent_at = time.monotonic()
            while not done:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                done = item.finished
                yield item
        except (RequestAbortedError, RequestFailedError, InvalidRequestError):
            done = True
            raise
        finally:
            self._queues.pop(request_id, None)
            if not done and self._dead is None:
                self._send(AbortRequest(request_id))

    async def stream(
        self,
        reply_to: Address,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str,
        anchors: Iterable[Any] | None = None,
        session: str | None = None,
    ) -> None:
        """Run one request whose deltas -- or the error that ends it -- the engine process writes to the
        token-bus inbox ``reply_to`` itself (one process crossing per token); returns when its last item is
        on its way. Raises ``EngineDeadError`` when the engine dies first (its reader learns it from the
        caller); cancelling aborts the request in the engine."""
        self.check_health()
        self._attach()
        if request_id in self._queues or request_id in self._bus:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already in flight")
        assert self._loop is not None, "stream() runs on an event loop"
        done = self._bus[request_id] = self._loop.create_future()
        finished = False
        try:
            self._send(AddRequest(request_id, prompt if isinstance(prompt, str) else tuple(prompt), params,
                                  tuple(anchors or ()), session, reply_to))
            if self._sent_at is None:
                self._sent_at = time.monotonic()
            await done
            finished = True
        finally:
            self._bus.pop(request_id, None)
            if not finished and self._dead is None:
                self._send(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))
        self._send(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or the last request it took while idle)."""
        return self._stats

    def check_health(self) -> None:
        if self._dead is None and self._proc.poll() is not None:
            self._die(f"engine process exited with code {self._proc.returncode}")
        if self._dead is not None:
            raise EngineUnavailableError(self._dead)

    def set_cache_policy(self, policy: CachePolicy) -> str:
        """Validated here (a bad policy raises now), applied by the child before its next step."""
        policy.validate(self._config.block_size)
        self._attach()
        self._send(SetPolicy(policy))
        # Messages are ordered: every step after this one runs under ``policy``, so say so now -- with the
        # window and sparse budgets resolved as the child resolves them (engine/limits.py).
        from engine.limits import limits_for_policy, read_model_config

        limits = limits_for_policy(self._config, read_model_config(self._config.model), policy)
        resolved = limits.resolve(replace(self._config, cache_policy=policy))
        version = sparse_policy_version(resolved.cache_policy.version, resolved.sparse)
        self._stats = replace(self._stats, policy_version=version)
        return version

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``drain_timeout`` seconds), then stop the child."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while (self._queues or self._bus) and self._dead is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._dead is None:
            self._send(Stop())
        try:
            await asyncio.to_thread(self._proc.wait, 10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._die("engine was shut down", logging.INFO)

    # ---- internals ------------------------------------------------------------------------------

    def _attach(self) -> None:
        # The reader runs on the event loop of whoever uses the engine first (Serve's replica loop),
        # so stats and deltas are read there; called outside a loop, it waits for the next call.
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._loop.add_reader(self._conn.fileno(), self._on_readable)
            # uvloop (Serve's loop) makes a watched fd non-blocking (libuv's uv_poll_init): a send larger
            # than the socket's buffer -- a long prompt -- then failed with EAGAIN part-written, and a
            # message read half-arrived failed alike, each ending the engine (503 "engine process
            # unreachable: [Errno 11]", found by schemathesis). The pipe stays blocking: the child drains
            # it in a thread (_receive_forever), so a send waits at most for that thread.
            os.set_blocking(self._conn.fileno(), True)
            self._loop.call_later(self._watch_period, self._watch)

    @property
    def _watch_period(self) -> float:
        return min(1.0, self.watchdog_s / 4)

    def silent_for(self, now: float | None = None) -> float:
        """Seconds the child has held work without a word (0 when it holds none)."""
        now = time.monotonic() if now is None else now
        if self._stats.running or self._stats.waiting:
            return now - self._heard_at
        return 0.0 if self._sent_at is None else now - self._sent_at

    def _watch(self) -> None:
        if self._dead is not None:
            return
        silent = self.silent_for()
        if silent > self.watchdog_s:
            self.hung = True
            held = self._stats.running + self._stats.waiting
            self._proc.kill()
            try:
                self._proc.wait(5)  # SIGKILL: reaped in milliseconds
            except subprocess.TimeoutExpired:
                pass
            self._die(f"engine hung: no step for {silent:.1f}s while holding work ({held} requests at its last "
                      f"report, {len(self._queues) + len(self._bus)} streams open; watchdog_s={self.watchdog_s:g}); it was killed")
            return
        assert self._loop is not None
        self._loop.call_later(self._watch_period, self._watch)

    def _send(self, msg: AddRequest | AbortRequest | SetPolicy | Stop) -> None:
        try:
            self._conn.send(msg)
        except OSError as e:
            self._die(f"engine process unreachable: {e}")

    def _on_readable(self) -> None:
        # Every step that is ready is read before any delta is handed on, and each choice's deltas from
        # those steps go on as one (DeltaBatch): when this loop falls behind the engine it catches up
        # in one wake-up per request, not one per step. Whatever is ready goes out now, so a stream is
        # never held back.
        ready = DeltaBatch()
        self._heard_at, self._sent_at = time.monotonic(), None
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if isinstance(msg, StepResult):
                    if msg.stats is not None:
                        self._stats = msg.stats
                    for rid, delta in msg.outputs:
                        ready.add(rid, delta)
                    continue
                if isinstance(msg, Done):
                    fut = self._bus.get(msg.request_id)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                    continue
                self._hand_on(ready)  # a request's deltas before the message that ends it
                ready = DeltaBatch()
                if isinstance(msg, Aborted):
                    q = self._queues.get(msg.request_id)
                    if q is not None:
                        q.put_nowait(RequestAbortedError(f"request {msg.request_id} was aborted"))
                elif isinstance(msg, Rejected):  # a request that never ran: no deltas of its own
                    q = self._queues.get(msg.request_id)
                    if q is not None:
                        q.put_nowait(InvalidRequestError(msg.field, msg.message))
                elif isinstance(msg, Failed):
                    q = self._queues.get(msg.request_id)
                    if q is not None:
                        q.put_nowait(RequestFailedError(msg.request_id, msg.reason))
                elif isinstance(msg, EngineDied):
                    self._hand_on(ready)
                    self._die(f"engine loop died: {msg.traceback}")
                    return
        except (EOFError, OSError):
            self._hand_on(ready)
            code = self._proc.poll()  # the pipe can close a moment before the exit is reaped
            self._die("engine process exited" + (f" with code {code}" if code is not None else ""))
            return
        self._hand_on(ready)

    def _hand_on(self, ready: DeltaBatch) -> None:
        for rid, delta in ready.items():
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(delta)

    def _die(self, reason: str, level: int = logging.ERROR) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        logger.log(level, "%s", reason)
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._bus.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))


# ---- the child ----------------------------------------------------------------------------------


def _receive_forever(conn: Connection, inbox: queue.SimpleQueue) -> None:
    """Keep the pipe drained while the main thread steps, so a sender never blocks on a full pipe."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(Stop())


def serve_engine(conn: Connection) -> None:
    """The child's main loop: take what arrived, step, send the deltas; block only when idle. A request
    with ``reply_to`` streams on the token bus (``ThreadOutbox``) and is closed with ``Done`` over the pipe;
    the others' deltas and refusals go over the pipe."""
    from engine.core.detokenizer import token_text
    from engine.core.engine import LLMEngine

    config = conn.recv()
    try:
        engine = LLMEngine(config)
    except BaseException:  # noqa: BLE001 - the parent shows this traceback as the load error
        conn.send(LoadFailed(traceback.format_exc()))
        return
    # Everything loaded so far (model, tokenizer, modules) lives as long as the process: move it out
    # of the collector's reach so the collections that steps trigger stay small.
    gc.collect()
    gc.freeze()
    conn.send(Ready(engine.stats()))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive_forever, args=(conn, inbox), daemon=True, name="engine-inbox").start()
    # Requests with response_format wait here until their grammar is compiled, off the step (made with
    # the first such request).
    admission: GrammarAdmission[AddRequest] | None = None
    streams = ChoiceStreams(lambda: token_text(engine.tokenizer))  # n fan-out, deltas with token strings
    outbox = ThreadOutbox()
    reply: dict[str, Address] = {}  # open token-bus requests -> their inbox

    def stats() -> EngineStats:
        return replace(engine.stats(), token_bus_frames=outbox.frames, token_bus_deltas=outbox.deltas)

    def ended(request_id: str, error: Exception, reply_to: Address | None) -> None:
        """Tell the reader that ``error`` ended its request: on the bus (then ``Done``), or over the pipe."""
        if reply_to is not None:
            outbox.send(reply_to, [(request_id, stream_error(error))])
            conn.send(Done(request_id))
        elif isinstance(error, InvalidRequestError):
            conn.send(Rejected(request_id, error.field, error.message))
        elif isinstance(error, RequestAbortedError):
            conn.send(Aborted(request_id))
        else:
            conn.send(Failed(request_id, error.reason if isinstance(error, RequestFailedError) else str(error)))

    def admit(msg: AddRequest) -> None:
        try:
            choices = streams.open(msg.request_id, msg.params)
        except ValueError as e:
            ended(msg.request_id, InvalidRequestError("request_id", str(e)), msg.reply_to)
            return
        try:
            for eid, params in choices:
                # a session's KV is one conversation's: restored and saved for a single choice only
                engine.add_request(eid, msg.prompt, params, msg.anchors,
                                   session=msg.session if len(choices) == 1 else None)
        except Exception as e:  # noqa: BLE001 - reported below; one request's admission must not end the engine
            for eid in streams.close(msg.request_id):
                engine.abort(eid)
            if isinstance(e, InvalidRequestError):
                ended(msg.request_id, e, msg.reply_to)
            elif isinstance(e, (TypeError, ValueError)):
                ended(msg.request_id, InvalidRequestError("sampling", str(e)), msg.reply_to)
            else:
                logger.exception("request %s: admission failed", msg.request_id)
                ended(msg.request_id, RequestFailedError(msg.request_id, f"admission failed: {type(e).__name__}: {e}"),
                      msg.reply_to)
            return
        if msg.reply_to is not None:
            reply[msg.request_id] = msg.reply_to

    def end(request_id: str) -> None:
        """The reader gave up (or the request failed): its choices still running are aborted."""
        for eid in streams.close(request_id):
            engine.abort(eid)

    stats_at = 0.0  # when the last snapshot went out (monotonic)
    held = DeltaBatch()  # deltas not sent yet, each choice's merged
    held_since = 0.0  # when the oldest of them was made

    def flush(with_stats: bool) -> None:
        """Send what is held: bus requests' deltas to their inboxes (one frame per inbox), the others'
        over the pipe, with the stats snapshot when asked (taken after the frames are counted); then
        ``Done`` for the bus requests that finished."""
        nonlocal held
        pipe: list[tuple[str, TokenDelta]] = []
        lanes: dict[Address, list[tuple[str, TokenDelta]]] = {}
        done: list[str] = []
        for rid, delta in held.items():
            address = reply.get(rid)
            if address is None:
                pipe.append((rid, delta))
                continue
            lanes.setdefault(address, []).append((rid, delta))
            if delta.finished:
                done.append(rid)
                del reply[rid]
        held = DeltaBatch()
        for address, batch in lanes.items():
            outbox.send(address, batch)
        if pipe or with_stats:
            conn.send(StepResult(pipe, stats() if with_stats else None))
        for rid in done:
            conn.send(Done(rid))

    while True:
        msgs = []
        if not engine.has_unfinished():  # idle: block for a message (or a grammar's deadline)
            try:
                msgs.append(inbox.get(timeout=admission.next_deadline() if admission is not None else None))
            except queue.Empty:
                pass
        while not inbox.empty():
            msgs.append(inbox.get())
        for msg in msgs:
            if isinstance(msg, AddRequest):
                so = msg.params.structured_output
                if so is None:
                    admit(msg)
                    continue
                if admission is None:
                    admission = GrammarAdmission(engine.grammar, engine.shape.vocab_size,
                                                 on_done=lambda: inbox.put(_Wake()))
                try:
                    admission.submit(msg.request_id, so, msg)
                except InvalidRequestError as e:
                    ended(msg.request_id, e, msg.reply_to)
            elif isinstance(msg, AbortRequest):
                if admission is None or not admission.discard(msg.request_id):
                    end(msg.request_id)
                reply.pop(msg.request_id, None)  # its reader is gone: nothing more to tell it
            elif isinstance(msg, SetPolicy):
                engine.set_cache_policy(msg.policy)
            elif isinstance(msg, Stop):
                flush(False)
                outbox.close()
                if admission is not None:
                    admission.shutdown()
                engine.shutdown()
                return
        if admission is not None and len(admission):
            ready, refused = admission.poll()
            for msg in ready:
                admit(msg)
            for msg, reason in refused:
                ended(msg.request_id, InvalidRequestError("response_format", reason), msg.reply_to)
            if ready or refused:
                msgs.append(_Wake())  # stats go out with this step (a request arrived or left)
        started = time.monotonic()
        try:
            outputs = engine.step() if engine.has_unfinished() else []
        except Exception:  # noqa: BLE001 - the parent fails every stream and its health check
            logger.exception("engine step failed")
            flush(False)
            outbox.close()
            conn.send(EngineDied(traceback.format_exc(limit=5)))
            return
        now = time.monotonic()
        urgent = last = False
        for out in outputs:
            taken = streams.take(out)
            if taken is None:  # a choice of a request that ended a moment ago
                continue
            rid, item = taken
            if isinstance(item, Exception):  # the engine aborted or failed a choice: the request ends
                end(rid)
                flush(False)  # its deltas before what ends it
                ended(rid, item, reply.pop(rid, None))
                last = True
                continue
            if not held:
                held_since = now
            held.add(rid, item)
            # A choice's first delta (its tokens are all it has) and its last go out at once.
            last = last or item.finish_reason is not None
            urgent = urgent or item.completion_tokens <= len(item.token_ids)
        with_stats = bool(msgs) or last or not engine.has_unfinished() or now - stats_at >= STATS_INTERVAL_S
        if with_stats or (held and (urgent or now + (now - started) - held_since >= STREAM_INTERVAL_S)):
            if with_stats:
                stats_at = now
            flush(with_stats)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s")
    conn = Connection(int(sys.argv[1]))
    try:
        serve_engine(conn)
    except (BrokenPipeError, ConnectionResetError):  # the serving process is gone
        pass
    os._exit(0)  # no interpreter teardown: nothing left to flush, and torch's can hang


if __name__ == "__main__":
    # Run the imported module's main, not this ``__main__`` copy: the message classes must be the
    # ones the parent pickles (``engine.frontend.engine_process.AddRequest``), or isinstance checks miss.
    from engine.frontend.engine_process import main as module_main

    module_main()

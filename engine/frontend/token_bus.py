"""Token bus: token deltas from the engine's front to ingress replicas, one TCP connection per pair and
one frame per engine message (a step's deltas; at one stream a few steps' merged, held up to
``engine.frontend.engine_process.STREAM_INTERVAL_S``), beside the Serve handle call that still carries
the request.

Why: every item a Serve streaming handle yields costs a gRPC message, a pickle and a few event-loop
wakeups on each side, per token per hop -- on small models as much as the engine's own work per token
(figures: docs/serving.md). Eight streams meant eight messages per engine step.
On the bus, the deltas one step makes for the streams of one ingress replica travel as one frame --
first tokens included, so a burst of requests prefilled in one step gets its first tokens in one frame.

The writer is wherever the engine steps, so a token crosses one process boundary to reach the ingress:
at TP = 1 the engine's own process (``ThreadOutbox``: the engine loop never waits on a socket), at TP > 1
the pool replica that drives the workers (``TokenOutbox``, on its event loop)::

    ingress replica                     pool replica                      engine process (TP = 1)
    ---------------                     ------------                      -----------------------
    handle.generate(PoolRequest(reply_to=inbox)) --> LLMServer.generate
                                          AddRequest(reply_to) ---pipe--> step, deltas
    TokenInbox  <== frame [(request_id, TokenDelta | StreamError), ...] ==== ThreadOutbox
                                          <---pipe--- Done(request_id)
        <-- the call returns ---------------

The Serve call stays open for the whole request, so Serve's queue caps, backpressure, autoscaling
metrics and cancellation behave as before: cancelling it (client gone, timeout) aborts the request in
the engine. What the engine has to say -- deltas, and the ``StreamError`` that refuses or ends a request
-- travels on the bus, in order; the pool replica writes on it only what the engine cannot (the engine
died). Frames are msgpack, length-prefixed, in a typed encoding (a delta is its fields in order, an error
its status, message, param, type and Retry-After) -- never pickle, so a frame can only ever become a
``TokenDelta`` or a ``StreamError``. A connection opens with the inbox's secret (compared in constant
time, within ``HANDSHAKE_S`` or the connection is dropped) so nothing else on the network can write into a
stream; a malformed frame closes its connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from engine.errors import StreamError
from engine.outputs import TokenDelta

logger = logging.getLogger("sinkserve.token_bus")

_LEN = struct.Struct("!I")
Address = tuple[str, int, bytes]  # host, port, secret
HANDSHAKE_S = 5.0  # a connection that has not sent the secret by then is dropped
MAX_FRAME = 64 << 20  # bytes; a larger length prefix is not a frame this bus wrote
_DELTA, _ERROR = 0, 1
_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(TokenDelta))


def encode_frame(batch: list[tuple[str, Any]]) -> bytes:
    """``[(request_id, TokenDelta | StreamError), ...]`` as msgpack.

    >>> d = TokenDelta("hi", (1, 2), None, True, "stop", 3, 2, top_logprobs=((("a", -0.1),),))
    >>> e = StreamError(429, "slow down", retry_after=3)
    >>> decode_frame(encode_frame([("r1", d), ("r2", e)])) == [("r1", d), ("r2", e)]
    True
    """
    out = []
    for request_id, item in batch:
        if isinstance(item, TokenDelta):
            out.append((request_id, _DELTA, [getattr(item, f) for f in _DELTA_FIELDS]))
        elif isinstance(item, StreamError):
            out.append((request_id, _ERROR, [item.status, item.message, item.param, item.type, item.retry_after]))
        else:
            raise TypeError(f"the token bus carries TokenDelta and StreamError, not {type(item).__name__}")
    return msgpack.packb(out, use_bin_type=True)


def decode_frame(data: bytes) -> list[tuple[str, TokenDelta | StreamError]]:
    """The inverse of :func:`encode_frame`; ``ValueError`` for anything it did not write."""
    try:
        # Arrays decode as tuples: exactly the shape of TokenDelta's sequence fields.
        items = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
        out: list[tuple[str, TokenDelta | StreamError]] = []
        for request_id, tag, fields in items:
            if not isinstance(request_id, str):
                raise ValueError("request id is not a string")
            if tag == _DELTA:
                out.append((request_id, TokenDelta(*fields)))
            elif tag == _ERROR:
                status, message, param, type_, retry_after = fields
                out.append((request_id, StreamError(int(status), str(message), param, str(type_), retry_after)))
            else:
                raise ValueError(f"unknown item tag {tag!r}")
        return out
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed token-bus frame: {e}") from None


class TokenInbox:
    """Ingress side: a TCP server whose frames are sorted into one queue per open request. ``error``
    turns a ``StreamError`` into what the queue's reader takes (the ingress: ``APIError``)."""

    def __init__(self, error: Callable[[StreamError], Any] = lambda e: e) -> None:
        self._error = error
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._secret = secrets.token_bytes(16)
        self._server: asyncio.Server | None = None
        self.address: Address | None = None
        self.frames = 0
        self.deltas = 0

    async def start(self, host: str) -> Address:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port, self._secret)
        return self.address

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue that ``request_id``'s deltas land in (open it before the request is sent).
        Raises ``ValueError`` if that id is already streaming here (two streams cannot share one)."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            try:
                secret = await asyncio.wait_for(reader.readexactly(len(self._secret)), HANDSHAKE_S)
            except asyncio.TimeoutError:
                logger.warning("token bus: dropped a connection from %s that sent no secret within %g s", peer, HANDSHAKE_S)
                return
            if not hmac.compare_digest(secret, self._secret):
                logger.warning("token bus: refused a connection without the secret from %s", peer)
                return
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if n > MAX_FRAME:
                    logger.warning("token bus: dropped a connection from %s: a %d-byte frame", peer, n)
                    return
                try:
                    batch = decode_frame(await reader.readexactly(n))
                except ValueError as e:
                    logger.warning("token bus: dropped a connection from %s: %s", peer, e)
                    return
                self.frames += 1
                for request_id, item in batch:
                    self.deltas += 1
                    q = self._queues.get(request_id)
                    if q is not None:  # else the request already ended here (cancelled)
                        q.put_nowait(self._error(item) if isinstance(item, StreamError) else item)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class TokenOutbox:
    """A writer on an event loop (the pool replica: an in-process engine's deltas at TP > 1, and the error
    of a request whose engine died): buffers deltas per inbox and writes each buffer as one frame once the
    current event-loop pass is done (so all deltas of one engine step share a frame)."""

    def __init__(self) -> None:
        self._writers: dict[Address, asyncio.StreamWriter] = {}
        self._connecting: dict[Address, asyncio.Future[asyncio.StreamWriter]] = {}
        self._pending: dict[Address, list[tuple[str, Any]]] = {}
        self.frames = 0
        self.deltas = 0

    def send(self, address: Address, request_id: str, delta: Any) -> None:
        batch = self._pending.get(address)
        if batch is None:
            batch = self._pending[address] = []
            asyncio.get_running_loop().call_soon(self._flush, address)
        batch.append((request_id, delta))

    async def drain(self, address: Address) -> None:
        """Wait until what was sent to ``address`` is written to its socket (the pool calls this
        before its Serve call ends, so the last frame usually arrives before the 'done')."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while address in self._pending and loop.time() < deadline:  # written at the end of this pass, or once connected
            await asyncio.sleep(0 if address not in self._connecting else 0.001)
        writer = self._writers.get(address)
        if writer is not None and not writer.is_closing():
            try:
                await writer.drain()
            except ConnectionError:
                pass

    def _flush(self, address: Address) -> None:
        writer = self._writers.get(address)
        if writer is not None and writer.is_closing():  # the ingress went away; connect again
            del self._writers[address]
            writer = None
        if writer is None:
            if address not in self._connecting:
                fut = asyncio.ensure_future(self._connect(address))
                self._connecting[address] = fut
                fut.add_done_callback(lambda f, a=address: self._connected(a, f))
            return  # flushed once connected
        batch = self._pending.pop(address, None)
        if not batch:
            return
        data = encode_frame(batch)
        try:
            writer.write(_LEN.pack(len(data)) + data)
        except (ConnectionError, RuntimeError) as e:
            self._drop(address, e)
            return
        self.frames += 1
        self.deltas += len(batch)

    async def _connect(self, address: Address) -> asyncio.StreamWriter:
        host, port, secret = address
        _, writer = await asyncio.open_connection(host, port)
        writer.write(secret)
        return writer

    def _connected(self, address: Address, fut: asyncio.Future[asyncio.StreamWriter]) -> None:
        self._connecting.pop(address, None)
        if fut.cancelled() or fut.exception() is not None:
            self._drop(address, fut.exception() if not fut.cancelled() else None)
            return
        # Forget connections whose ingress replica has gone (scaled down, restarted): nothing will
        # be sent to them again, since a new replica listens on a new address.
        for gone in [a for a, w in self._writers.items() if w.is_closing()]:
            del self._writers[gone]
        self._writers[address] = fut.result()
        self._flush(address)

    @property
    def connections(self) -> int:
        return len(self._writers)

    def _drop(self, address: Address, error: BaseException | None) -> None:
        # The deltas are lost; their streams end through the Serve call (the ingress then reports
        # an incomplete stream instead of waiting forever).
        lost = self._pending.pop(address, [])
        writer = self._writers.pop(address, None)
        if writer is not None:
            writer.close()
        logger.warning("token bus to %s:%d failed (%s); %d deltas dropped", address[0], address[1], error, len(lost))

    async def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


class ThreadOutbox:
    """The engine process's writer: ``send`` hands a batch to one thread per inbox address, which encodes
    it and writes it as one frame, so the step loop never waits on a socket or on a slow ingress. A lane
    connects on its first frame and again after a failure; frames that cannot be written are dropped
    (their streams end through the Serve call, as the event-loop writer's)."""

    def __init__(self) -> None:
        self._lanes: dict[Address, queue.SimpleQueue[list[tuple[str, Any]] | None]] = {}
        self._threads: list[threading.Thread] = []
        self.frames = 0
        self.deltas = 0

    def send(self, address: Address, batch: list[tuple[str, Any]]) -> None:
        """Queue ``batch`` as one frame to ``address`` (counted now: a snapshot taken after this counts it;
        a frame the lane then fails to write is logged with its deltas)."""
        self.frames += 1
        self.deltas += len(batch)
        lane = self._lanes.get(address)
        if lane is None:
            lane = self._lanes[address] = queue.SimpleQueue()
            t = threading.Thread(target=self._write_forever, args=(address, lane), daemon=True,
                                 name=f"token-bus-{address[0]}:{address[1]}")
            t.start()
            self._threads.append(t)
        lane.put(batch)

    def _write_forever(self, address: Address, lane: queue.SimpleQueue[list[tuple[str, Any]] | None]) -> None:
        host, port, secret = address
        sock: socket.socket | None = None
        while True:
            batch = lane.get()
            if batch is None:
                break
            data = encode_frame(batch)
            try:
                if sock is None:
                    sock = socket.create_connection((host, port), timeout=HANDSHAKE_S)
                    sock.settimeout(None)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(secret)
                sock.sendall(_LEN.pack(len(data)) + data)
            except OSError as e:
                logger.warning("token bus to %s:%d failed (%s); %d deltas dropped", host, port, e, len(batch))
                if sock is not None:
                    sock.close()
                sock = None
        if sock is not None:
            sock.close()

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (each lane within ``timeout_s``), then end the lanes."""
        for lane in self._lanes.values():
            lane.put(None)
        for t in self._threads:
            t.join(timeout_s)

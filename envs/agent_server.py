"""The OpenAI-compatible endpoint of one rollout engine, and the agent programs that call it.

    server = AgentServer("policy")            # one listening port (127.0.0.1), its own thread
    channel = server.open(sampling)           # a session: base_url <server.url>/s/<id>/v1
    server.launch(channel, program, row)      # solve(client, row), client an openai client on it
    kind, payload = channel.next(timeout_s)   # ("call", body) | ("end", value) | ("error", exc)
    channel.respond(200, completion)          # the program's pending call returns
    server.close(channel, why)                # later calls, and a pending one, get an error

A small ASGI app (served by uvicorn, which comes with vLLM) rather than vLLM's own
OpenAI server: that server owns its engine and schedules requests itself, while here the engine
is stepped by rollout.stream's generation loop (weight syncs pause it, every token keeps its
policy version) and each session's tokens are kept exactly (envs.agent_session). The app only
queues a call on its session and waits: rendering and sampling happen on the rollout side.

Async programs run as tasks on one event loop of their own (an `async def` must not block it);
the `openai.AsyncOpenAI` each gets calls the app in process (httpx's ASGI transport: no socket,
no HTTP parsing; a call costs less than half the CPU it costs over TCP). A plain `def` runs in a
thread of its own with an `openai.OpenAI` over TCP, as does any client a program makes from
`client.base_url`. Each session has its own connection (one pool shared by hundreds of sessions
scans all its connections on every request), and the clients never retry (a retried call would
be sampled twice).
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import queue
import socket
import threading
import uuid

from envs.agent_session import error_body, request_problem

_CALL_TIMEOUT_S = 24 * 3600.0  # a call waits for the engine (syncs pause it), never the client


class Channel:
    """One session between its program and the rollout side."""

    def __init__(self, server: "AgentServer", session_id: str, sampling: dict | None):
        self.server, self.id, self.sampling = server, session_id, sampling
        self.url = f"{server.url}/s/{session_id}/v1"
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: asyncio.Future | None = None
        self.closed = ""  # why the session ended ("" while open)
        self.cancel = None  # stops the program (its task), once the session ends

    def next(self, timeout_s: float) -> tuple[str, object]:
        """The program's next move; raises TimeoutError past timeout_s."""
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the program made no call and did not return within "
                               f"{timeout_s:g} s (env.step_timeout_s)") from None

    def respond(self, status: int, content: dict) -> None:
        """Answer the pending call (from any thread)."""
        fut, self.pending = self.pending, None
        if fut is not None:  # on the loop that serves the call (the server's, or the program's)
            fut.get_loop().call_soon_threadsafe(_settle, fut, (status, content))


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's (it comes with vLLM), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _settle(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


class AgentServer:
    def __init__(self, model_name: str):
        import httpx
        import uvicorn

        self.model_name = model_name
        self.channels: dict[str, Channel] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(4096)  # connections queue from now on, before uvicorn accepts them
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = self._app()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                lifespan="off", backlog=4096, timeout_keep_alive=600)
        self._server = uvicorn.Server(config)
        self.loop = _new_loop()
        ready = threading.Event()
        self.loop.call_soon(ready.set)
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="agent-server")
        self._thread.start()
        ready.wait(30)
        self.programs = _new_loop()  # the async programs' loop
        self._programs_thread = threading.Thread(target=self.programs.run_forever, daemon=True,
                                                 name="agent-programs")
        self._programs_thread.start()
        self._ssl = httpx.create_ssl_context()  # made once: ~15 ms a client otherwise

    def _serve(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._server.serve(sockets=[sock]))

    # ------------------------------------------------------------------ sessions
    def open(self, sampling: dict | None) -> Channel:
        """A new session; `sampling` as envs.agent_session.request_problem takes it."""
        channel = Channel(self, f"{self._prefix}{next(self._ids)}", sampling)
        self.channels[channel.id] = channel
        return channel

    def close(self, channel: Channel, why: str) -> None:
        """The session ends: its pending call and every later one get an error, and its
        program is stopped (a task is cancelled; a thread finishes on its own)."""
        if channel.closed:
            return
        channel.closed = why
        self.channels.pop(channel.id, None)
        channel.respond(400, error_body(f"session {channel.id} has ended: {why}",
                                        code="session_ended"))
        if channel.cancel is not None:
            channel.cancel()

    def launch(self, channel: Channel, program, row: dict) -> None:
        """Run program(client, row), its end (value or exception) queued on the channel; its
        client's connection closes when it ends."""
        import httpx
        import openai

        def ended(value=None, error=None):
            channel.events.put(("error", error) if error is not None else ("end", value))

        if inspect.iscoroutinefunction(program):  # the app called in process, on its loop
            http = httpx.AsyncClient(transport=httpx.ASGITransport(self.app),
                                     timeout=_CALL_TIMEOUT_S)
            client = openai.AsyncOpenAI(base_url=channel.url, api_key="rlstack", max_retries=0,
                                        http_client=http)

            async def run():
                try:
                    return await program(client, row)
                finally:
                    await http.aclose()
            fut = asyncio.run_coroutine_threadsafe(run(), self.programs)

            def done(f):
                if not f.cancelled():
                    ended(*((None, f.exception()) if f.exception() else (f.result(), None)))
            fut.add_done_callback(done)
            channel.cancel = lambda: self.programs.call_soon_threadsafe(fut.cancel)
            return
        http = httpx.Client(verify=self._ssl, timeout=_CALL_TIMEOUT_S)
        client = openai.OpenAI(base_url=channel.url, api_key="rlstack", max_retries=0,
                               http_client=http)

        def run_plain():
            try:
                ended(program(client, row))
            except BaseException as e:  # the program's failure ends its trajectory only
                ended(error=e)
            finally:
                http.close()
        threading.Thread(target=run_plain, daemon=True, name=f"agent-{channel.id}").start()

    def stop(self) -> None:
        for channel in list(self.channels.values()):
            self.close(channel, "the rollout engine stopped")
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.programs.call_soon_threadsafe(self.programs.stop)

    # ------------------------------------------------------------------ HTTP
    def _app(self):
        """The ASGI app: POST /s/<id>/v1/chat/completions, GET /s/<id>/v1/models and
        /v1/models (plain ASGI: a framework's routing and middleware cost as much a call as
        the rest of the server)."""
        models = {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                              "created": 0, "owned_by": "rlstack"}]}

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            parts = scope["path"].strip("/").split("/")
            method = scope["method"]
            if parts[-2:] == ["v1", "models"] and method == "GET" and len(parts) in (2, 4):
                status, content = 200, models
            elif parts[0] == "s" and parts[2:] == ["v1", "chat", "completions"] and \
                    method == "POST":
                body = b""
                while True:
                    message = await receive()
                    body += message.get("body", b"")
                    if not message.get("more_body"):
                        break
                status, content = await self._chat(parts[1], body)
            else:
                status, content = 404, error_body(f"no route {method} {scope['path']}")
            raw = json.dumps(content).encode()
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode())]})
            await send({"type": "http.response.body", "body": raw})
        return app

    async def _chat(self, sid: str, raw: bytes) -> tuple[int, dict]:
        channel = self.channels.get(sid)
        if channel is None or channel.closed:
            return 404, error_body(f"session {sid} has ended or never existed",
                                   code="session_ended")
        try:
            body = json.loads(raw)
        except ValueError:
            return 400, error_body("the request body is not JSON")
        problem = request_problem(body, channel.sampling)
        if problem:
            return 400, error_body(problem[1], param=problem[0])
        if channel.pending is not None:
            return 409, error_body(f"session {sid} already has a call in flight; one call at "
                                   f"a time per session")
        channel.pending = fut = asyncio.get_running_loop().create_future()
        if channel.closed:  # closed meanwhile, from the rollout side's thread
            return 404, error_body(f"session {sid} has ended: {channel.closed}",
                                   code="session_ended")
        channel.events.put(("call", body))
        return await fut

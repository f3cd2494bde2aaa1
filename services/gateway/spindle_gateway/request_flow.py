"""One request's life on the control plane, from admission to its single terminal state.

`Generation.start()` stores the prompt, subscribes to the request's stream subject *before* asking the scheduler
to admit (so no event can be missed), and raises GatewayError when admission fails. `deltas()` then turns
StreamEvents into text deltas: reordered by `seq`, detokenized, cut at stop strings, bounded by the deadline.
Whatever ends the request (finish, stop string, error event, deadline, disconnect, shutdown) goes through `_end`
exactly once; it publishes Abort when workers may still hold the request, and then unsubscribes and deletes the
prompt in a background task (so it also runs when the HTTP task is being cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from opentelemetry import trace

from spindle_protocol import prompts, subjects
from spindle_protocol.codec import ProtocolError
from spindle_protocol.messages import (
    Abort,
    AdmitReply,
    AdmitRequest,
    Prompt,
    RequestSpec,
    ServiceClass,
    StreamEvent,
    TokenLogprob,
)

from .errors import GatewayError
from .inputs import GenerationParams
from .reorder import TokenReorderer
from .sse import usage
from .stops import TextAssembler

if TYPE_CHECKING:
    from .state import GatewayState

log = logging.getLogger("spindle.gateway")
SCHEDULER_POLL_S = 0.25  # how often an admission asks again while no scheduler is running

Disconnected = Callable[[], Awaitable[bool]]


@dataclass
class Delta:
    """New output text of choice `index`; its last delta has `finish_reason`. The request's last delta has `usage`
    (it is the last choice's last) or `error`."""

    text: str = ""
    new_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, Any] | None = None
    error: GatewayError | None = None
    logprobs: list[TokenLogprob | None] | None = None  # of the tokens behind `text`, when the request asked
    index: int = 0

    @property
    def last(self) -> bool:
        return self.usage is not None or self.error is not None


@dataclass
class _Choice:
    """One choice's tokens (reassembled from its events) and text (detokenized, cut at stop strings)."""

    reorder: TokenReorderer
    text: TextAssembler
    done: bool = False


class _Disconnected(Exception):
    pass


class Generation:
    def __init__(
        self,
        state: GatewayState,
        request_id: str,
        params: GenerationParams,
        arrival: float,
        root: trace.Span,
        service_class: ServiceClass = "interactive",
    ) -> None:
        self.state = state
        self.service_class = service_class
        self.id = request_id
        self.params = params
        self.arrival = arrival  # wall clock, as sent to the cluster
        self._t0 = time.monotonic() - max(0.0, time.time() - arrival)
        self.deadline = arrival + state.config.request_timeout
        self._deadline_mono = self._t0 + state.config.request_timeout
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._sub: Any = None
        self._prompt: Prompt | None = None
        self._choices = [
            _Choice(TokenReorderer(), TextAssembler(state.tokenizer, params.stop)) for _ in range(params.sampling.n)
        ]
        self._root = root
        self._stream_span: trace.Span | None = None
        self._last_token_at: float | None = None
        self._next_poll = 0.0  # monotonic time of the next client-disconnect check
        self.terminal: str | None = None  # "finished" | "error" | "aborted"
        self._maybe_admitted = False
        state.live[request_id] = self
        state.metrics.in_flight.inc()

    # ---- admission ----

    async def start(self) -> None:
        """Store the prompt, subscribe, ask the scheduler; raises GatewayError (the request has then ended)."""
        state = self.state
        span = state.tracer.start_span("gateway.admission", context=trace.set_span_in_context(self._root))
        try:
            with trace.use_span(span, end_on_exit=False):
                reply = await self._admit()
        except GatewayError as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
            self._end("error", error=e, abort=self._maybe_admitted, reason="admission failed")
            raise
        except BaseException as e:
            self._end("error", error=GatewayError(500, f"admission failed: {type(e).__name__}"), abort=True)
            raise
        finally:
            span.end()
        if not reply.accepted:
            status = reply.status if reply.status >= 400 else 503
            retry = (reply.retry_after_s or 1.0) if status in (429, 503) else None
            err = GatewayError(status, reply.reason or "the scheduler rejected the request", retry_after=retry)
            self._end("error", error=err)
            raise err
        state.metrics.queue.observe(time.monotonic() - self._t0)
        state.metrics.prompt_tokens.inc(len(self.params.prompt_ids))
        self._root.set_attribute("spindle.prefill_instance", reply.prefill_instance)
        self._root.set_attribute("spindle.decode_instance", reply.decode_instance)
        self._stream_span = state.tracer.start_span("gateway.stream", context=trace.set_span_in_context(self._root))

    async def _admit(self) -> AdmitReply:
        state, bus = self.state, self.state.bus
        self._prompt = await prompts.put_prompt(bus, self.id, self.params.prompt_ids)
        self._sub = await bus.subscribe(subjects.stream(self.id), StreamEvent, self._on_event)
        spec = RequestSpec(
            request_id=self.id,
            prompt=self._prompt,
            sampling=self.params.sampling,
            arrival_time=self.arrival,
            deadline=self.deadline,
            service_class=self.service_class,
        )
        give_up = min(time.monotonic() + state.config.scheduler_wait, self._deadline_mono)
        try:
            while True:
                timeout = max(0.001, min(state.config.admit_timeout, self._deadline_mono - time.monotonic()))
                try:
                    return await bus.request(subjects.ADMIT, AdmitRequest(request=spec), AdmitReply, timeout=timeout)
                except NoRespondersError:  # none subscribed: surely not admitted; a restarting one may come
                    if time.monotonic() + SCHEDULER_POLL_S >= give_up:
                        raise
                    await asyncio.sleep(SCHEDULER_POLL_S)
        except NoRespondersError:
            raise GatewayError(503, "no scheduler is running; try again later", retry_after=1.0) from None
        except (NatsError, TimeoutError):  # nats' TimeoutError is also a builtin TimeoutError
            self._maybe_admitted = True  # a late admission must not leave the request running
            if time.monotonic() >= self._deadline_mono:  # the request's own deadline ended the wait
                timeout_s = state.config.request_timeout
                raise GatewayError(504, f"the request did not finish within its deadline ({timeout_s:g} s)") from None
            raise GatewayError(503, "the scheduler did not answer in time", retry_after=1.0) from None
        except ProtocolError as e:
            self._maybe_admitted = True
            raise GatewayError(500, f"bad admission reply: {e}") from None

    async def _on_event(self, event: StreamEvent, _: Msg) -> None:
        if event.request_id == self.id and self.terminal is None:
            self._queue.put_nowait(event)

    # ---- streaming ----

    async def _next_event(self, is_disconnected: Disconnected | None) -> StreamEvent:
        """The next event; raises TimeoutError at the deadline, _Disconnected when the client went away (checked
        every `disconnect_poll` seconds, also while events keep coming)."""
        poll = self.state.config.disconnect_poll
        if is_disconnected is not None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + poll
            if await is_disconnected():
                raise _Disconnected
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            pass
        while True:
            now = time.monotonic()
            remaining = self._deadline_mono - now
            if remaining <= 0:
                raise TimeoutError
            wait = remaining if is_disconnected is None else min(remaining, max(0.0, self._next_poll - now))
            try:
                async with asyncio.timeout(wait):
                    return await self._queue.get()
            except TimeoutError:
                if is_disconnected is not None and time.monotonic() >= self._next_poll:
                    self._next_poll = time.monotonic() + poll
                    if await is_disconnected():
                        raise _Disconnected from None

    async def deltas(self, is_disconnected: Disconnected | None = None) -> AsyncIterator[Delta]:
        """Text deltas until the terminal one (finish_reason or error). Ends early, silently, on disconnect."""
        try:
            while self.terminal is None:
                try:
                    event = await self._next_event(is_disconnected)
                except TimeoutError:
                    timeout = self.state.config.request_timeout
                    err = GatewayError(504, f"the request did not finish within its deadline ({timeout:g} s)")
                    self._end("error", error=err, abort=True, reason="deadline")
                    yield Delta(error=err)
                    return
                except _Disconnected:
                    self._end("aborted", abort=True, reason="client disconnected")
                    return
                delta = self._apply(event)
                if delta is not None:
                    yield delta
        finally:
            self.close("client disconnected")

    def _apply(self, event: StreamEvent) -> Delta | None:
        if event.error is not None:
            status = event.status if event.status >= 400 else 500
            err = GatewayError(status, event.error)
            self._end("error", error=err, abort=True, reason="error")
            return Delta(error=err)
        if not 0 <= event.index < len(self._choices) or self._choices[event.index].done:
            return None
        choice = self._choices[event.index]
        new = choice.reorder.push(event)
        if new:
            now = time.monotonic()
            if self._last_token_at is None:
                self.state.metrics.ttft.observe(now - self._t0)
            else:
                self.state.metrics.itl.observe(now - self._last_token_at)
            self._last_token_at = now
        consumed = choice.text.completion_tokens
        text = choice.text.add(new)
        logprobs = None
        if self.params.sampling.logprobs is not None:
            logprobs = choice.reorder.logprobs[consumed : choice.text.completion_tokens]
        if choice.text.stopped is None and choice.reorder.complete:
            text += choice.text.finish()
        delta = Delta(text, len(new), logprobs=logprobs, index=event.index)
        if choice.text.stopped is not None:
            delta.finish_reason, delta.stop_reason = "stop", choice.text.stopped
        elif choice.reorder.complete:
            delta.finish_reason = choice.reorder.finish_reason or "stop"
            if delta.finish_reason == "stop" and choice.text.last_token in self.params.sampling.stop_token_ids:
                delta.stop_reason = choice.text.last_token
        if delta.finish_reason is None:
            return delta if new else None
        choice.done = True
        if all(c.done for c in self._choices):
            # Workers may still be generating a choice a stop string ended (stop strings are the gateway's): the
            # abort frees them.
            complete = all(c.reorder.complete for c in self._choices)
            self._end("finished", finish_reason=delta.finish_reason, abort=not complete, reason="stop string")
            stats = next((c.reorder.stats for c in self._choices if c.reorder.stats), None)
            delta.usage = usage(len(self.params.prompt_ids), self.completion_tokens, stats)
        return delta

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs (prompt positions 1..), once the first output's event brought them."""
        return self._choices[0].reorder.prompt_logprobs

    @property
    def completion_tokens(self) -> int:
        return sum(c.text.completion_tokens for c in self._choices)

    # ---- the terminal state ----

    def interrupt(self, message: str, status: int) -> None:
        """End the request from outside (shutdown): its consumer sees a terminal error, as from a worker."""
        if self.terminal is None:
            self._queue.put_nowait(StreamEvent(request_id=self.id, seq=0, error=message, status=status))

    def close(self, reason: str) -> None:
        """End the request if it has not ended (client gone, shutdown): abort it everywhere. Idempotent."""
        if self.terminal is None:
            self._end("aborted", abort=True, reason=reason)

    def _end(
        self,
        kind: str,
        *,
        finish_reason: str | None = None,
        error: GatewayError | None = None,
        abort: bool = False,
        reason: str = "",
    ) -> None:
        if self.terminal is not None:
            return
        self.terminal = kind
        state, m = self.state, self.state.metrics
        m.in_flight.dec()
        m.e2e.observe(time.monotonic() - self._t0)
        m.generation_tokens.inc(self.completion_tokens)
        if finish_reason is not None:
            m.success(finish_reason)
        if error is not None:
            m.failure(error.status, error.message)
        state.live.pop(self.id, None)
        root = self._root
        root.set_attribute("spindle.terminal", kind)
        root.set_attribute("spindle.completion_tokens", self.completion_tokens)
        if finish_reason is not None:
            root.set_attribute("spindle.finish_reason", finish_reason)
        if error is not None:
            root.set_status(trace.Status(trace.StatusCode.ERROR, error.message))
        if self._stream_span is not None:
            self._stream_span.end()
        root.end()
        state.spawn(self._cleanup(reason or kind if abort else None))

    async def _cleanup(self, abort_reason: str | None) -> None:
        bus = self.state.bus
        if abort_reason is not None:
            try:
                with trace.use_span(self._root, end_on_exit=False):
                    await bus.publish(subjects.ABORT, Abort(request_id=self.id, reason=abort_reason))
            except Exception as e:  # the connection may be down; the scheduler's deadline still frees the request
                log.warning("could not publish abort of %s: %s", self.id, e)
        if self._sub is not None:
            with contextlib.suppress(Exception):  # already gone with the connection
                await self._sub.unsubscribe()
        if self._prompt is not None:
            await prompts.delete_prompt(bus, self._prompt)

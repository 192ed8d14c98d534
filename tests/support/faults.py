"""Faults a test injects into the real engine: an engine whose step fails, a transport whose
handoffs fail or stall. Built by the tests (or tests/support/faulty_server.py for a whole
server process), never read from the environment by production code."""

from __future__ import annotations

import time

from kvserve.disagg.handoff import KVHandoff
from kvserve.disagg.transport import BlockSink, KVTransferError, KVTransport
from kvserve.engine.engine import LLMEngine


class FailingEngine(LLMEngine):
    """An engine whose step raises once `fail_after_steps` steps have run (None: never): a real
    engine failure, in the engine thread that steps it."""

    def __init__(self, *args, fail_after_steps: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after_steps = fail_after_steps
        self.steps = 0

    def step(self):
        if self.fail_after_steps is not None and self.steps >= self.fail_after_steps:
            raise RuntimeError(f"injected engine failure after {self.steps} steps")
        self.steps += 1
        return super().step()


class FaultyTransport(KVTransport):
    """`fail_send` / `fail_receive`: raise KVTransferError; `stall_s`: a handoff becomes
    visible to `poll` only this long after it was sent (a slow or hung link)."""

    def __init__(self, inner: KVTransport, fail_send: bool = False, fail_receive: bool = False, stall_s: float = 0.0):
        self.inner, self.fail_send, self.fail_receive, self.stall_s = inner, fail_send, fail_receive, stall_s
        self.name = f"faulty({inner.name})"
        self._first_poll: dict[str, float] = {}

    @property
    def address(self) -> str | None:
        return self.inner.address

    def close(self) -> None:
        self.inner.close()

    def send(self, transfer_id: str, handoff: KVHandoff, address: str | None = None) -> None:
        if self.fail_send:
            raise KVTransferError(f"handoff {transfer_id}: the test transport failed the send")
        self.inner.send(transfer_id, handoff, address)

    def poll(self, transfer_id: str) -> KVHandoff | None:
        if self.fail_receive:
            raise KVTransferError(f"handoff {transfer_id}: the test transport failed the receive")
        first = self._first_poll.setdefault(transfer_id, time.monotonic())
        if time.monotonic() - first < self.stall_s:
            return None
        return self.inner.poll(transfer_id)

    def discard(self, transfer_id: str) -> None:
        self.inner.discard(transfer_id)

    def sweep(self, older_than_s: float) -> int:
        return self.inner.sweep(older_than_s)

    def expect(self, transfer_id: str, sink: BlockSink) -> None:
        self.inner.expect(transfer_id, sink)

    def unexpect(self, transfer_id: str) -> None:
        self.inner.unexpect(transfer_id)

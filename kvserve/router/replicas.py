"""The servers behind the router: whether each is up, and how loaded.

A replica is marked down when a request to it cannot connect or it answers 5xx before
streaming anything, and by the health check when /health fails. The check polls every
replica, down ones included, every `interval_s`: a replica that answers /health again is
marked up (its prefix index starts empty: a restarted server has an empty cache). The same
poll reads its /metrics for the waiting requests and KV usage it publishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.prefix_index import PrefixIndex

logger = logging.getLogger("kvserve.router")

# the replica's own gauges (kvserve/server/metrics.py, vLLM's names with a kvserve: prefix)
_LOAD_METRICS = {
    "kvserve:num_requests_running": "running",
    "kvserve:num_requests_waiting": "waiting",
    "kvserve:kv_cache_usage_perc": "kv_usage",
}


@dataclasses.dataclass
class Replica:
    url: str
    index: int
    pool: str = "replica"  # replica (colocated), prefill or decode
    up: bool = True  # assumed until a request or the health check says otherwise
    in_flight: int = 0  # requests the router has open on it
    running: float = 0.0  # as last published
    waiting: float = 0.0
    kv_usage: float = 0.0
    requests: int = 0  # sent, retries included
    failures: int = 0
    last_error: str = ""
    kv_address: str | None = None  # a decode instance's torch-transport address, from its /health
    down_since: float | None = None
    polls: int = 0  # health checks completed
    prefixes: PrefixIndex = dataclasses.field(default_factory=PrefixIndex)

    @property
    def load(self) -> float:
        """What the policy balances: requests in flight from here, and any waiting the replica reports beyond them."""
        return self.in_flight + max(0.0, self.waiting - self.in_flight)

    def mark_down(self, why: str) -> None:
        if self.up:
            logger.warning("replica %s is down: %s", self.url, why)
        self.up = False
        self.failures += 1
        self.last_error = why
        self.down_since = self.down_since or time.monotonic()

    def mark_up(self) -> None:
        if not self.up:
            logger.info("replica %s is up again", self.url)
            self.prefixes.clear()
        self.up = True
        self.down_since = None

    def describe(self) -> dict:
        return {"url": self.url, "pool": self.pool, "up": self.up, "in_flight": self.in_flight, "running": self.running,
                "waiting": self.waiting, "kv_cache_usage_perc": self.kv_usage, "requests": self.requests,
                "failures": self.failures, "last_error": self.last_error or None, "polls": self.polls}  # fmt: skip


async def check(replica: Replica, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    """One health and load poll of one replica."""
    try:
        health = await client.get(f"{replica.url}/health", timeout=5.0)
        if health.status_code != 200:
            replica.mark_down(f"/health answered {health.status_code}")
            return
        replica.mark_up()
        kv = (health.json() or {}).get("kv_transfer") or {}
        address = kv.get("address")
        if address and address.startswith(("0.0.0.0:", "[::]:")):  # listening everywhere: reach it where its HTTP is
            address = f"{urlparse(replica.url).hostname}:{address.rsplit(':', 1)[1]}"
        replica.kv_address = address
        metrics = await client.get(f"{replica.url}/metrics", headers=headers, timeout=5.0)
        if metrics.status_code == 200:
            for family in text_string_to_metric_families(metrics.text):
                for sample in family.samples:
                    field = _LOAD_METRICS.get(sample.name)
                    if field is not None:
                        setattr(replica, field, sample.value)
    except httpx.HTTPError as exc:
        replica.mark_down(f"/health: {type(exc).__name__}: {exc}")
    finally:
        replica.polls += 1


async def health_loop(replicas: list[Replica], client: httpx.AsyncClient, headers: dict[str, str], interval_s: float) -> None:
    while True:
        await asyncio.gather(*(check(r, client, headers) for r in replicas))
        await asyncio.sleep(interval_s)

"""The instances behind the router: their health and load, polled, and the choice of one for
each request (fewest requests waiting, counting those this router has in flight to it, then
the least KV in use). With DNS discovery, each URL's host name stands for every address it
resolves to (a Kubernetes headless Service: one address per pod), looked up at every poll, so
instances that come and go are followed without restarting the router."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("tandem.router")

# The instance gauges the choice reads, from its /metrics.
_LOAD_GAUGES = {
    "tandem:num_requests_waiting": "num_waiting",
    "tandem:num_requests_running": "num_running",
    "tandem:kv_cache_usage_perc": "kv_usage",
}


@dataclass
class Instance:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = False
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0  # requests this router has sent and not seen answered
    num_requests: int = 0
    num_failures: int = 0
    last_error: str | None = None
    last_poll: float = 0.0
    # A prefill instance's KV endpoint (host, port), from its /metrics: with it, a request's
    # decode leg can go out with its prefill leg and pull the KV as it is computed.
    kv_endpoint: tuple[str, int] | None = None

    @property
    def load(self) -> tuple[int, float]:
        return self.in_flight + self.num_waiting, self.kv_usage

    def describe(self) -> dict:
        return {
            "url": self.url, "role": self.role, "healthy": self.healthy,
            "num_waiting": self.num_waiting, "num_running": self.num_running,
            "kv_cache_usage": self.kv_usage, "in_flight": self.in_flight,
            "num_requests": self.num_requests, "num_failures": self.num_failures,
            "last_error": self.last_error,
            "kv_endpoint": None if self.kv_endpoint is None else "{}:{}".format(*self.kv_endpoint),
        }  # fmt: skip

    def failed(self, error: str) -> None:
        """A request to it failed for the instance's sake (no answer, or a 5xx)."""
        self.num_failures += 1
        self.healthy = False
        self.last_error = error
        logger.warning("%s instance %s failed: %s", self.role, self.url, error)


class InstancePool:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        client: httpx.AsyncClient,
        headers: dict[str, str] | None = None,
        discover: bool = False,
    ) -> None:
        self.sources = [(url.rstrip("/"), "prefill") for url in prefill_urls] + [
            (url.rstrip("/"), "decode") for url in decode_urls
        ]
        self.discover = discover
        self.instances = [] if discover else [Instance(url, role) for url, role in self.sources]
        self.client = client
        self.headers = headers or {}

    def of_role(self, role: str) -> list[Instance]:
        return [instance for instance in self.instances if instance.role == role]

    def choose(self, role: str, exclude: tuple[Instance, ...] = ()) -> Instance | None:
        """The healthy instance of `role` with the least load; None if there is none."""
        candidates = [
            i for i in self.of_role(role) if i.healthy and all(i is not e for e in exclude)
        ]
        return min(candidates, key=lambda instance: instance.load, default=None)

    async def poll_forever(self, interval: float) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(interval)

    async def poll(self) -> None:
        if self.discover:
            await self._resolve()
        await asyncio.gather(*(self._poll(instance) for instance in self.instances))

    async def _resolve(self) -> None:
        """One instance per address each source URL's host resolves to now; a source that
        does not resolve keeps the instances it had (a DNS hiccup is not a dead pod)."""
        loop = asyncio.get_running_loop()
        wanted: dict[tuple[str, str], None] = {}
        for source, role in self.sources:
            url = httpx.URL(source)
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                infos = await loop.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
            except OSError as error:
                logger.warning("%s does not resolve: %s", url.host, error)
                for instance in self.instances:
                    if instance.role == role:
                        wanted[(instance.url, role)] = None
                continue
            for *_, address in infos:  # httpx brackets an IPv6 address itself
                instance_url = str(url.copy_with(host=address[0], port=port)).rstrip("/")
                wanted[(instance_url, role)] = None
        known = {(instance.url, instance.role): instance for instance in self.instances}
        for key in wanted.keys() - known.keys():
            logger.info("%s instance found: %s", key[1], key[0])
        for key in known.keys() - wanted.keys():
            logger.info("%s instance gone: %s", key[1], key[0])
        self.instances = [known.get(key) or Instance(*key) for key in wanted]

    async def _poll(self, instance: Instance) -> None:
        try:
            health = await self.client.get(f"{instance.url}/health", timeout=5.0)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
            metrics = await self.client.get(
                f"{instance.url}/metrics", timeout=5.0, headers=self.headers
            )
            metrics.raise_for_status()
        except Exception as error:
            if instance.healthy or instance.last_poll == 0.0:
                logger.warning("%s instance %s is down: %s", instance.role, instance.url, error)
            instance.healthy = False
            instance.last_error = f"{type(error).__name__}: {error}"
        else:
            instance.kv_endpoint = None
            for family in text_string_to_metric_families(metrics.text):
                if family.name == "tandem:kv_transfer_endpoint" and family.samples:
                    labels = family.samples[0].labels
                    instance.kv_endpoint = (labels["host"], int(labels["port"]))
                field = _LOAD_GAUGES.get(family.name)
                if field is not None and family.samples:
                    value = family.samples[0].value
                    setattr(instance, field, value if field == "kv_usage" else int(value))
            if not instance.healthy:
                logger.info("%s instance %s is up", instance.role, instance.url)
            instance.healthy = True
            instance.last_error = None
        instance.last_poll = time.monotonic()

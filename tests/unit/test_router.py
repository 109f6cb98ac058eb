"""The router's choices that need no running instance: which requests are split into a prefill
and a decode leg, what the prefill leg asks for, and which instance gets a request; and, against
stand-in instances, the two legs sent at once."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.router.app import _route, prefill_body
from tandem.router.instances import Instance, InstancePool


@pytest.mark.parametrize(
    ("kind", "body", "route"),
    [
        ("completions", {"prompt": "hi", "max_tokens": 16}, "split"),
        ("completions", {"prompt": [1, 2, 3], "max_tokens": 16}, "split"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "split"),
        ("chat", {"messages": [], "max_completion_tokens": 1}, "prefill"),
        ("completions", {"prompt": "hi", "max_tokens": 1}, "prefill"),
        ("completions", {"prompt": "hi", "max_tokens": 0, "echo": True}, "prefill"),
        ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "prefill"),
        ("completions", {"prompt": "hi", "prompt_logprobs": 0}, "prefill"),
        ("completions", {"prompt": "hi", "n": 2}, "decode"),
        ("completions", {"prompt": ["a", "b"]}, "decode"),
        ("completions", {"prompt": [[1, 2], [3]]}, "decode"),
        ("completions", {"prompt": "hi", "use_beam_search": True}, "decode"),
        ("completions", {"prompt": "hi", "kv_transfer_params": {"x": 1}}, "decode"),
        ("completions", {"prompt": "hi", "echo": True}, "split"),  # echo alone: no logprobs
    ],
)
def test_route(kind: str, body: dict, route: str) -> None:
    assert _route(kind, body) == route


def test_prefill_body_asks_for_the_first_token_only_and_leaves_the_request_alone() -> None:
    body = {
        "prompt": "hi", "max_tokens": 64, "max_completion_tokens": 64, "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "min_tokens": 8, "seed": 3,
        "temperature": 0.7, "logprobs": 2, "stop": ["\n"],
    }  # fmt: skip
    original = {**body}
    prefill = prefill_body(body)
    assert body == original  # the decode leg gets the request as the client sent it
    assert prefill["max_tokens"] == 1 and prefill["min_tokens"] == 1
    assert prefill["stream"] is False
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    for dropped in ("max_completion_tokens", "stream_options", "n"):
        assert dropped not in prefill
    for kept in ("seed", "temperature", "logprobs", "stop", "prompt"):
        assert prefill[kept] == body[kept]
    streamed = prefill_body(body, "t1")["kv_transfer_params"]
    assert streamed == {"do_remote_decode": True, "transfer_id": "t1"}


def test_choose_takes_the_least_loaded_healthy_instance() -> None:
    async def choose() -> None:
        async with httpx.AsyncClient() as client:
            pool = InstancePool(["http://p1", "http://p2"], ["http://d1"], client)
            p1, p2, d1 = pool.instances
            assert pool.choose("prefill") is None  # none polled healthy yet
            p1.healthy = p2.healthy = d1.healthy = True
            p1.num_waiting, p2.num_waiting = 3, 1
            assert pool.choose("prefill") is p2
            p2.in_flight = 3  # the router's own requests count at once, before a poll
            assert pool.choose("prefill") is p1
            p1.in_flight, p2.in_flight, p2.num_waiting = 0, 0, 3
            p1.kv_usage, p2.kv_usage = 0.9, 0.2  # equal queues: the emptier cache
            assert pool.choose("prefill") is p2
            assert pool.choose("prefill", exclude=(p2,)) is p1
            p1.failed("boom")
            assert pool.choose("prefill", exclude=(p2,)) is None
            assert pool.choose("decode") is d1

    asyncio.run(choose())


def test_dns_discovery_follows_the_addresses_a_name_resolves_to(monkeypatch) -> None:
    answers = {"prefill.svc": ["10.0.0.1", "10.0.0.2"], "decode.svc": ["10.0.1.1"]}

    async def fake_getaddrinfo(host, port, **_):
        if host not in answers:
            raise OSError("no such name")
        return [(2, 1, 6, "", (address, port)) for address in answers[host]]

    async def discover() -> None:
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
        async with httpx.AsyncClient() as client:
            pool = InstancePool(
                ["http://prefill.svc:8000"], ["http://decode.svc:8000"], client, discover=True
            )
            await pool._resolve()
            assert {(i.url, i.role) for i in pool.instances} == {
                ("http://10.0.0.1:8000", "prefill"),
                ("http://10.0.0.2:8000", "prefill"),
                ("http://10.0.1.1:8000", "decode"),
            }
            kept = pool.instances[0]
            kept.num_requests = 5
            answers["prefill.svc"] = ["10.0.0.1", "10.0.0.3"]  # one pod gone, one new
            del answers["decode.svc"]  # a lookup failure keeps what was known
            await pool._resolve()
            urls = {i.url for i in pool.instances}
            assert urls == {"http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.1.1:8000"}
            assert next(i for i in pool.instances if i.url == kept.url) is kept  # state kept

    asyncio.run(discover())


def test_instance_describe_names_its_state() -> None:
    instance = Instance("http://p", "prefill")
    instance.failed("refused")
    described = instance.describe()
    assert described["healthy"] is False and described["last_error"] == "refused"
    assert described["num_failures"] == 1


# -- the two legs at once, against stand-in instances ------------------------------------------

PREFILL_URL, DECODE_URL = "http://prefill.test", "http://decode.test"
PREFILL_METRICS = (
    'tandem:kv_transfer_endpoint{model_name="m",host="10.0.0.7",port="14579"} 1.0\n'
    'tandem:num_requests_waiting{model_name="m"} 0.0\n'
)


class _Body(httpx.AsyncByteStream):
    """A body read as it streams, as a real server's (httpx reads bytes content at once, and
    the router relays the decode leg's answer chunk by chunk)."""

    def __init__(self, payload: dict) -> None:
        self.data = json.dumps(payload).encode()

    async def __aiter__(self):
        yield self.data


def answer(status: int, payload: dict) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.Response(status, headers=headers, stream=_Body(payload))


def stand_in_instances(prefill_status: int, seen: dict[str, list]) -> httpx.MockTransport:
    """A prefill instance that publishes its KV endpoint and answers the prefill leg with
    `prefill_status`, and a decode instance that answers once the prefill leg has had its
    answer (as a real one, whose first token comes at the end of the prefill); both record
    the bodies they got."""

    async def handle(request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url.endswith("/health"):
            return httpx.Response(200)
        if url.endswith("/metrics"):
            body = PREFILL_METRICS if url.startswith(PREFILL_URL) else ""
            return httpx.Response(200, text=body)
        role = "prefill" if url.startswith(PREFILL_URL) else "decode"
        seen[role].append(json.loads(request.content))
        if role == "decode":
            while not seen["prefill"]:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # the router has the prefill leg's answer by now
        if role == "prefill" and prefill_status != 200:
            return answer(prefill_status, {"error": {"message": "full"}})
        return answer(200, {"choices": [{"text": role}], "kv_transfer_params": {}})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("prefill_status", [200, 400, 503])
def test_both_legs_go_at_once_and_a_refused_prefill_leg_ends_its_transfer(
    monkeypatch, prefill_status: int
) -> None:
    """The decode leg names the prefill instance's KV endpoint and the prefill leg's transfer
    id; when the prefill instance refuses its leg, the router ends that transfer on its KV
    channel (so the decode instance computes the prompt at once), and only then."""
    from fastapi.testclient import TestClient

    from tandem.router import app as router_app

    seen: dict[str, list] = {"prefill": [], "decode": []}
    transport = stand_in_instances(prefill_status, seen)
    client_class = httpx.AsyncClient
    monkeypatch.setattr(
        router_app.httpx, "AsyncClient",
        lambda **kwargs: client_class(transport=transport, **kwargs),
    )  # fmt: skip
    ended: list[tuple] = []
    monkeypatch.setattr(router_app, "end_transfer", lambda *args: ended.append(args))
    app = router_app.build_router([PREFILL_URL], [DECODE_URL], router_app.RouterSettings())
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decode"
    (decode_leg,), (prefill_leg,) = seen["decode"], seen["prefill"]
    transfer_id = prefill_leg["kv_transfer_params"]["transfer_id"]
    assert prefill_leg["max_tokens"] == 1
    assert decode_leg["kv_transfer_params"] == {
        "do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 14579,
        "transfer_id": transfer_id,
    }  # fmt: skip
    assert ended == ([] if prefill_status == 200 else [(("10.0.0.7", 14579), transfer_id)])

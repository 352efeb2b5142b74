"""How the tier's operations see a single server (`server.py`): a map of one node that
serves every key, whose health lasts one operation (no breaker of its own)."""

from __future__ import annotations

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError
from tierkv_redis.routing import Node
from tierkv_redis.server import OneServer, ServerHealth

from tierkv.contract.keys import OffloadKey
from tierkv.testing import random_keys

pytestmark = pytest.mark.anyio

URL = "redis://:***@10.0.0.5:6379/0"
NODE = Node("10.0.0.5:6379", client=None, sync=None)  # type: ignore[arg-type]


def one_server() -> OneServer:
    server = OneServer(URL, URL, make_client=None, make_sync_client=None)  # type: ignore[arg-type]
    server._shard = (NODE,)  # as open() leaves it, without a server
    return server


def never_asked(key: OffloadKey) -> OffloadKey:
    raise AssertionError("a single server looks at no key to route it")


def test_a_single_server_routes_every_key_to_itself_without_looking_at_them() -> None:
    server = one_server()
    items = iter(random_keys(5))  # handed back unconsumed: a job's pairs stream through
    [(node, master, routed)] = server.route(items, never_asked, read=True)
    assert node is master is NODE and routed is items
    assert server.shard("any name") == (NODE,) and server.reader((NODE,)) is NODE
    assert server.states() == {} and server.title == f"redis at {URL}"


async def test_a_failure_ends_the_operation_that_met_it_and_no_later_one() -> None:
    server = one_server()
    first = server.health()
    assert first.allow(NODE) and not await first.every_node_down()
    reason = first.failed(NODE, ConnectionError("Connection refused."))
    assert reason == f"redis at {URL} unreachable: ConnectionError: Connection refused."
    assert not first.allow(NODE) and first.explain(NODE) == reason
    assert await first.every_node_down() and first.down_message() == reason
    first.succeeded(NODE)  # a batch in flight that answered does not undo it
    assert await first.every_node_down() and not first.serving(NODE)
    later = server.health()  # the next operation asks the server again
    assert later.allow(NODE) and later.serving(NODE) and not await later.every_node_down()


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (AuthenticationError("invalid password"), "refused the credentials: invalid password"),
        (ResponseError("WRONGTYPE"), "unreachable: ResponseError: WRONGTYPE"),
    ],
)
def test_every_error_a_lookup_or_removal_meets_says_the_server_is_down(
    exc: BaseException, message: str
) -> None:
    health = ServerHealth(URL)
    assert health.is_down(exc)  # no other node could answer for its keys
    assert health.failed(NODE, exc) == f"redis at {URL} {message}"


def test_an_unreachable_server_at_open_says_what_to_check() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from tierkv_redis.failures import open_error

    message = open_error(URL, False, RedisConnectionError("Connection refused."))
    assert message.startswith(f"redis at {URL} is unreachable: ConnectionError: Connection")
    assert "redis-server runs there" in message and "`required: false`" in message


def test_an_unreachable_optional_server_is_not_told_to_be_optional() -> None:
    """With `required: false` already set, the message says the cache serves without
    it, not to set what is set (issue 53)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from tierkv_redis.failures import open_error

    message = open_error(URL, False, RedisConnectionError("refused"), required=False)
    assert "redis-server runs there" in message
    assert "`required: false`" not in message and "the tier is optional" in message

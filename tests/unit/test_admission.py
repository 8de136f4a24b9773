"""Admission: the concurrency limit, and the share of it one tenant may hold.

A tenant (a TCP caller scoped by its token, `current_tenant`) holds at most half of
`max_concurrent_rpcs` and half of the stream slots; the tenants together three quarters of the
calls. Same-node callers (tenant "") are bound by the limit alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import TypeVar

import pytest

from kvstore.server.service import Admission, OverloadedError
from kvstore.server.tenancy import current_tenant

T = TypeVar("T")


def as_tenant(tenant: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a context whose caller is `tenant`, as a gRPC call's own task would."""
    def run() -> T:
        current_tenant.set(tenant)
        return fn()
    return contextvars.copy_context().run(run)


def test_one_tenant_holds_half_the_calls_and_the_tenants_three_quarters() -> None:
    a = Admission(8)
    for _ in range(4):
        assert as_tenant("alpha", lambda: a.enter("Fetch"))
    with pytest.raises(OverloadedError, match=r"tenant 'alpha' has 4 calls.*limit is 4"):
        as_tenant("alpha", lambda: a.enter("Lookup"))
    assert as_tenant("bravo", lambda: a.enter("Lookup"))
    assert as_tenant("bravo", lambda: a.enter("Lookup"))
    with pytest.raises(OverloadedError, match=r"tenants have 6 calls.*3/4"):
        as_tenant("bravo", lambda: a.enter("Lookup"))
    assert a.enter("Fetch") == a.enter("Fetch") == ""  # same-node callers: the last quarter
    with pytest.raises(OverloadedError, match="8 calls in progress, the limit is 8"):
        a.enter("Fetch")
    assert a.shed == 3
    a.leave()  # a same-node call ends
    a.leave("alpha")  # and one of alpha's
    assert a.by_tenant == {"alpha": 3, "bravo": 2, "": 5} and a.working == 6
    assert as_tenant("alpha", lambda: a.enter("Fetch")) == "alpha"  # its slot again
    assert as_tenant("alpha", lambda: a.enter("Release")) is None  # never shed nor counted
    assert a.by_tenant["alpha"] == 4


def test_one_tenant_holds_half_the_stream_slots() -> None:
    a = Admission(16)  # 4 stream slots, 2 a tenant
    held = contextlib.ExitStack()

    def open_stream(tenant: str) -> None:
        as_tenant(tenant, lambda: held.enter_context(a.stream()))

    open_stream("alpha")
    open_stream("alpha")
    with pytest.raises(OverloadedError, match=r"tenant 'alpha' has 2 streams.*limit is 2"):
        open_stream("alpha")
    open_stream("bravo")
    open_stream("")
    with pytest.raises(OverloadedError, match="4 streams in progress, the limit is 4"):
        open_stream("bravo")
    held.close()
    assert a.streams == 0 and a.streams_by_tenant == {}
    open_stream("alpha")
    held.close()


def test_no_limit_admits_every_tenant() -> None:
    a = Admission(0)
    with contextlib.ExitStack() as held:
        for _ in range(100):
            assert as_tenant("alpha", lambda: a.enter("Fetch")) == "alpha"
            as_tenant("alpha", lambda: held.enter_context(a.stream()))
        assert a.streams == 100
    assert a.shed == 0 and a.streams == 0

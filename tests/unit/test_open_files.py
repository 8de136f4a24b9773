"""The daemon's open-file limit and the TCP connections it lets in (`server.app`)."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys

import pytest

from kvstore.server.app import tcp_connection_limit


def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    """As systemd starts services (soft 1024, hard 524288): the daemon takes the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard open-file limit here is {hard}: too low to lower the soft one")
    code = ("import resource; from kvstore.server.app import raise_open_file_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
            "got = raise_open_file_limit(); "
            "print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    got, soft, hard_there = map(int, out)
    assert got == soft > 256
    assert soft == hard_there or hard_there == resource.RLIM_INFINITY


def test_tcp_connections_are_held_to_half_the_open_file_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    assert tcp_connection_limit(1024, 1 << 20) == 1024
    with caplog.at_level(logging.WARNING, logger="kvstore.server"):
        assert tcp_connection_limit(1024, 1024) == 512
    assert "holds at most 512 connections (raise `ulimit -n`)" in caplog.text
    assert tcp_connection_limit(8, 1) == 1

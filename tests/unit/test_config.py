"""ServerConfig: sizes, precedence of sources, unknown options, bounds, secrets."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import OTHER_ENV, ServerConfig, load_config, parse_size, parse_tenant_weights
from kvstore.errors import ConfigError, InvalidArgumentError


@pytest.mark.parametrize(("value", "want"), [
    (0, 0),
    (1048576, 1048576),
    (4096.0, 4096),
    ("4096", 4096),
    ("64GiB", 64 * 2**30),
    ("512 MiB", 512 * 2**20),
    ("1.5GB", 1_500_000_000),
    ("1.5 GiB", 3 * 2**29),
    ("2k", 2000),
    ("2KiB", 2048),
    ("3kb", 3000),
    (" 7 mb ", 7_000_000),
    ("1TiB", 2**40),
    ("10b", 10),
])
def test_parse_size(value: object, want: int) -> None:
    assert parse_size(value) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["", "GiB", "12 parsecs", "1e9", "-5MiB", "1.", "5 mibs",
                                   "0x10", "1,5GB", -1, -0.5, True, float("nan"), float("inf")])
def test_parse_size_rejects_bad_values_naming_the_option(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^host_bytes: "):
        parse_size(value, "host_bytes")  # type: ignore[arg-type]


def test_config_error_is_an_invalid_argument() -> None:
    assert issubclass(ConfigError, InvalidArgumentError)
    assert issubclass(ConfigError, ValueError)


def test_defaults_are_secure() -> None:
    c = load_config()
    assert c == ServerConfig()
    assert c.listen == ""  # no TCP unless asked for
    assert c.token == ""
    assert c.disk_sync == "always"
    assert c.socket_path == Path(c.data_dir) / "kv.sock"
    assert ServerConfig(socket="/run/x.sock").socket_path == Path("/run/x.sock")


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvstore.toml"
    p.write_text(text)
    return p


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    f = _toml(tmp_path, 'host_bytes = "2MiB"\ndisk_bytes = "3MiB"\nlog_level = "debug"\n'
                        "max_concurrent_rpcs = 7\n")
    base = ServerConfig()
    only_file = load_config(f)
    assert only_file.host_bytes == 2 * 2**20
    assert only_file.disk_bytes == 3 * 2**20
    assert only_file.log_level == "debug"
    assert only_file.max_concurrent_rpcs == 7
    assert only_file.lease_timeout_s == base.lease_timeout_s  # default kept

    env = {"KVSTORE_DISK_BYTES": "5MiB", "KVSTORE_LEASE_TIMEOUT_S": "2.5", "HOME": "/x",
           "KVSTORE_CONFIG": "/ignored.toml"}
    with_env = load_config(f, env)
    assert with_env.host_bytes == 2 * 2**20  # file
    assert with_env.disk_bytes == 5 * 2**20  # env beats file
    assert with_env.lease_timeout_s == 2.5  # env beats default
    assert with_env.log_level == "debug"

    full = load_config(f, env, {"disk_bytes": "9MiB", "log_level": "error", "host_bytes": None})
    assert full.disk_bytes == 9 * 2**20  # flag beats env
    assert full.log_level == "error"  # flag beats file
    assert full.host_bytes == 2 * 2**20  # a None flag is "not given"
    assert full.lease_timeout_s == 2.5


def test_toml_server_table_and_dashed_names(tmp_path: Path) -> None:
    f = _toml(tmp_path, '[server]\nhost-bytes = 8192\nshm-dir = "/tmp/x"\n')
    c = load_config(f)
    assert c.host_bytes == 8192
    assert c.shm_dir == "/tmp/x"


def test_unknown_option_in_toml_named(tmp_path: Path) -> None:
    f = _toml(tmp_path, 'host_bytes = "1MiB"\nhost_byte = "2MiB"\n')
    with pytest.raises(ConfigError, match="host_byte'"):
        load_config(f)


def test_unknown_option_in_env_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'cache_size'.*KVSTORE_CACHE_SIZE"):
        load_config(env={"KVSTORE_CACHE_SIZE": "1GiB"})


def test_other_kvstore_variables_in_the_daemons_environment_are_ignored() -> None:
    """The CLI's, the clients' and the connectors' variables often share the daemon's
    environment (a compose file, a shell): the documented `KVSTORE_MALLOC_TUNING=0` opt-out
    made the daemon refuse to start ("unknown option 'malloc_tuning'")."""
    env = {name: "0" for name in OTHER_ENV} | {"KVSTORE_HOST_BYTES": "2MiB"}
    assert load_config(env=env) == ServerConfig(host_bytes=2 * 2**20)


def test_every_kvstore_variable_the_code_reads_is_an_option_or_listed() -> None:
    """A new `KVSTORE_*` variable read anywhere in kvstore must be a daemon option or in
    `OTHER_ENV`, else a daemon started in the same environment refuses to start."""
    import re

    root = Path(__file__).resolve().parents[2]
    options = {f"KVSTORE_{f.name.upper()}" for f in dataclasses.fields(ServerConfig)}
    read: set[str] = set()
    for package in ("client", "kvstore", "server", "tiers", "kernels"):
        for source in (root / package).rglob("*.py"):
            read |= set(re.findall(r"\"(KVSTORE_[A-Z0-9_]+)\"", source.read_text()))
    assert "KVSTORE_MALLOC_TUNING" in read  # the scan finds what the code reads
    assert read - options - set(OTHER_ENV) == set()


def test_the_daemon_starts_beside_the_clients_variables(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, **{name: "0" for name in OTHER_ENV if name != "KVSTORE_CONFIG"},
           "KVSTORE_TARGET": "unix:///nowhere.sock"}
    out = subprocess.run([sys.executable, "-m", "kvstore.server", "--data-dir",
                          str(tmp_path), "--print-config"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert str(tmp_path) in out.stdout


def test_unknown_override_named() -> None:
    with pytest.raises(ConfigError, match="'nope'"):
        load_config(overrides={"nope": 1})


def test_unreadable_or_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(tmp_path / "missing.toml")
    bad = _toml(tmp_path, "host_bytes = = 3\n")
    with pytest.raises(ConfigError, match=r"kvstore\.toml"):
        load_config(bad)


@pytest.mark.parametrize(("source", "name", "value", "match"), [
    ("env", "KVSTORE_HOST_BYTES", "lots", "host_bytes: cannot parse size"),
    ("env", "KVSTORE_METRICS_PORT", "http", "metrics_port: expected int"),
    ("env", "KVSTORE_LEASE_TIMEOUT_S", "soon", "lease_timeout_s: expected float"),
    ("env", "KVSTORE_METRICS_PORT", "70000", "metrics_port: 70000 is above the maximum"),
    ("env", "KVSTORE_MAX_CONCURRENT_RPCS", "0", "max_concurrent_rpcs: 0 is below the minimum"),
    ("env", "KVSTORE_LEASE_TIMEOUT_S", "0.01", "lease_timeout_s: 0.01 is below the minimum"),
    ("env", "KVSTORE_LEASE_TIMEOUT_S", "nan", "lease_timeout_s: expected a number"),
    ("env", "KVSTORE_DRAIN_GRACE_S", "inf", "drain_grace_s: inf is above the maximum"),
    ("env", "KVSTORE_MAX_MESSAGE_BYTES", "1KiB", "max_message_bytes: 1024 is below"),
    ("flag", "host_bytes", "17TiB", "host_bytes: .* is above the maximum"),
    ("flag", "disk_sync", "sometimes", "disk_sync: 'sometimes' is not one of"),
    ("flag", "log_level", "trace", "log_level: 'trace' is not one of"),
    ("flag", "log_format", "xml", "log_format"),
    ("flag", "listen", "localhost", "listen: expected HOST:PORT"),
    ("flag", "listen", "localhost:0", "listen: expected HOST:PORT"),
    ("flag", "listen", ":8080", "listen: expected HOST:PORT"),
])
def test_bad_values_name_the_option(source: str, name: str, value: str, match: str) -> None:
    kwargs = {"env": {name: value}} if source == "env" else {"overrides": {name: value}}
    with pytest.raises(ConfigError, match=match):
        load_config(**kwargs)  # type: ignore[arg-type]


def test_toml_nan_and_inf_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="host_bytes"):
        load_config(_toml(tmp_path, "host_bytes = inf\n"))
    with pytest.raises(ConfigError, match="lease_timeout_s"):
        load_config(_toml(tmp_path, "lease_timeout_s = nan\n"))


def test_bounds_checked_on_direct_construction() -> None:
    with pytest.raises(ConfigError, match="host_bytes"):
        ServerConfig(host_bytes=-1)
    with pytest.raises(ConfigError, match="disk_sync"):
        ServerConfig(disk_sync="maybe")


def test_listen_requires_token() -> None:
    with pytest.raises(ConfigError, match=r"listen: .*requires `token`"):
        load_config(overrides={"listen": "127.0.0.1:7070"})
    c = load_config(env={"KVSTORE_TOKEN": "s3cret"}, overrides={"listen": "127.0.0.1:7070"})
    assert c.listen == "127.0.0.1:7070"
    assert c.token == "s3cret"
    assert ServerConfig(listen="[::1]:7070", token="t").listen == "[::1]:7070"


def test_redacted_hides_the_token() -> None:
    c = ServerConfig(listen="127.0.0.1:7070", token="hunter2-very-secret")
    red = c.redacted()
    assert red["token"] == "***"
    assert "hunter2" not in repr(red)
    assert red["listen"] == "127.0.0.1:7070"
    assert set(red) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert c.token == "hunter2-very-secret"  # the config itself is unchanged
    assert ServerConfig().redacted()["token"] == ""  # nothing to hide: no placeholder


def test_every_option_is_documented() -> None:
    for f in dataclasses.fields(ServerConfig):
        assert f.metadata["doc"], f.name
        default = f.default
        if f.metadata["min"] is not None:
            assert f.metadata["min"] <= default, f.name
        if f.metadata["max"] is not None:
            assert default <= f.metadata["max"], f.name
        if f.metadata["choices"]:
            assert default in f.metadata["choices"], f.name


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerConfig().token = "x"  # type: ignore[misc]


def test_tenant_weights_parse() -> None:
    assert parse_tenant_weights("alpha=3, bravo=0.5,@unscoped=2,") == {"alpha": 3, "bravo": 0.5,
                                                                     "": 2}
    assert parse_tenant_weights("") == {}
    assert load_config(overrides={"tenant_weights": "alpha=3",
                                  "tenant_tokens_file": "t"}).tenant_weights == "alpha=3"


@pytest.mark.parametrize(("text", "match"), [
    ("alpha", "expected TENANT=WEIGHT, got 'alpha'"),
    ("=3", "expected TENANT=WEIGHT"),
    ("alpha=0", "weight of 'alpha' must be a number from 1e-06 to 1e\\+06, got '0'"),
    ("alpha=-1", "got '-1'"),
    ("alpha=1e-320", "got '1e-320'"),
    ("alpha=heavy", "got 'heavy'"),
    ("alpha=nan", "got 'nan'"),
    ("alpha=inf", "got 'inf'"),
    ("alpha=1e7", "got '1e7'"),
    ("alpha=2,alpha=3", "'alpha' is given twice"),
])
def test_bad_tenant_weights_name_the_pair(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(tenant_weights=text, tenant_tokens_file="t")


def test_tenant_weights_need_tenants() -> None:
    with pytest.raises(ConfigError, match="tenant_weights: needs `tenant_tokens_file`"):
        ServerConfig(tenant_weights="alpha=2")


def test_unknown_option_suggests_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'host_byte'; did you mean "
                                          r"'host_bytes'\?"):
        load_config(_toml(tmp_path, 'host-byte = "2MiB"\n'))
    with pytest.raises(ConfigError, match=r"unknown option 'host_byte' \(environment variable "
                                          r"KVSTORE_HOST_BYTE\); did you mean "
                                          r"'KVSTORE_HOST_BYTES'\?"):
        load_config(env={"KVSTORE_HOST_BYTE": "2MiB"})
    with pytest.raises(ConfigError) as e:  # nothing close: no guess
        load_config(env={"KVSTORE_CACHE_SIZE": "1GiB"})
    assert "did you mean" not in str(e.value)


def test_every_bad_value_of_a_file_is_reported_one_a_line(tmp_path: Path) -> None:
    from kvstore.config import problems

    f = _toml(tmp_path, 'host_byte = 5\nhost_bytes = "lots"\nlog_level = "trace"\n'
                        'metrics_port = 70000\nlisten = "x"\n')
    with pytest.raises(ConfigError) as e:
        load_config(f, {"KVSTORE_LEASE_TIMEOUT_S": "soon"})
    assert str(e.value).splitlines() == [
        "unknown option 'host_byte'; did you mean 'host_bytes'?",
        "host_bytes: cannot parse size 'lots' (try 1048576, 512MiB or 64GiB)",
        "lease_timeout_s: expected float, got 'soon' (environment variable "
        "KVSTORE_LEASE_TIMEOUT_S)",
        "metrics_port: 70000 is above the maximum 65535",
        "log_level: 'trace' is not one of ['debug', 'info', 'warning', 'error']",
        "listen: expected HOST:PORT, got 'x'"]
    assert problems(e.value).startswith("6 problems:\n  unknown option 'host_byte'")
    with pytest.raises(ConfigError) as one:  # one problem: one line, as before
        load_config(overrides={"log_level": "trace"})
    assert problems(one.value) == str(one.value) == (
        "log_level: 'trace' is not one of ['debug', 'info', 'warning', 'error']")


def test_a_config_check_lists_every_problem(tmp_path: Path) -> None:
    import subprocess
    import sys

    f = _toml(tmp_path, 'host_bytes = 1073741824.5\nlog_level = "trace"\n')
    out = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "config", "check", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"{f}: invalid: 2 problems:",
        "  host_bytes: a size must be a whole number of bytes, got 1073741824.5; 1073741824 "
        "would do",
        "  log_level: 'trace' is not one of ['debug', 'info', 'warning', 'error']"]


@pytest.mark.parametrize(("value", "match"), [
    (1073741824.5, r"^host_bytes: a size must be a whole number of bytes, got 1073741824\.5; "
                   r"1073741824 would do$"),
    ("1073741824.5", "whole number of bytes, got '1073741824.5'"),
    ("0.5", r"whole number of bytes, got '0\.5'$"),
])
def test_sizes_are_whole_bytes(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_size(value, "host_bytes")  # type: ignore[arg-type]


def test_size_strings_resolve_exactly(tmp_path: Path) -> None:
    # Decimal arithmetic: float("4.35") * 1000 is 4349.999..., which truncated to 4349.
    assert parse_size("4.35KB") == 4350
    assert parse_size("1.1MB") == 1_100_000
    assert parse_size("0.3KiB") == 307  # a unit: rounded down, not refused
    assert parse_size("1.3GiB") == 1395864371
    assert load_config(_toml(tmp_path, 'host_bytes = "1.5GiB"\n')).host_bytes == 3 * 2**29
    with pytest.raises(ConfigError, match="host_bytes: a size must be a whole number"):
        load_config(_toml(tmp_path, "host_bytes = 1073741824.5\n"))


@pytest.mark.parametrize("kwargs", [
    {"overrides": {"host_bytes": "0"}},
    {"env": {"KVSTORE_HOST_BYTES": "0B"}},
])
def test_host_bytes_must_be_positive(kwargs: dict[str, Any]) -> None:
    """Every block lands in host first: with none, the daemon started and dropped every
    publish ("the daemon lacked space")."""
    with pytest.raises(ConfigError, match=r"^host_bytes: must be positive, got 0: every block "
                                          "lands in host first"):
        load_config(**kwargs)
    assert load_config(overrides={"host_bytes": "1"}).host_bytes == 1


def test_the_daemon_refuses_host_bytes_0_and_flag_prefixes(tmp_path: Path) -> None:
    import subprocess
    import sys

    def daemon(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvstore.server", "--data-dir",
                               str(tmp_path), *args, "--print-config"],
                              capture_output=True, text=True, timeout=60)

    out = daemon("--host-bytes", "0", "--disk-bytes", "64MiB")
    assert out.returncode == 2
    assert "invalid configuration: host_bytes: must be positive" in out.stderr
    for args in (["--host-byte", "2GiB"], ["--data", "/tmp/x"]):  # prefixes of real flags
        out = daemon(*args)
        assert out.returncode == 2
        assert f"unrecognized arguments: {' '.join(args)}" in out.stderr


def test_the_cli_refuses_flag_prefixes() -> None:
    from kvstore.client.cli import build_parser

    for argv in (["--tim", "1", "stats"], ["stats", "--tim", "1"], ["clear", "--name", "ab"],
                 ["top", "--inter", "2"], ["--js", "ping"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
    assert build_parser().parse_args(["top", "--interval", "2"]).interval == 2


def test_toml_values_of_another_type_are_refused_not_converted(tmp_path: Path) -> None:
    """Each one line naming the option. Before: `inf` or `1e400` for an int raised
    OverflowError (a traceback at start-up); `3.9` became 3, `true` 1, `[1, 2]` the path
    "[1, 2]", and a NUL byte in a path passed, to fail start-up with "embedded null byte"."""
    from kvstore.config import problems

    f = _toml(tmp_path, "max_blocks_per_call = inf\nremote_queue_blocks = 1e400\n"
                        "kv_events_queue = 3.9\nmax_concurrent_rpcs = true\nmetrics_port = 80.0\n"
                        "lease_timeout_s = true\ndrain_grace_s = 1" + "0" * 400 + "\n"
                        'data_dir = [1, 2]\nshm_dir = {a = 1}\nsocket = "\\u0000x"\n'
                        "log_level = 1979-05-27\nhost_bytes = [1]\ndisk_bytes = false\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).splitlines() == [
        "max_blocks_per_call: expected int, got inf",
        "remote_queue_blocks: expected int, got inf",
        "kv_events_queue: expected int, got 3.9",
        "max_concurrent_rpcs: expected int, got true",
        "metrics_port: expected int, got 80.0",
        "lease_timeout_s: expected float, got true",
        "drain_grace_s: 1000000000000000000000000000000000000... is out of range",
        "data_dir: expected str, got an array",
        "shm_dir: expected str, got a table",
        "socket: contains a NUL character",
        "log_level: expected str, got a date or time (1979-05-27)",
        "host_bytes: expected a size, got an array",
        "disk_bytes: expected a size, got false"]
    assert problems(e.value).startswith("13 problems:\n  max_blocks_per_call: ")
    # What is documented or natural stays accepted: an int for seconds, a size as text or a
    # whole float, a number as text (as a variable or flag gives it).
    ok = load_config(_toml(tmp_path, 'lease_timeout_s = 30\nhost_bytes = "64MiB"\n'
                                     'disk_bytes = 4096.0\nmax_concurrent_rpcs = "7"\n'))
    assert (ok.lease_timeout_s, ok.host_bytes, ok.disk_bytes, ok.max_concurrent_rpcs) == (
        30.0, 64 << 20, 4096, 7)
    assert isinstance(ok.lease_timeout_s, float)
    # Variables and flags are text: the same option refused the same way, naming its source.
    with pytest.raises(ConfigError, match=r"^max_blocks_per_call: expected int, got 'inf' "
                                          r"\(environment variable KVSTORE_MAX_BLOCKS_PER_CALL\)$"):
        load_config(env={"KVSTORE_MAX_BLOCKS_PER_CALL": "inf"})
    for flag in ("inf", "3.9", "true", "1e400"):
        with pytest.raises(ConfigError, match=f"^max_blocks_per_call: expected int, got "
                                              f"'{flag}'$"):
            load_config(overrides={"max_blocks_per_call": flag})


def test_a_server_key_that_is_not_a_table_is_one_line(tmp_path: Path) -> None:
    """`server = 1` raised AttributeError ('int' object has no attribute 'items')."""
    f = _toml(tmp_path, "server = 1\n")
    with pytest.raises(ConfigError, match=r"^config file .*kvstore\.toml: server: expected a "
                                          r"table of options \(\[server\]\), got 1$"):
        load_config(f)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """It raised UnicodeDecodeError: a traceback, from `kvstore config check` too."""
    f = tmp_path / "kvstore.toml"
    f.write_bytes(b'log_level = "\xff"\n')
    with pytest.raises(ConfigError, match=r"^config file .*kvstore\.toml: not UTF-8 text "
                                          r"\(byte 13\)$"):
        load_config(f)


def test_the_daemon_and_config_check_report_bad_types_one_a_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    f = _toml(tmp_path, 'max_concurrent_rpcs = true\ndata_dir = "\\u0000x"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    daemon = subprocess.run([sys.executable, "-m", "kvstore.server", "--config", str(f),
                             "--max-blocks-per-call", "inf", "--print-config"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert daemon.returncode == 2
    assert daemon.stderr.splitlines() == [
        "kvstore-server: invalid configuration: 3 problems:",
        "  max_concurrent_rpcs: expected int, got true",
        "  data_dir: contains a NUL character",
        "  max_blocks_per_call: expected int, got 'inf'"]
    f.write_text("max_blocks_per_call = 1e400\n")
    check = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "config", "check",
                            str(f)], env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 2
    assert check.stderr.splitlines() == [
        f"{f}: invalid: max_blocks_per_call: expected int, got inf"]


def test_keys_beside_a_server_table_are_refused_not_ignored(tmp_path):
    """A file with a [server] table and options outside it: those were silently ignored (a
    `host_bytes` at the top of the file never took effect)."""
    f = tmp_path / "kv.toml"
    f.write_text('host_bytes = "1GiB"\n\n[server]\ndisk_bytes = "2GiB"\n')
    with pytest.raises(ConfigError, match=r"'host_bytes' is outside \[server\]"):
        load_config(f, env={})
    f.write_text('[server]\nhost_bytes = "1GiB"\n')
    assert load_config(f, env={}).host_bytes == 1 << 30

"""`KeyChain` (a prompt's keys, hashed once however often it is looked up or extended) and
`PrefixKeys` (keys computed ahead, given to the client in place of tokens)."""

from __future__ import annotations

import random

import pytest

from kvstore import keys as keys_mod
from kvstore.client import KVClient
from kvstore.errors import InvalidArgumentError
from kvstore.keys import KeyChain, Namespace, PrefixKeys, chain_keys
from tests.conftest import random_kv, same_bytes, small_layout

LAYOUT = small_layout()
BT = LAYOUT.block_tokens
NS = Namespace(LAYOUT)


class Counted:
    """Counts the tokens converted and the blocks hashed by `kvstore.keys`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tokens = self.blocks = 0
        convert, chain = keys_mod.tokens_to_array, keys_mod._chain

        def counted_convert(tokens, *a, **kw):  # type: ignore[no-untyped-def]
            self.tokens += len(tokens)
            return convert(tokens, *a, **kw)

        def counted_chain(prev, raw, step, n_blocks, extras=None, first=0):  # type: ignore[no-untyped-def]
            self.blocks += n_blocks - first
            return chain(prev, raw, step, n_blocks, extras, first)

        monkeypatch.setattr(keys_mod, "tokens_to_array", counted_convert)
        monkeypatch.setattr(keys_mod, "_chain", counted_chain)

    def take(self) -> tuple[int, int]:
        got, self.tokens, self.blocks = (self.tokens, self.blocks), 0, 0
        return got


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


def test_same_prompt_again_converts_and_hashes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    count = Counted(monkeypatch)
    chain = KeyChain(NS.digest(), BT)
    tokens = prompt(10 * BT + 3)
    first = chain.keys(tokens)
    assert count.take() == (10 * BT, 10)
    assert list(first.keys) == chain_keys(NS, tokens)
    count.take()
    for _ in range(3):
        assert chain.keys(tokens) == first
        assert chain.keys(list(tokens)) == first  # equal tokens in another list
    assert count.take() == (0, 0)


def test_extension_hashes_only_the_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    count = Counted(monkeypatch)
    chain = KeyChain(NS.digest(), BT)
    tokens = prompt(4 * BT + 5)
    chain.keys(tokens)
    count.take()
    tokens.extend(prompt(3 * BT, seed=1))  # in place, as vLLM extends a streaming session
    got = chain.keys(tokens)
    assert count.take() == (3 * BT, 3)  # blocks 4..6: the old partial block's 5 tokens too
    assert list(got.keys) == chain_keys(NS, tokens)
    assert got.num_tokens == 7 * BT


@pytest.mark.parametrize("where", [0, 2 * BT + 1, 5 * BT - 1, 5 * BT + 2])
def test_changed_tokens_never_reuse_old_keys(where: int) -> None:
    chain = KeyChain(NS.digest(), BT)
    tokens = prompt(5 * BT + 4)
    chain.keys(tokens)
    tokens[where] += 1  # in place: the same list object, one token different
    assert list(chain.keys(tokens).keys) == chain_keys(NS, tokens)
    shorter = tokens[: 3 * BT]
    assert list(chain.keys(shorter).keys) == chain_keys(NS, shorter)
    other = prompt(6 * BT, seed=2)
    assert list(chain.keys(other).keys) == chain_keys(NS, other)
    assert list(chain.keys(tuple(other)).keys) == chain_keys(NS, other)


def test_prompts_it_does_not_extend_are_keyed_by_keys_of(monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    asked: list[int] = []

    def keys_of(tokens):  # type: ignore[no-untyped-def]
        asked.append(len(tokens))
        return chain_keys(NS, tokens)

    chain = KeyChain(NS.digest(), BT, keys_of)
    tokens = prompt(4 * BT + 1)
    assert list(chain.keys(tokens).keys) == chain_keys(NS, tokens)
    count = Counted(monkeypatch)
    chain.keys(tokens)
    tokens.extend(prompt(BT, seed=5))
    got = chain.keys(tokens)
    assert count.take() == (BT, 1)
    assert asked == [4 * BT + 1]  # the first call only: the extension hashed its block itself
    assert list(got.keys) == chain_keys(NS, tokens)
    tokens[0] += 1
    assert list(chain.keys(tokens).keys) == chain_keys(NS, tokens)
    assert asked == [4 * BT + 1, 5 * BT + 1]


def test_chain_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        KeyChain(b"short", BT)
    with pytest.raises(InvalidArgumentError):
        KeyChain(NS.digest(), 0)
    with pytest.raises(InvalidArgumentError):
        KeyChain(NS.digest(), BT).keys([1.5] * BT)  # type: ignore[list-item]


@pytest.mark.integration
def test_client_takes_prefix_keys_in_place_of_tokens(daemon, monkeypatch) -> None:
    tokens = prompt(6 * BT + 2, seed=3)
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(daemon.target, LAYOUT, salt="s", deadline_s=10) as c:  # a loaded machine
        assert c.publish(tokens, kv) == 6 * BT  # by tokens, as before
        given = KeyChain(c.namespace.digest(), BT).keys(tokens)
        count = Counted(monkeypatch)
        assert c.lookup(given) == 6 * BT
        n, got = c.fetch(given.prefix(4))
        assert n == 4 * BT and got is not None
        assert same_bytes(got, kv[:, :, : 4 * BT])
        assert c.publish(given, kv[:, :, : 6 * BT]) == 6 * BT  # all present already
        assert count.take() == (0, 0)  # the client hashed nothing
        assert c.lookup(tokens) == 6 * BT  # tokens still work the same
        # Keys of another namespace or block size are refused, never used.
        other = KeyChain(Namespace(LAYOUT, salt="t").digest(), BT).keys(tokens)
        with pytest.raises(InvalidArgumentError, match="another namespace"):
            c.lookup(other)
        with pytest.raises(InvalidArgumentError, match="another namespace"):
            c.lookup(PrefixKeys(given.namespace, BT * 2, given.keys[:3]))


def test_prefix_keys_count_whole_blocks() -> None:
    given = KeyChain(NS.digest(), BT).keys(prompt(3 * BT + 1))
    assert given.num_tokens == 3 * BT
    assert given.prefix(2).keys == given.keys[:2] and given.prefix(2).num_tokens == 2 * BT

"""The block-hash chain: pinned digests, the documented encoding, chaining and extra keys."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_common.block_hash import (
    ROOT_BLOCK_HASH,
    hash_block_tokens,
    hash_prompt_blocks,
)
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams

# Pinned: if these change, every engine and gateway in a mixed-version cluster disagrees.
FIRST_BLOCK_0_TO_15 = "fe13415d8243208010744502f7be6ff67fd21cba186f98d05b05d0c74c0a5ae0"
CHAINED_SALTED = "fe8c083db6747215c7ba05a88818d8d7652425f4767fa2d23063f69b2cc3cb3e"


def reference_hash(parent: bytes | None, tokens: list[int], keys: tuple[str, ...] | None) -> bytes:
    """The encoding as the module docstring states it, written out independently."""
    data = parent if parent is not None else hashlib.sha256(b"tandem/kv-block/v1").digest()
    data += len(tokens).to_bytes(4, "little")
    for t in tokens:
        data += t.to_bytes(4, "little", signed=True)
    for key in keys or ():
        raw = key.encode("utf-8")
        data += len(raw).to_bytes(4, "little") + raw
    return hashlib.sha256(data).digest()


def test_pinned_digests() -> None:
    assert ROOT_BLOCK_HASH == hashlib.sha256(b"tandem/kv-block/v1").digest()
    first = hash_block_tokens(None, list(range(16)), None)
    assert first.hex() == FIRST_BLOCK_0_TO_15
    assert hash_block_tokens(first, [1, 2, 3, 4], ("salt",)).hex() == CHAINED_SALTED
    assert len(first) == 32 and isinstance(first, bytes)


@given(
    parent=st.none() | st.binary(min_size=32, max_size=32),
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    keys=st.none() | st.lists(st.text(max_size=6), max_size=3).map(tuple),
)
def test_matches_documented_encoding(
    parent: bytes | None, tokens: list[int], keys: tuple[str, ...] | None
) -> None:
    assert hash_block_tokens(parent, tokens, keys) == reference_hash(parent, tokens, keys)


def test_chaining_and_extra_keys_separate_digests() -> None:
    tokens = [5, 6, 7, 8]
    root = hash_block_tokens(None, tokens)
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(None, tokens, ("a",)) != root
    assert hash_block_tokens(None, tokens, ("a",)) != hash_block_tokens(None, tokens, ("b",))
    # Length prefixes keep key boundaries apart.
    assert hash_block_tokens(None, tokens, ("ab",)) != hash_block_tokens(None, tokens, ("a", "b"))
    assert hash_block_tokens(None, tokens, None) == hash_block_tokens(None, tokens, ())
    # The token count keeps token/key boundaries apart: a short block is not a padded one.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])


def test_out_of_range_token_is_rejected() -> None:
    with pytest.raises(Exception):  # noqa: B017 (struct.error)
        hash_block_tokens(None, [2**31])


@given(
    tokens=st.lists(st.integers(0, 200_000), max_size=70),
    block_size=st.sampled_from([1, 4, 16]),
    salt=st.none() | st.text(min_size=1, max_size=8),
)
def test_prompt_blocks_equal_blockwise_chain_and_request(
    tokens: list[int], block_size: int, salt: str | None
) -> None:
    keys = (salt,) if salt else None
    expected = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size], keys)
        expected.append(parent)
    assert hash_prompt_blocks(tokens, block_size, keys) == expected
    if tokens:
        req = Request(
            "r", tokens, SamplingParams(max_tokens=4), cache_salt=salt, block_size=block_size
        )
        assert req.block_hashes == expected


def test_request_extends_hashes_as_tokens_arrive() -> None:
    req = Request("r", list(range(6)), SamplingParams(max_tokens=8), block_size=4)
    assert len(req.block_hashes) == 1
    for t in (100, 101):
        req.append_output_token(t)
    assert req.block_hashes == hash_prompt_blocks(list(range(6)) + [100, 101], 4)


def test_same_digest_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from engine_common.block_hash import hash_prompt_blocks;"
        "print(hash_prompt_blocks(list(range(32)), 16, ('salt',))[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout.strip()
    assert out == hash_prompt_blocks(list(range(32)), 16, ("salt",))[-1].hex()

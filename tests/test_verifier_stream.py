"""Stream v3 of the field vectors: independent blocks, so any range of blocks (a GPU thread's
block, or the host's extension after a rejection) is the same bytes as in the whole."""
import hashlib

import numpy as np

from verifier.rng import (
    BLOCK_BYTES,
    FIELD_BLOCK_DOMAIN,
    FIELD_KEY_DOMAIN,
    field_blocks,
    field_key,
    field_vectors,
)


def test_any_range_of_blocks_is_that_slice_of_the_whole():
    key = field_key(b"seed", 4096, 1)
    whole = field_blocks(key, 0, 200)
    assert len(whole) == 200 * BLOCK_BYTES
    for first, count in [(0, 1), (7, 3), (195, 5)]:
        part = field_blocks(key, first, count)
        assert part == whole[first * BLOCK_BYTES : (first + count) * BLOCK_BYTES]
        assert part[:BLOCK_BYTES] == hashlib.shake_128(
            FIELD_BLOCK_DOMAIN + key + first.to_bytes(8, "big")).digest(BLOCK_BYTES)


def test_keys_separate_seeds_shapes_and_never_collide_with_block_inputs():
    keys = {field_key(seed, n, rounds) for seed in (b"a", b"b", b"a" * 300)
            for n, rounds in ((21, 1), (21, 2), (42, 1))}
    assert len(keys) == 9
    assert FIELD_KEY_DOMAIN[:23] == FIELD_BLOCK_DOMAIN[:23]  # same family, and then
    assert FIELD_KEY_DOMAIN[23] != FIELD_BLOCK_DOMAIN[23]  # a different 24th byte
    R = field_vectors(b"a", 21, 2)  # 42 words: exactly blocks 0 and 1
    words = np.frombuffer(field_blocks(field_key(b"a", 21, 2), 0, 2), "<u8")
    np.testing.assert_array_equal(R.T.ravel(), (words & np.uint64((1 << 61) - 1)).astype(np.int64))

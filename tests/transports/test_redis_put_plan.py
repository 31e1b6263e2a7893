"""A Redis put plans from what this process knows of the rollout, at the cost of what it adds.

Pure planning, no server: the blocks a put sends are the ones after the last block known
held, and what the process knows afterwards covers the whole chain, grown in place while
the rollout's epoch lasts.
"""

from __future__ import annotations

from capture.codec.blocks import plan_writes
from capture.codec.entries import ChainMemo, encode_entry
from tests.capture.test_codec import B, growing_calls
from transports.redis.put import Put


def sent_names(put: Put) -> list[str]:
    return list(put.blocks[0::5])


def test_each_put_sends_only_the_blocks_after_what_is_known() -> None:
    memo = ChainMemo()
    encoded = [encode_entry(call, B, memo) for call in growing_calls(12)]
    first = Put.plan(encoded[0], None)
    assert sent_names(first) == encoded[0].block_names
    known = first.learned(b"e1")
    for entry in encoded[1:]:
        put = Put.plan(entry, known)
        held = [name for name in entry.block_names if name in known.names]
        assert held == entry.block_names[: len(held)]  # what is known is a prefix
        assert sent_names(put) == entry.block_names[len(held) :]
        learned = put.learned(b"e1")
        assert learned.names is known.names  # grown in place, not copied
        assert set(entry.block_names) <= learned.names
        known = learned
    # Another epoch (the rollout was dropped and written again): nothing carries over.
    again = Put.plan(encoded[-1], known).learned(b"e2")
    assert again.names == set(encoded[-1].block_names) and again.names is not known.names


def test_the_plan_stops_at_the_last_held_block() -> None:
    entry = encode_entry(growing_calls(20)[-1], B)
    chain = entry.chain
    for count in range(len(chain) + 1):
        held = {block.name for block in chain[:count]}
        writes = plan_writes(chain, 4 * B, held, {})
        assert [name for name, _ in writes.blocks] == [b.name for b in chain[count:]]

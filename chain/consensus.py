"""Proof-of-useful-work consensus: a block's seal commits to the work verified in it.

The work of a block is the list of (jobId, worker, flops) of the market's
``JobVerified`` events, in log order. The header's ``extra_data`` holds
``keccak256(rlp(work))``. Validating a block re-executes it (so every Freivalds
check runs again on this node's blob store) and recomputes the seal from the
receipts; a block claiming work that does not verify here is invalid. Its coinbase must be
the reward pool, which the priority fees refill.

Rewards (no minting): the block's verified workers share
``min(MAX_BLOCK_REWARD, pool balance, REWARD_PER_GFLOP * total_flops / 1e9)``
taken from the reward pool, pro rata to their FLOPs.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import rlp
from eth.abc import BlockHeaderAPI, ConsensusContextAPI, ReceiptAPI
from eth.consensus.noproof import NoProofConsensus
from eth.db.chain import ChainDB
from eth.typing import Address
from eth.vm.forks.prague.receipts import PragueReceiptBuilder
from eth_bloom import BloomFilter
from eth_hash.auto import keccak
from eth_utils import ValidationError, event_abi_to_log_topic

from chain.compile import compiled_market
from chain.params import MARKET_ADDRESS, MAX_BLOCK_REWARD, REWARD_PER_GFLOP, REWARD_POOL_ADDRESS

Work = tuple[int, bytes, int]


def _job_verified_topic() -> bytes:
    abi = next(e for e in compiled_market()["abi"]
               if e["type"] == "event" and e["name"] == "JobVerified")
    return event_abi_to_log_topic(abi)


JOB_VERIFIED_TOPIC = _job_verified_topic()


def may_hold_work(header: BlockHeaderAPI) -> bool:
    """False when the header's bloom rules out any JobVerified event (skip the receipts)."""
    bloom = BloomFilter(header.bloom)
    return MARKET_ADDRESS in bloom and JOB_VERIFIED_TOPIC in bloom


def verified_work(receipts: Iterable[ReceiptAPI]) -> list[Work]:
    """(jobId, worker, flops) for every JobVerified event of the market, in log order."""
    work = []
    for receipt in receipts:
        for entry in receipt.logs:
            if entry.address != MARKET_ADDRESS or not entry.topics:
                continue
            if entry.topics[0].to_bytes(32, "big") != JOB_VERIFIED_TOPIC:
                continue
            job_id = entry.topics[1]
            worker = entry.topics[2].to_bytes(32, "big")[12:]
            flops = int.from_bytes(entry.data[32:64], "big")
            work.append((job_id, worker, flops))
    return work


def work_seal(work: Sequence[Work]) -> bytes:
    """The 32-byte commitment to a block's verified work, stored in extra_data."""
    return keccak(rlp.encode([[job_id, worker, flops] for job_id, worker, flops in work]))


def block_rewards(work: Sequence[Work], pool_balance: int) -> dict[bytes, int]:
    """How much each verified worker earns from the pool for this block's work."""
    total_flops = sum(flops for _, _, flops in work)
    if total_flops == 0:
        return {}
    reward = min(MAX_BLOCK_REWARD, pool_balance, REWARD_PER_GFLOP * total_flops // 10**9)
    per_worker: dict[bytes, int] = {}
    for _, worker, flops in work:
        per_worker[worker] = per_worker.get(worker, 0) + flops
    return {worker: reward * flops // total_flops for worker, flops in per_worker.items()}


class PoUWConsensus(NoProofConsensus):
    """Seal = commitment to verified work; recomputed from the block's receipts."""

    def __init__(self, context: ConsensusContextAPI) -> None:
        self.chaindb = ChainDB(context.db)

    def validate_seal(self, header: BlockHeaderAPI) -> None:
        if header.block_number == 0:
            return
        if header.coinbase != REWARD_POOL_ADDRESS:
            # the pool, which pays every block reward, is refilled by the priority fees
            raise ValidationError(
                f"block #{header.block_number} pays its priority fees to "
                f"0x{header.coinbase.hex()}, not to the reward pool"
            )
        work = []
        if may_hold_work(header):
            work = verified_work(self.chaindb.get_receipts(header, PragueReceiptBuilder))
        expected = work_seal(work)
        if header.extra_data != expected:
            raise ValidationError(
                f"block #{header.block_number} seal {header.extra_data.hex()} does not commit "
                f"to the work verified in it ({expected.hex()})"
            )

    @classmethod
    def get_fee_recipient(cls, header: BlockHeaderAPI) -> Address:
        return header.coinbase

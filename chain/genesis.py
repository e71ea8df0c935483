"""Genesis of the dev network: funded mnemonic accounts, the pre-deployed market, the pool."""
from __future__ import annotations

from eth.constants import BLANK_ROOT_HASH
from eth_utils import to_canonical_address

from chain.compile import compiled_market
from chain.consensus import work_seal
from chain.devnet import dev_accounts
from chain.params import (
    DEV_ACCOUNT_BALANCE,
    DEV_ACCOUNT_COUNT,
    GENESIS_GAS_LIMIT,
    MARKET_ADDRESS,
    REWARD_POOL_ADDRESS,
    REWARD_POOL_GENESIS,
)

GENESIS_TIMESTAMP = 1_767_225_600  # 2026-01-01T00:00:00Z: fixed, so every node agrees


def genesis_params() -> dict:
    return {
        "coinbase": REWARD_POOL_ADDRESS,
        "difficulty": 0,
        "extra_data": work_seal([]),
        "gas_limit": GENESIS_GAS_LIMIT,
        "mix_hash": b"\x00" * 32,
        "nonce": b"\x00" * 8,
        "receipt_root": BLANK_ROOT_HASH,
        "timestamp": GENESIS_TIMESTAMP,
        "transaction_root": BLANK_ROOT_HASH,
    }


def genesis_state() -> dict:
    """Dev accounts, the reward pool and the market's runtime code (no constructor state)."""
    empty = {"nonce": 0, "code": b"", "storage": {}}
    state = {
        to_canonical_address(account.address): {**empty, "balance": DEV_ACCOUNT_BALANCE}
        for account in dev_accounts(DEV_ACCOUNT_COUNT)
    }
    state[REWARD_POOL_ADDRESS] = {**empty, "balance": REWARD_POOL_GENESIS}
    state[MARKET_ADDRESS] = {**empty, "balance": 0, "code": compiled_market()["runtime"]}
    return state


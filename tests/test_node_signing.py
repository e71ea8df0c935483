"""The clients' direct transaction signing and call encoding (chain.client.sign_dynamic_fee,
call_data) against the references they replace: eth-account's sign_transaction and web3's
ABI encoding. The bytes must be identical; the node's own decoder must accept them."""
import coincurve
import numpy as np
import pytest
from eth_account import Account
from web3 import Web3

from chain.admission import decode_transaction
from chain.client import call_data, sign_dynamic_fee
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.params import CHAIN_ID, MARKET_ADDRESS

RNG = np.random.default_rng(5)
MARKET = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                             abi=compiled_market()["abi"])


def _random_int(bits: int) -> int:
    return int.from_bytes(RNG.bytes(bits // 8), "big") >> int(RNG.integers(0, bits))


def _cases():
    keys = [a.key for a in dev_accounts(2)] + [RNG.bytes(32) for _ in range(6)]
    edges = [dict(nonce=0, max_fee=0, max_priority_fee=0, gas=21_000, value=0, data=b""),
             dict(nonce=2**64 - 2,  # EIP-2681: the largest valid nonce
                  max_fee=2**256 - 1, max_priority_fee=2**256 - 1,
                  gas=2**63, value=2**256 - 1, data=b"\x00" * 55),
             dict(nonce=127, max_fee=255, max_priority_fee=128, gas=256, value=1,
                  data=b"\x80")]
    for i, key in enumerate(keys):
        max_fee = _random_int(128)  # the tip stays within it (EIP-1559; admission checks)
        fields = edges[i] if i < len(edges) else dict(
            nonce=_random_int(64), max_fee=max_fee,
            max_priority_fee=min(_random_int(64), max_fee),
            gas=_random_int(32), value=_random_int(256),
            data=RNG.bytes(int(RNG.integers(0, 3000))))
        to = RNG.bytes(20)
        yield key, to, fields


@pytest.mark.parametrize("key, to, fields", list(_cases()), ids=lambda v: "")
def test_signed_bytes_equal_eth_account(key, to, fields):
    account = Account.from_key(key)
    expected = account.sign_transaction({
        "type": 2, "chainId": CHAIN_ID, "nonce": fields["nonce"], "gas": fields["gas"],
        "maxFeePerGas": fields["max_fee"], "maxPriorityFeePerGas": fields["max_priority_fee"],
        "to": Web3.to_checksum_address(to), "value": fields["value"], "data": fields["data"],
        "accessList": [],
    }).raw_transaction
    raw = sign_dynamic_fee(coincurve.PrivateKey(key), chain_id=CHAIN_ID, to=to, **fields)
    assert raw == bytes(expected)
    tx = decode_transaction(raw)  # what the node's admission does with it
    assert tx.sender == bytes.fromhex(account.address[2:])
    assert (tx.nonce, tx.value, tx.data) == (fields["nonce"], fields["value"], fields["data"])


IDS = [RNG.bytes(32) for _ in range(3)]
CALLS = [
    ("register", []),
    ("claimJob", [7]),
    ("finalize", [2**200]),
    ("finalizeJobs", [[]]),
    ("finalizeJobs", [[1, 2, 3]]),
    ("commitJobs", [[4, 5, 6], IDS]),
    ("submitJob", [IDS[0], IDS[1], 1, 8, 8, 8, 1, 20]),
    ("submitJobs", [IDS[:2], IDS[1:], [1, 2], [3, 4], [5, 6], [7, 8], [0, 1], [10**15, 1], 20]),
]


@pytest.mark.parametrize("name, args", CALLS)
def test_call_data_equals_web3_encoding(name, args):
    assert call_data(getattr(MARKET.functions, name)(*args)) == \
        bytes.fromhex(MARKET.encode_abi(name, args)[2:])

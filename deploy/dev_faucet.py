"""Fund a worker's key from the dev faucet account before `needle-net worker up` stakes.

Only for a dev chain: the faucet is a genesis dev account of the PUBLIC test mnemonic
(docs/protocol.md), so anyone can spend it. On a chain where that is not acceptable,
leave the faucet off and send ETH to the worker's address yourself.

Creates DATA_DIR/key.json if missing (the worker then loads the same key), waits for the
chain node (it may still be starting), and tops the balance up to --amount ETH.

Usage: python dev_faucet.py --rpc-url URL --data-dir DIR [--password-file F] [--amount 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from web3 import Web3

from chain.devnet import dev_account
from node.devnet import FAUCET_INDEX
from node.keys import load_or_create, read_password

ETHER = 10**18
WAIT_SECONDS = 180.0


def top_up(rpc_url: str, address: str, amount_wei: int, deadline: float) -> int:
    """Send the missing balance from the faucet; retry while the node is unreachable or a
    concurrent replica took the faucet's nonce. Returns the wei sent."""
    faucet = dev_account(FAUCET_INDEX)
    w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 10}))
    while True:
        try:
            missing = amount_wei - w3.eth.get_balance(address)
            if missing <= 0:
                return 0
            tx = {"to": address, "value": missing, "gas": 21000, "chainId": w3.eth.chain_id,
                  "nonce": w3.eth.get_transaction_count(faucet.address, "pending"),
                  "maxFeePerGas": w3.eth.gas_price * 2, "maxPriorityFeePerGas": 0}
            tx_hash = w3.eth.send_raw_transaction(faucet.sign_transaction(tx).raw_transaction)
            w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30, poll_latency=0.1)
            return missing
        except Exception as err:  # noqa: BLE001 - node starting, nonce race: try again
            if time.time() > deadline:
                raise TimeoutError(f"could not fund {address} via {rpc_url}: {err}") from err
            print(f"faucet: {type(err).__name__}: {err}; retrying", file=sys.stderr)
            time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpc-url", required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--password-file", type=Path)
    parser.add_argument("--amount", type=float, default=5.0, help="ETH to hold.")
    args = parser.parse_args()
    account = load_or_create(args.data_dir / "key.json", read_password(args.password_file))
    sent = top_up(args.rpc_url, account.address, int(args.amount * ETHER),
                  time.time() + WAIT_SECONDS)
    print(f"faucet: {account.address} funded with {sent / ETHER:g} ETH", flush=True)


if __name__ == "__main__":
    main()

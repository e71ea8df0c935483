"""Development accounts of the local network.

The mnemonic is the PUBLIC, well-known test phrase used by Hardhat/Anvil: anyone
can derive its keys. It funds accounts on the local dev network only; never send
real value to these addresses.
"""
from __future__ import annotations

from functools import cache

from eth_account import Account
from eth_account.signers.local import LocalAccount

DEV_MNEMONIC = "test test test test test test test test test test test junk"
DEV_PATH = "m/44'/60'/0'/0/{index}"


@cache
def dev_account(index: int) -> LocalAccount:
    Account.enable_unaudited_hdwallet_features()
    return Account.from_mnemonic(DEV_MNEMONIC, account_path=DEV_PATH.format(index=index))


def dev_accounts(n: int) -> list[LocalAccount]:
    """The first n accounts of the dev mnemonic (BIP-44 path m/44'/60'/0'/0/i)."""
    return [dev_account(i) for i in range(n)]

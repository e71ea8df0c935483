"""needle-net's proof-of-useful-work chain on py-evm (see docs/chain.md)."""
import importlib.util
import os

# eth-hash picks its keccak backend at the first hash; safe-pysha3 is ~5x faster than the
# default (pycryptodome) and keccak is on every trie node and storage slot of the node.
if importlib.util.find_spec("sha3") is not None:
    os.environ.setdefault("ETH_HASH_BACKEND", "pysha3")

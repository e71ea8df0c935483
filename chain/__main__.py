import os

# keccak through safe-pysha3 is ~5x faster than eth-hash's default (pycryptodome); it must be
# chosen before the first hash is computed.
os.environ.setdefault("ETH_HASH_BACKEND", "pysha3")

from chain.cli import app  # noqa: E402

app(prog_name="chain")

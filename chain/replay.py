"""Re-validate a stored chain: re-execute every block on a fresh chain from genesis.

Re-execution re-runs each `finalize`, hence each Freivalds check, against a blob store;
a block whose recorded verified work does not verify there, or whose seal does not
commit to it, raises ``ValidationError`` naming the block; one whose check this node cannot
run (out of memory) raises ``CheckUnavailable``.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from eth.abc import ChainAPI
from eth.db.atomic import AtomicDB
from eth.db.chain import ChainDB
from eth.exceptions import CanonicalHeadNotFound
from eth_utils import ValidationError

from chain.blobs import BlobStore
from chain.db import DATABASE_FILE, DataDirError, SqliteDB, unreadable
from chain.genesis import genesis_params, genesis_state
from chain.precompile import CheckUnavailable
from chain.vm import build_chain_class


def replay(source: ChainAPI, store: BlobStore, upto: int | None = None) -> int:
    """Import blocks 1..upto of ``source`` into a fresh chain verifying against ``store``."""
    fresh = build_chain_class(store).from_genesis(AtomicDB(), genesis_params(), genesis_state())
    head = source.get_canonical_head().block_number if upto is None else upto
    for number in range(1, head + 1):
        block = source.get_canonical_block_by_number(number)
        try:
            fresh.import_block(block)
        except ValidationError as exc:
            raise ValidationError(f"block #{number} is invalid: {exc}") from exc
        except CheckUnavailable as exc:  # neither valid nor invalid: this node cannot tell
            raise CheckUnavailable(f"block #{number} could not be checked here: {exc}") \
                from exc
    return head


def verify_data_dir(data_dir: Path) -> int:
    """Replay a node's data directory (read only) against its own blob store; a directory
    that holds no chain (nothing is created in it) or a database sqlite cannot read is a
    ``DataDirError``."""
    path = data_dir / DATABASE_FILE
    if not path.is_file():
        raise DataDirError(f"{data_dir} is not a chain data dir (no {DATABASE_FILE} in it)")
    db = SqliteDB(path)
    try:
        base = AtomicDB(db)
        try:
            ChainDB(base).get_canonical_head()
        except CanonicalHeadNotFound:
            raise DataDirError(f"{path} holds no chain (no canonical head)") from None
        source = build_chain_class(BlobStore(data_dir / "blobs"))(base)
        return replay(source, BlobStore(data_dir / "blobs"))
    except sqlite3.DatabaseError as exc:
        raise unreadable(path, exc) from None
    finally:
        db.close()

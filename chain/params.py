"""Protocol constants shared by the VM, the genesis, the node and clients."""
from eth_utils import to_canonical_address

CHAIN_ID = 1414
# Fixed addresses: the market is pre-deployed in genesis; the pool pays block rewards.
MARKET_ADDRESS = to_canonical_address("0x000000000000000000000000000000000000c0de")
FREIVALDS_ADDRESS = to_canonical_address("0x00000000000000000000000000000000000000f1")
REWARD_POOL_ADDRESS = to_canonical_address("0x0000000000000000000000000000000000000fee")

ETHER = 10**18
GENESIS_GAS_LIMIT = 2_000_000_000
DEV_ACCOUNT_COUNT = 20
DEV_ACCOUNT_BALANCE = 10_000 * ETHER
REWARD_POOL_GENESIS = 1_000_000 * ETHER
# Block reward: paid from the pool to the workers verified in a block, pro rata to FLOPs.
REWARD_PER_GFLOP = ETHER // 1000
MAX_BLOCK_REWARD = 2 * ETHER

# Freivalds precompile gas: base + per element of A, B and C, per (round + load).
PRECOMPILE_BASE_GAS = 5_000
PRECOMPILE_ELEMENT_GAS = 1

# eth_getLogs answers for at most this many blocks after fromBlock (geth's default limit)
MAX_LOG_BLOCKS = 10_000

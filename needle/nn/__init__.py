"""Neural-network modules (CMU needle's `needle.nn`)."""
from .nn_basic import *  # noqa: F403
from .nn_conv import *  # noqa: F403
from .nn_sequence import *  # noqa: F403
from .nn_transformer import *  # noqa: F403

"""needle's operators: each Op computes on NDArrays and differentiates on Tensors.

Both the Op classes (EWiseAdd, Summation, Conv, ...) and their functions (add,
summation, conv, ...) are exported, as in CMU's needle.
"""

from . import ops_conv, ops_logarithmic, ops_mathematic, ops_shape, ops_tuple
from .ops_conv import *  # noqa: F403
from .ops_logarithmic import *  # noqa: F403
from .ops_mathematic import *  # noqa: F403
from .ops_shape import *  # noqa: F403
from .ops_tuple import *  # noqa: F403

__all__ = (
    ops_conv.__all__
    + ops_logarithmic.__all__
    + ops_mathematic.__all__
    + ops_shape.__all__
    + ops_tuple.__all__
)

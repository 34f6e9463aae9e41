"""cupa: PyTorch-free paged-attention decode for ROCm and CUDA GPUs, with a numpy fallback."""

from .api import decode
from .cache import OutOfBlocksError, PagedKVCache
from .merge import merge_states, merge_states_n
from .reference import paged_decode_reference

__version__ = "0.1.0"
__all__ = ["decode", "PagedKVCache", "OutOfBlocksError", "merge_states", "merge_states_n",
           "paged_decode_reference", "__version__"]

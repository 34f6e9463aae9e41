"""cupa: PyTorch-free paged-attention decode for ROCm and CUDA GPUs, with a numpy fallback."""

from .api import clear_plan_cache, decode, plan_decode
from .decode_plan import DecodePlan
from .cache import OutOfBlocksError, PagedKVCache
from .fp8 import dequantize_fp8, quantize_fp8
from .merge import merge_states, merge_states_n
from .reference import paged_decode_reference

__version__ = "0.1.0"
__all__ = ["decode", "plan_decode", "clear_plan_cache", "DecodePlan", "PagedKVCache",
           "OutOfBlocksError", "merge_states", "merge_states_n", "paged_decode_reference",
           "quantize_fp8", "dequantize_fp8", "__version__"]

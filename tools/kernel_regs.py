"""Print registers and local memory (spills) of the tensor-core decode kernels on this GPU, as the
device's own NVRTC builds them (another NVRTC may allocate differently: docs/perf-log.md v29
step 2). Run it before and after a change to the kernels' prologue: the dense forms sit at
their 128-register cap, and a few registers more spill them."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupa.gpu import catalogue  # noqa: E402
from cupa.gpu.compiler import kernels  # noqa: E402
from cupa.gpu.device import device_info  # noqa: E402

info = device_info()
for v in catalogue.all_mma_variants():
    if v.head_size not in (64, 128):
        continue
    fn = kernels(v, info.index)[v.partition_name]
    a = fn.attributes
    print(f"{v.partition_name:40s} regs {a['num_regs']:4d} local {a['local_size_bytes']:5d} B "
          f"smem {a['shared_size_bytes']:6d} B")

"""Everything that touches a GPU: the device, the kernel catalogue, the dispatch policy, the
planner, occupancy, the compilers (run time and offline) and the launches (the only place cupa
launches kernels). Nothing here imports cupy at import time."""

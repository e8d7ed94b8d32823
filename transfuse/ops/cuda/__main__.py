"""``python -m transfuse.ops.cuda``: build the CUDA kernels verbosely and say where they are.

Exit status 0 when the extension is built (or loaded from the cache), 1 when it cannot be.
"""

from __future__ import annotations

import sys
import time

from .build import build, csrc_dir, unavailable_reason


def main() -> int:
    reason = unavailable_reason()
    if reason is not None:
        print(f"transfuse: CUDA kernels cannot be built here: {reason}.")
        return 1
    print(f"transfuse: building the CUDA kernels from {csrc_dir()}", flush=True)
    start = time.perf_counter()
    module = build(verbose=True)
    print(f"transfuse: CUDA kernels ready in {time.perf_counter() - start:.1f} s: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

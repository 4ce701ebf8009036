"""A late process of a container: it starts CUDA through NVIDIA's runtime (libcudart through
ctypes) or CuPy, which make the primary context through the driver's private runtime table,
says how that went, then holds (prints ``ready``, waits for a line on stdin).

    python late_client.py cudart <libcudart path>
    python late_client.py cupy

Prints ``init=<cudaError>`` (0: it got a context), and for CuPy ``error=<exception type>`` and
``message=<its text>`` when CuPy raised. Exit status 0 whatever CUDA answered.
"""

from __future__ import annotations

import ctypes
import sys


def out(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def main() -> None:
    if sys.argv[1] == "cudart":
        rt = ctypes.CDLL(sys.argv[2])
        out("init", rt.cudaFree(None))  # makes the primary context
    else:
        import cupy as cp

        try:
            cp.cuda.runtime.free(0)  # cudaFree(0): makes the primary context
            out("init", 0)
        except Exception as e:  # what CuPy raises is the finding
            status = getattr(e, "status", -1)
            out("init", status)
            out("error", type(e).__module__ + "." + type(e).__qualname__)
            out("message", str(e).replace("\n", " "))
    print("ready", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()

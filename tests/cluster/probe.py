"""A CUDA start over simgpu, run inside a workload pod (``python3 -c``; standard library only).

Creates a context on device 0, reads cuMemGetInfo and tries one allocation a MiB past the
total; writes one JSON line to the termination log (what the test reads from an ended pod's
status) and to stdout (a running pod's log), and exits 0; or writes the failing call and
exits 3. With the argument ``hold`` it keeps its context (a live CUDA process) until killed.

The JSON also names the shim this process has mapped (``shim``: its path, inode and sha256,
null when none is mapped): the file is opened by the mapped path and hashed only when its inode
is the mapped one, so it is the code this process runs, not what a path names now.
"""

import ctypes
import hashlib
import json
import os
import sys
import time


def mapped_shim() -> "dict[str, object] | None":
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and "libvgpu" in fields[5]:
                path, inode = fields[5].strip(), int(fields[4])
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_ino != inode:
                        return {"path": path, "inode": inode, "sha256": None}
                    digest = hashlib.sha256(f.read()).hexdigest()
                return {"path": path, "inode": inode, "sha256": digest}
    return None


def main() -> int:
    out = open("/dev/termination-log", "w")  # noqa: SIM115
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        out.write(json.dumps({"error": f"dlopen libcuda.so.1: {exc}"}))
        return 3

    def check(rc: int, what: str) -> None:
        if rc != 0:
            out.write(json.dumps({"error": what, "rc": rc}))
            print(json.dumps({"error": what, "rc": rc}), flush=True)
            out.close()
            sys.exit(3)

    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    ptr = ctypes.c_uint64()
    over = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(total.value + (1 << 20)))
    result = json.dumps(
        {"total_mib": total.value >> 20, "over_limit_rc": over, "shim": mapped_shim()}
    )
    out.write(result)
    print(result, flush=True)
    out.close()
    while sys.argv[1:] == ["hold"]:
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())

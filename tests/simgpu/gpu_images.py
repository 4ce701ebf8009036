"""GPU images for the module tests: CUDA C compiled by NVIDIA's NVRTC (the nvidia-cuda-nvrtc-cu12
wheel, through ctypes) to cubins and PTX, fat binaries assembled around them, an LZ4 block
encoder for compressed entries, and an ELF reader for what an image should take on the GPU.
Holds no tests."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

FATBIN_MAGIC = 0xBA55ED50
ENTRY_PTX, ENTRY_ELF = 1, 2
FLAG_LZ4 = 0x2000


def _nvrtc() -> ctypes.CDLL:
    try:
        import nvidia.cuda_nvrtc  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip("nvidia-cuda-nvrtc-cu12 is not installed (pip install -e '.[test]')")
    for base in nvidia.cuda_nvrtc.__path__:
        for lib in sorted(Path(base).glob("lib/libnvrtc.so.*")):
            return ctypes.CDLL(str(lib))
    pytest.skip("nvidia-cuda-nvrtc-cu12 has no libnvrtc.so")


def compile_cuda(source: str, arch: str, ptx: bool = False) -> bytes:
    """`source` compiled for `arch` (e.g. "sm_90"; "compute_90" for PTX): a cubin, or PTX."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"t.cu", 0, None, None) == 0
    try:
        opts = [f"-arch={arch}".encode()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode()
        get_size, get = (
            (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
            if ptx
            else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        )
        assert get_size(prog, ctypes.byref(size)) == 0
        buf = ctypes.create_string_buffer(size.value)
        assert get(prog, buf) == 0
        return buf.raw.rstrip(b"\0") + b"\0" if ptx else buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def lz4_block(data: bytes) -> bytes:
    """An LZ4 block (the format fat binaries compress entries with): greedy matches of 4+ bytes
    found through a hash of the next 4 bytes, the last 5 bytes as literals as the format asks."""

    def length(n: int) -> bytes:  # what goes beyond the token's 15, in 255s
        out = bytearray()
        while n >= 255:
            out.append(255)
            n -= 255
        out.append(n)
        return bytes(out)

    out = bytearray()
    seen: dict[bytes, int] = {}
    end = len(data) - 5  # matches end before the last 5 bytes ...
    i = anchor = 0
    while i < len(data) - 12:  # ... and start at least 12 bytes before the end
        key = data[i : i + 4]
        cand = seen.get(key)
        seen[key] = i
        if cand is None or i - cand > 0xFFFF:
            i += 1
            continue
        mlen = 4
        while i + mlen < end and data[cand + mlen] == data[i + mlen]:
            mlen += 1
        lit = data[anchor:i]
        token = (min(len(lit), 15) << 4) | min(mlen - 4, 15)
        out.append(token)
        if len(lit) >= 15:
            out += length(len(lit) - 15)
        out += lit
        out += struct.pack("<H", i - cand)
        if mlen - 4 >= 15:
            out += length(mlen - 4 - 15)
        i += mlen
        anchor = i
    lit = data[anchor:]
    out.append(min(len(lit), 15) << 4)
    if len(lit) >= 15:
        out += length(len(lit) - 15)
    out += lit
    return bytes(out)


def fatbin(*entries: tuple[int, int, bytes, bool]) -> bytes:
    """A fat binary of (kind, arch, payload, compress) entries, laid out as nvcc's are: a 16-byte
    header, then per entry a 64-byte header and its payload padded to 8 bytes."""
    body = bytearray()
    for kind, arch, payload, compress in entries:
        data = lz4_block(payload) if compress else payload
        padded = data + b"\0" * (-len(data) % 8)
        flags = 0x11 | (FLAG_LZ4 if compress else 0)  # 64-bit, Linux host
        header = struct.pack(
            "<HHIQIIHHIIIQQQ",
            kind,
            0x101,
            64,
            len(padded),
            len(data),
            0,
            7 if kind == ENTRY_ELF else 8,
            1,
            arch,
            0,
            0,
            flags,
            0,
            len(payload) if compress else 0,
        )
        assert len(header) == 64
        body += header + padded
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + bytes(body)


def _sections(cubin: bytes) -> list[tuple[str, int, int]]:
    """(name, flags, size) of each section of an ELF64 cubin."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(off: int) -> str:
        return cubin[names_at + off : cubin.index(b"\0", names_at + off)].decode()

    return [(name(h[0]), h[2], h[5]) for h in headers]


def device_bytes(cubin: bytes) -> int:
    """What a cubin's loading takes on the GPU: its allocated sections (code, constant banks,
    variables) but per-block shared and per-thread local memory."""
    return sum(
        size
        for name, flags, size in _sections(cubin)
        if flags & 2 and not name.startswith((".nv.shared", ".nv.local"))
    )


def kernel_code(cubin: bytes, kernel: str) -> int:
    """The size of a kernel's code (its .text.<name> section)."""
    return sum(size for name, _flags, size in _sections(cubin) if name == f".text.{kernel}")

"""An inference server in miniature, for the demo and the client tier: PyTorch only.

``python -m vgpu_plugin.sim.inference --utilization 0.9 --requests N`` builds a small decoder
(random fp16 weights made on the GPU, nothing downloaded), sizes a paged KV cache from
``torch.cuda.mem_get_info()`` the way vLLM's ``gpu_memory_utilization`` does, serves requests
(a prefill, then one token at a time reading its cache blocks) and prints one JSON line:

- ``weights``, ``cache``, ``profile_peak``: bytes of the weights, the KV cache, and the
  activations' peak measured by a profiling forward pass of the longest batch;
- ``allowed``: what the budget leaves the cache, ``utilization x total - (used after
  loading and profiling) - (activation peak)``; the cache takes whole blocks of it;
- ``served``, ``gpu_ms`` (CUDA events around each request), ``cuda_total``, ``cuda_used``;
- sizing details: ``in_use`` (what CUDA showed in use when sizing), ``reserved`` (PyTorch's
  part of it), ``workspaces`` (tensors beyond the weights: cuBLAS's workspaces).

``--cache-mib M`` asks for a fixed cache instead (the pod that wants more than its slice):
an out-of-memory error is then the result (``"out_of_memory": true`` and the time, ``at``),
not a crash. With ``--hold S`` it prints its first line, keeps serving until its stdin ends
and S seconds more (stdin at ``/dev/null``: S seconds after that line), then prints a second
line with the totals and ``finished_at``, when each of those requests ended: the demo closes
the servers' stdin once the greedy pod has been refused, so that they serve past it on a host
however loaded.

On simgpu kernels compute nothing, so no value read back means anything: the control flow here
never depends on one. What is real is every allocation, copy, launch, stream and byte.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
BLOCK_TOKENS = 16  # tokens per cache block (vLLM's default block size)


@dataclass(frozen=True)
class ModelSpec:
    layers: int = 4
    d_model: int = 1024
    heads: int = 16
    ffn: int = 4096
    vocab: int = 32000
    prompt: int = 128  # tokens of prefill per request
    decode: int = 16  # tokens generated per request
    batch: int = 8  # requests in the profiling batch

    def block_bytes(self) -> int:
        """K and V of BLOCK_TOKENS tokens in every layer, fp16."""
        return 2 * self.layers * BLOCK_TOKENS * self.d_model * 2


TINY = ModelSpec(layers=2, d_model=256, heads=4, ffn=1024, vocab=4096, prompt=32, decode=4)


def load_torch() -> Any:
    """torch, as an untyped module (mypy checks this file the same with or without it)."""
    return importlib.import_module("torch")


class Server:
    def __init__(self, torch: Any, spec: ModelSpec) -> None:
        self.torch, self.spec = torch, spec
        nn = torch.nn
        kw = {"device": "cuda", "dtype": torch.float16}
        with torch.no_grad():
            self.embed = nn.Embedding(spec.vocab, spec.d_model, **kw)
            self.layers = [
                nn.TransformerEncoderLayer(
                    spec.d_model, spec.heads, spec.ffn, batch_first=True, dropout=0.0, **kw
                ).eval()
                for _ in range(spec.layers)
            ]
            self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, **kw)
        params = [p for m in [self.embed, *self.layers, self.head] for p in m.parameters()]
        self.weights = sum(p.numel() * p.element_size() for p in params)
        self.cache: Any = None
        self.blocks = 0

    def prefill(self, batch: int) -> Any:
        """The prompt of `batch` requests through every layer; K/V of each layer returned."""
        torch, s = self.torch, self.spec
        tokens = torch.randint(0, s.vocab, (batch, s.prompt), device="cuda")
        h = self.embed(tokens)
        kv = []
        for layer in self.layers:
            qkv = torch.nn.functional.linear(
                h, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias
            )
            kv.append(qkv[..., s.d_model :])
            h = layer(h)
        return self.head(h[:, -1]), kv

    def size_cache(self, utilization: float) -> dict[str, int]:
        """vLLM's sizing: profile the longest batch, then give the cache what is left of
        utilization x total after the weights, the context and the activations' peak."""
        torch = self.torch
        with torch.no_grad():
            self.prefill(self.spec.batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        allowed = int(utilization * total) - (total - free) - peak
        sizing = {
            "allowed": allowed,
            "profile_peak": peak,
            "in_use": total - free,
            # Tensors beyond the weights that live on (cuBLAS's workspaces, kept by torch).
            "workspaces": torch.cuda.memory_allocated() - self.weights,
            "reserved": torch.cuda.memory_reserved(),
        }
        self.allocate_cache(max(allowed, 0) // self.spec.block_bytes())
        return sizing

    def allocate_cache(self, blocks: int) -> None:
        s = self.spec
        shape = (s.layers, 2, blocks, BLOCK_TOKENS, s.d_model)
        self.cache = self.torch.empty(shape, dtype=self.torch.float16, device="cuda")
        self.blocks = blocks

    def serve(self, request: int) -> float:
        """One request: prefill into its cache blocks, then decode token by token, attending
        over the blocks it holds. Returns the GPU time it took (CUDA events), in ms."""
        torch, s = self.torch, self.spec
        F = torch.nn.functional
        per_request = -(-(s.prompt + s.decode) // BLOCK_TOKENS)
        first = (request * per_request) % max(self.blocks - per_request + 1, 1)
        slots = torch.arange(
            first * BLOCK_TOKENS, (first + per_request) * BLOCK_TOKENS, device="cuda"
        )
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.no_grad():
            logits, kv = self.prefill(1)
            flat = self.cache.view(s.layers, 2, -1, s.d_model)
            for i, both in enumerate(kv):
                k, v = both[0].split(s.d_model, dim=-1)
                flat[i, 0].index_copy_(0, slots[: s.prompt], k)
                flat[i, 1].index_copy_(0, slots[: s.prompt], v)
            hd = s.d_model // s.heads
            for step in range(s.decode):
                h = self.embed(logits.argmax(-1)).unsqueeze(1)
                n = s.prompt + step + 1
                for i, layer in enumerate(self.layers):
                    q, k, v = F.linear(
                        h, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias
                    ).chunk(3, dim=-1)
                    flat[i, 0, slots[n - 1]] = k[0, 0]
                    flat[i, 1, slots[n - 1]] = v[0, 0]
                    keys = flat[i, 0, slots[:n]].view(1, n, s.heads, hd).transpose(1, 2)
                    vals = flat[i, 1, slots[:n]].view(1, n, s.heads, hd).transpose(1, 2)
                    att = F.scaled_dot_product_attention(
                        q.view(1, 1, s.heads, hd).transpose(1, 2), keys, vals
                    )
                    h = h + layer.self_attn.out_proj(att.transpose(1, 2).reshape(1, 1, -1))
                    h = h + layer.linear2(F.relu(layer.linear1(h)))
                logits = self.head(h[:, -1])
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch = load_torch()
    # cuDNN's attention compiles its kernels at run time (NVRTC) for each new shape, the prefill's
    # and each decode step's KV length: on simgpu the first request took 4 s instead of 0.04 s
    # (torch 2.14.1 and 2.15.0). PyTorch's own fused attention kernels, compiled ahead, serve.
    torch.backends.cuda.enable_cudnn_sdp(False)
    spec = TINY if args.tiny else ModelSpec()
    server = Server(torch, spec)
    result: dict[str, Any] = {"weights": server.weights, "block_bytes": spec.block_bytes()}
    try:
        if args.cache_mib is None:
            result.update(server.size_cache(args.utilization))
        else:
            server.allocate_cache(args.cache_mib * MIB // spec.block_bytes())
    except torch.OutOfMemoryError as exc:
        message = str(exc).splitlines()[0][:200]
        result.update(out_of_memory=True, message=message, at=time.time())
        return result
    result.update(out_of_memory=False, cache=server.blocks * spec.block_bytes())
    gpu_ms = sum(server.serve(r) for r in range(args.requests))
    served = args.requests
    free, total = torch.cuda.mem_get_info()
    result.update(served=served, gpu_ms=gpu_ms, cuda_total=total, cuda_used=total - free)
    if args.hold > 0:
        print(json.dumps(result), flush=True)
        ended: list[float] = []  # when stdin ended (monotonic)
        threading.Thread(target=_until_eof, args=(ended,), daemon=True).start()
        finished: list[float] = []
        while not ended or time.monotonic() < ended[0] + args.hold:
            gpu_ms += server.serve(served)
            served += 1
            finished.append(time.time())  # wall clock: the demo compares it across pods
        result.update(served=served, gpu_ms=gpu_ms, finished_at=finished)
    return result


def _until_eof(ended: list[float]) -> None:
    """Reads stdin to its end, then notes when (``--hold``)."""
    if sys.stdin is not None:
        sys.stdin.read()
    ended.append(time.monotonic())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vgpu_plugin.sim.inference")
    ap.add_argument("--utilization", type=float, default=0.9, help="share of the GPU to use")
    ap.add_argument("--cache-mib", type=int, help="a fixed KV cache instead of sizing one")
    ap.add_argument("--requests", type=int, default=4, help="requests served before reporting")
    ap.add_argument(
        "--hold", type=float, default=0.0, help="after its first line: until stdin ends, +S s"
    )
    ap.add_argument("--tiny", action="store_true", help="a small model (the client tier's)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result = run(args)
    except Exception as exc:  # the result line is how the demo learns what went wrong
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

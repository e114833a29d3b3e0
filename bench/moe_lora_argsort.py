"""ascend-moe-lora-argsort-fp32 on this CPU: the real routing recovery of vllm-ascend, stock and patched.

    python bench/moe_lora_argsort.py            # T = 32 ... 4096 tokens, top-8 of 128 experts (~10 s)
    python bench/moe_lora_argsort.py --quick

Runs ``_recover_moe_lora_routing_allgather`` from the real ``vllm_ascend/lora/fused_moe.py`` of vllm-ascend 0.27.1rc1
(``omni_patches.testing.Release``: torch_npu and the file's other imports are stand-ins; the function uses torch
alone) on npu_moe_init_routing-shaped inputs, in one child: stock (integer argsort keys) and the function built by
``make_fp32_keys`` (float32 keys), interleaved, median of the repeats. The patch is for the NPU, where upstream
measured the integer argsort ~21x slower (vllm-ascend #16486: 3.64 ms against 0.174 ms at T=4096); a CPU sorts
integers with its own kernels, so this says what the cast costs here, not what it saves there.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VERSION = "0.27.1rc1"
TORCH_NPU = "import torch as _t\nfrom unittest.mock import MagicMock as _M\nif not hasattr(_t, 'npu'):\n    _t.npu = _M()\n"


def measure(tokens_list, top_k, experts, repeats):
    """In the child: ms per call (median), stock and patched, per token count."""
    import types

    import torch

    from omni_patches.patches.ascend_moe_lora_argsort_fp32 import PATCH_ID, make_fp32_keys
    from omni_patches.runs import PatchRun
    from vllm_ascend.lora import fused_moe

    torch.set_num_threads(1)
    stock = fused_moe._recover_moe_lora_routing_allgather
    patched = make_fp32_keys(stock, PatchRun.standalone(PATCH_ID))
    rows = []
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(tokens)
        topk_ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(torch.int32)
        flat = topk_ids.reshape(-1)
        expanded = torch.empty_like(flat)
        expanded[torch.sort(flat, stable=True).indices] = torch.arange(flat.numel(), dtype=torch.int32)
        ctx = types.SimpleNamespace(top_k=top_k, punica_wrapper=types.SimpleNamespace(
            token_lora_indices=torch.randint(-1, 4, (tokens + 8,), generator=g)))
        times = {"stock": [], "patched": []}
        for _ in range(repeats):
            for label, fn in (("stock", stock), ("patched", patched)):
                t = time.perf_counter()
                fn(ctx, expanded, topk_ids)
                times[label].append(time.perf_counter() - t)
        a, b = fn(ctx, expanded, topk_ids), stock(ctx, expanded, topk_ids)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        rows.append([tokens, statistics.median(times["stock"]) * 1e3, statistics.median(times["patched"]) * 1e3])
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from omni_patches.testing import Release

    import moe_lora_argsort as me  # Release.call needs an importable module, not __main__

    rel = Release("vllm-ascend", VERSION, files=["vllm_ascend/lora/fused_moe.py", "vllm_ascend/lora/__init__.py"],
                  auto_standins=True, passthrough=("torch",), standins={"torch_npu": TORCH_NPU})
    tokens = [32, 512] if args.quick else [32, 128, 512, 2048, 4096]
    rows = rel.call(me.measure, tokens, 8, 128, 5 if args.quick else 50)
    print(f"vllm-ascend {VERSION} _recover_moe_lora_routing_allgather, top-8 of 128 experts, CPU, 1 thread")
    print("| tokens | stock (int keys) ms | patched (float32 keys) ms | patched / stock |")
    print("|---|---|---|---|")
    for t, s, p in rows:
        print(f"| {t} | {s:.3f} | {p:.3f} | {p / s:.2f}x |")


if __name__ == "__main__":
    main()

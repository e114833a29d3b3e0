"""Write the tiny Wan2.1 text-to-video model the serving tier serves, and LoRA files for it (nothing downloaded).

Run with the *stack* interpreter (it needs torch, diffusers, transformers, tokenizers, safetensors)::

    <stack python> tests/support/serving_model.py OUT_DIR

``OUT_DIR/model`` is a diffusers ``WanPipeline`` (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``; ~400 KB, written with ``save_pretrained``) that vllm-omni maps to
its own Wan pipeline: a 2-block transformer, a ``base_dim=3`` VAE, a 1-layer UMT5 encoder and a word-level
tokenizer built with ``tokenizers``. The VAE's biases are zero: with random ones a VAE this small paints the same
picture whatever the latents hold (seed and LoRA then move a 64x64 PNG by <1/255 on average; without, ~12/255). Weights are random but seeded: every run writes the same bytes, so a shim
server and a stock server read the same model. LoRA files, every 2-D weight of the transformer blocks, rank 4:

* ``lora-bf16.safetensors`` / ``lora-fp32.safetensors`` -- diffusers-style keys
  (``transformer.blocks.0.attn1.to_q.lora_A.weight``), what ``--lora-backend distill --lora-path X`` loads through
  vllm-omni's ``LoraLoaderMixin`` (the loader ``lora-accel-delta`` / ``lora-cpu-fused-delta`` wrap). The factors
  are bf16-representable, so the fp32 file holds exactly the bf16 file's values in another dtype: stock computes
  the same ``B @ A`` from either (a rank-4 sum of exact bf16 products, accumulated in fp32) and rounds it once to
  the bf16 weight, so one stock server (bf16 LoRA) is the reference for both;
* ``lora-peft/`` -- the same factors as a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``), what a per-request ``"lora": {"name", "path", "scale"}`` loads through
  ``DiffusionLoRAManager``.

Prints one JSON line: the paths and sizes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = ("a red cat sits on the mat blue dog runs in park green tree under sky").split()
LORA_RANK = 4
# Large enough that the LoRA visibly changes the image of this random model, small enough to stay finite in bf16.
LORA_STD = 0.2


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=32)
    fast.save_pretrained(out)
    return len(vocab)


def write_model(root: Path) -> dict:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    model_dir = root / "model"
    torch.manual_seed(0)
    vocab_size = _tokenizer(model_dir / "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    z_dim = 4
    vae = AutoencoderKLWan(base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    with torch.no_grad():  # else the random biases of so small a VAE set the image, whatever the latents hold
        for name, p in vae.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=z_dim, out_channels=z_dim,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)
    pipe.save_pretrained(model_dir)
    return {"model": str(model_dir), "transformer": transformer, "pipeline": pipe}


def lora_factors(transformer) -> dict:
    """``{base_name: (A, B)}`` in fp32 for every 2-D weight of the transformer blocks, seeded."""
    import torch

    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, p in transformer.named_parameters():
        if not name.startswith("blocks.") or p.dim() != 2 or not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        a = torch.randn(LORA_RANK, p.shape[1], generator=gen) * LORA_STD
        b = torch.randn(p.shape[0], LORA_RANK, generator=gen) * LORA_STD
        # bf16-representable: the fp32 file holds exactly the bf16 file's values (see the module doc).
        out[base] = (a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float())
    return out


def write_loras(root: Path, transformer) -> dict:
    import torch
    from safetensors.torch import save_file

    factors = lora_factors(transformer)
    paths = {}
    for tag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        sd = {}
        for base, (a, b) in factors.items():
            sd[f"transformer.{base}.lora_A.weight"] = a.to(dtype).contiguous()
            sd[f"transformer.{base}.lora_B.weight"] = b.to(dtype).contiguous()
        path = root / f"lora-{tag}.safetensors"
        save_file(sd, str(path))
        paths[f"lora_{tag}"] = str(path)
    peft = root / "lora-peft"
    peft.mkdir(exist_ok=True)
    sd = {}
    for base, (a, b) in factors.items():
        # vllm-omni's module names (what DiffusionLoRAManager matches): to_out, ffn.net_0.proj, ffn.net_2.
        name = base.replace(".to_out.0", ".to_out").replace(".ffn.net.0.", ".ffn.net_0.").replace(".ffn.net.2",
                                                                                                  ".ffn.net_2")
        sd[f"base_model.model.{name}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        sd[f"base_model.model.{name}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in sd})
    save_file(sd, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_RANK, "target_modules": targets,
        "bias": "none", "task_type": None, "base_model_name_or_path": None}, indent=1))
    paths["lora_peft"] = str(peft)
    paths["lora_layers"] = len(factors)
    # The claim above, checked on these factors: B @ A rounded to bf16 from the bf16 and from the fp32 file.
    paths["bf16_fp32_delta_mismatches"] = sum(
        int(((b.to(torch.bfloat16) @ a.to(torch.bfloat16)) != (b @ a).to(torch.bfloat16)).sum())
        for a, b in factors.values())
    return paths


SENSITIVITY_PROMPTS = ("a red cat sits on the mat", "blue dog runs in park")
SENSITIVITY_SEEDS = range(4)


def rounding_sensitivity(pipe, transformer) -> dict:
    """How far this model's 64x64, 2-step image moves from rounding alone, in diffusers' own ``WanPipeline`` (bf16).

    The bf16 LoRA is merged twice into the bf16 weights: as stock's loader does (``W + bf16(B @ A)``, two
    roundings) and rounded once (``bf16(fp32(W) + B @ A)``, what ``lora-cpu-fused-delta`` computes). A random model
    this small in bf16 is chaotic: the mean absolute pixel difference (0-255) of the two images varies from ~1.5 to
    ~6.5 with the seed and prompt, so it is measured for 4 seeds x 2 prompts and the largest is the scale against
    which the served fused image is judged. ``lora_effect_mean``: the LoRA's own effect (stock merge vs none).
    """
    import numpy as np
    import torch

    pipe.to(torch.bfloat16)
    params = dict(transformer.named_parameters())
    saved = {k: v.detach().clone() for k, v in params.items()}
    factors = lora_factors(transformer)

    def merge(mode):
        with torch.no_grad():
            for k, v in saved.items():
                params[k].copy_(v)
            for name, (a, b) in factors.items():
                w = params[name + ".weight"]
                if mode == "stock":
                    w.add_(b.to(torch.bfloat16) @ a.to(torch.bfloat16))
                elif mode == "once":
                    w.copy_((w.float() + b @ a).to(torch.bfloat16))

    def image(prompt, seed):
        out = pipe(prompt, height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=1.0,
                   generator=torch.Generator().manual_seed(seed), output_type="np").frames[0][0]
        return np.clip(np.round(out.astype(np.float32) * 255), 0, 255)

    rounding, effect = [], []
    for prompt in SENSITIVITY_PROMPTS:
        for seed in SENSITIVITY_SEEDS:
            images = {}
            for mode in ("none", "stock", "once"):
                merge(mode)
                images[mode] = image(prompt, seed)
            rounding.append(float(np.abs(images["stock"] - images["once"]).mean()))
            effect.append(float(np.abs(images["stock"] - images["none"]).mean()))
    merge("none")
    return {"rounding_means": [round(x, 3) for x in rounding], "rounding_mean_max": max(rounding),
            "lora_effect_mean": min(effect)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0])
    root.mkdir(parents=True, exist_ok=True)
    written = write_model(root)
    info = {"model": written["model"], **write_loras(root, written["transformer"])}
    info.update(rounding_sensitivity(written["pipeline"], written["transformer"]))
    info["model_bytes"] = sum(p.stat().st_size for p in Path(info["model"]).rglob("*") if p.is_file())
    print("SERVING_MODEL " + json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

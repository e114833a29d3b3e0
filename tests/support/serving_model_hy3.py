"""Write a tiny random HunyuanImage3 (DiT-only serving) model, and the deploy YAML that serves it (nothing downloaded).

Run with the *stack* interpreter of vllm-omni 0.22.0 (it imports vllm-omni's own HunyuanImage3 modules to build the
plain-torch parts and name their weights)::

    <stack python> tests/support/serving_model_hy3.py OUT_DIR
    <stack python> tests/support/serving_model_hy3.py --deploy-yaml PATH [--tp N] [--cfg N] [--ulysses N]
                                                      [--ring N] [--ep] [--seed N]

``OUT_DIR/model`` holds what vllm-omni 0.22.0's ``HunyuanImage3Pipeline`` reads:

* ``config.json`` -- ``architectures: [HunyuanImage3ForCausalMM]`` and an ``auto_map`` naming
  ``configuration_tiny_hy3.TinyHunyuanImage3Config``, a subclass of vllm-omni's ``HunyuanImage3Config`` written next to
  it (``get_config(..., trust_remote_code=True)`` loads it; under transformers 5 it sets ``use_cache`` itself, which
  the base class's ``PretrainedConfig`` no longer keeps). 2 layers, hidden 64, 4 heads / 4 kv heads (qk norm),
  8 routed experts top-2 (``moe_intermediate_size`` 32) plus one shared expert, ``image_base_size`` 64 (a 64x64 image
  is 4x4 latent tokens through a 16x VAE);
* ``generation_config.json`` (flow shift, ``sequence_template: pretrain``);
* a word-level tokenizer (``tokenizers``) whose added tokens are the pipeline's specials (``<boi>``, ``<img>``,
  ``<img_ratio_0..36>``, ``<img_size_64>``, ``<timestep>``, ...);
* ``model.safetensors`` (bf16): every parameter the real ``load_weights`` expects, in the checkpoint's own naming
  (``model.layers.N.self_attn.qkv_proj``, ``mlp.gate.wg``, ``mlp.experts.E.gate_and_up_proj``, ``model.wte``,
  ``model.ln_f``, ...), the plain-torch parts (VAE with 32-channel levels, SigLIP2 vision tower, patch embed / final
  layer UNets, timestep embedders, aligner) named from the real modules' ``state_dict``.

Weights are random but seeded, scaled so that the image has real contrast and the MoE matters to it: every norm
scale 1 (norm biases 0), routed experts std ``EXPERT_STD``, router std ``ROUTER_STD``, everything else std
``REST_STD``, and the VAE's biases zero (with random ones a VAE this small paints the same picture whatever the
latents hold). Prints one JSON line ``SERVING_MODEL_HY3 {...}``: the model path, sizes, parameter counts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# -- the architecture ---------------------------------------------------------------------------------------------
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 4
HEAD_DIM = HIDDEN // HEADS
EXPERTS = 8
TOPK = 2
MOE_INTERMEDIATE = 32
INTERMEDIATE = 64  # the shared expert's (and a dense layer's) MLP width
PATCH_EMBED_HIDDEN = 64  # GroupNorm(32, .) inside the patch embed / final layer: a multiple of 32
IMAGE_BASE = 64
LATENT = 8
VAE_CHANNELS = [32] * 5  # 16x spatial: log2(16) = 4 downsampling levels, 5 levels
VIT = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
       "patch_size": 16, "num_channels": 3, "num_patches": 256, "layer_norm_eps": 1e-6,
       "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0}

EXPERT_STD = 0.2
ROUTER_STD = 0.3
REST_STD = 0.05
SEED = 0

WORDS = "a red cat sits on the mat blue dog runs in park green tree under sky".split()
# The specials the pipeline's tokenizer wrapper and templates look up (hunyuan_image3_tokenizer.py), by name.
SPECIALS = (["<|startoftext|>", "<|endoftext|>", "<pad>", "<unk>", "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>",
             "<guidance>", "<joint_img_sep>", "<answer>", "</answer>", "<recaption>", "</recaption>", "<think>",
             "</think>", f"<img_size_{IMAGE_BASE}>", "<img_size_1024>"]
            + [f"<img_ratio_{i}>" for i in range(37)])

CONFIG_MODULE = "configuration_tiny_hy3"
CONFIG_CLASS = "TinyHunyuanImage3Config"
_CONFIG_SOURCE = f'''"""TEST SUPPORT: the tiny HunyuanImage3's config class (tests/support/serving_model_hy3.py)."""
from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import HunyuanImage3Config


class {CONFIG_CLASS}(HunyuanImage3Config):
    model_type = "hunyuan_image_3_moe"

    def __init__(self, use_cache=True, **kwargs):
        super().__init__(use_cache=use_cache, **kwargs)
        # transformers 5's PretrainedConfig drops use_cache from the base init: the pipeline reads it.
        self.use_cache = use_cache
'''


def _tokenizer(out: Path) -> dict:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for tok in SPECIALS + WORDS:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=4096)
    fast.save_pretrained(out)
    return {"vocab_size": len(vocab), "bos": vocab["<|startoftext|>"], "eos": vocab["<|endoftext|>"],
            "pad": vocab["<pad>"]}


def _config(tok: dict) -> dict:
    vae = {"_class_name": "AutoencoderKLConv3D", "in_channels": 3, "out_channels": 3, "latent_channels": LATENT,
           "block_out_channels": VAE_CHANNELS, "layers_per_block": 1, "ffactor_spatial": 16, "ffactor_temporal": 4,
           "sample_size": IMAGE_BASE, "sample_tsize": 4, "scaling_factor": 1.0, "shift_factor": None,
           "downsample_match_channel": True, "upsample_match_channel": True}
    return {
        "architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
        "auto_map": {"AutoConfig": f"{CONFIG_MODULE}.{CONFIG_CLASS}"},
        "vocab_size": tok["vocab_size"], "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "attention_head_dim": HEAD_DIM, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "use_cache": True, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "use_qk_norm": True, "use_cla": False,
        "norm_type": "rms", "num_experts": EXPERTS, "use_mixed_mlp_moe": True, "num_shared_expert": 1,
        "moe_topk": TOPK, "moe_layer_num_skipped": 0, "norm_topk_prob": True, "tie_word_embeddings": False,
        "bos_token_id": tok["bos"], "eos_token_id": tok["eos"], "pad_token_id": tok["pad"],
        "vae_downsample_factor": [16, 16], "img_proj_type": "unet", "patch_size": 1,
        "patch_embed_hidden_dim": PATCH_EMBED_HIDDEN, "image_base_size": IMAGE_BASE, "torch_dtype": "bfloat16",
        "vae": vae, "vit": VIT,
        "vit_processor": {"patch_size": VIT["patch_size"], "max_num_patches": VIT["num_patches"],
                          "do_resize": True, "do_rescale": True, "do_normalize": True,
                          "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": VIT["hidden_size"], "n_embed": HIDDEN,
                        "depth": 2},
    }


def _transformer_shapes(vocab_size: int) -> dict:
    """Checkpoint names and shapes of the vLLM-parallel parts (the LLM-style transformer, the SigLIP2 tower)."""
    shapes = {"model.wte.weight": (vocab_size, HIDDEN), "model.ln_f.weight": (HIDDEN,),
              "lm_head.weight": (vocab_size, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (HIDDEN,), f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.qkv_proj.weight": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.self_attn.query_layernorm.weight": (HEAD_DIM,), f"{p}.self_attn.key_layernorm.weight": (HEAD_DIM,),
            f"{p}.mlp.gate.wg.weight": (EXPERTS, HIDDEN),
            f"{p}.mlp.shared_mlp.gate_and_up_proj.weight": (2 * INTERMEDIATE, HIDDEN),
            f"{p}.mlp.shared_mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
        for e in range(EXPERTS):
            shapes[f"{p}.mlp.experts.{e}.gate_and_up_proj.weight"] = (2 * MOE_INTERMEDIATE, HIDDEN)
            shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (HIDDEN, MOE_INTERMEDIATE)
    v, d = "vision_model", VIT["hidden_size"]
    patch_in = VIT["num_channels"] * VIT["patch_size"] ** 2
    shapes.update({f"{v}.embeddings.patch_embedding.weight": (d, patch_in),
                   f"{v}.embeddings.patch_embedding.bias": (d,),
                   f"{v}.embeddings.position_embedding.weight": (VIT["num_patches"], d),
                   f"{v}.post_layernorm.weight": (d,), f"{v}.post_layernorm.bias": (d,)})
    for i in range(VIT["num_hidden_layers"]):
        p = f"{v}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (d, d)
            shapes[f"{p}.self_attn.{proj}.bias"] = (d,)
        for ln in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{ln}.weight"] = (d,)
            shapes[f"{p}.{ln}.bias"] = (d,)
        inner = VIT["intermediate_size"]
        shapes.update({f"{p}.mlp.fc1.weight": (inner, d), f"{p}.mlp.fc1.bias": (inner,),
                       f"{p}.mlp.fc2.weight": (d, inner), f"{p}.mlp.fc2.bias": (d,)})
    return shapes


def _torch_part_shapes(config: dict) -> tuple[dict, set]:
    """Names and shapes of the plain-torch parts, from vllm-omni's own modules (built on the CPU, then dropped),
    and the names of their GroupNorm / LayerNorm modules."""
    import torch
    from vllm_omni.diffusion.models.hunyuan_image3.autoencoder import AutoencoderKLConv3D
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import (LightProjector,
                                                                                      TimestepEmbedder, UNetDown,
                                                                                      UNetUp)

    vae_kwargs = {k: v for k, v in config["vae"].items() if not k.startswith("_")}
    parts = {
        "vae": AutoencoderKLConv3D(**vae_kwargs),
        "vision_aligner": LightProjector(config["vit_aligner"]),
        "timestep_emb": TimestepEmbedder(hidden_size=HIDDEN),
        "time_embed": TimestepEmbedder(hidden_size=HIDDEN),
        "time_embed_2": TimestepEmbedder(hidden_size=HIDDEN),
        "patch_embed": UNetDown(patch_size=1, emb_channels=HIDDEN, in_channels=LATENT,
                                hidden_channels=PATCH_EMBED_HIDDEN, out_channels=HIDDEN),
        "final_layer": UNetUp(patch_size=1, emb_channels=HIDDEN, in_channels=HIDDEN,
                              hidden_channels=PATCH_EMBED_HIDDEN, out_channels=LATENT, out_norm=True),
    }
    shapes, norms = {}, set()
    for prefix, module in parts.items():
        for mname, sub in module.named_modules():
            if isinstance(sub, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
                norms.add(f"{prefix}.{mname}")
        for name, t in module.state_dict().items():
            shapes[f"{prefix}.{name}"] = tuple(t.shape)
    return shapes, norms


def _is_norm(name: str, torch_norms: set) -> bool:
    owner = name.rsplit(".", 1)[0]
    return owner in torch_norms or any(k in name for k in ("layernorm", "layer_norm", "ln_f"))


def _values(shapes: dict, torch_norms: set) -> dict:
    """Seeded random tensors by name: norms (scale 1, bias 0), experts, router, VAE biases, the rest (module doc)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if _is_norm(name, torch_norms):
            t = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        elif name.startswith("vae.") and name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            std = (EXPERT_STD if ".mlp.experts." in name else ROUTER_STD if ".mlp.gate.wg." in name else REST_STD)
            t = torch.randn(shape, generator=gen) * std
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def write_model(root: Path) -> dict:
    from safetensors.torch import save_file

    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(model)
    config = _config(tok)
    (model / "config.json").write_text(json.dumps(config, indent=1))
    (model / f"{CONFIG_MODULE}.py").write_text(_CONFIG_SOURCE)
    (model / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok["bos"], "eos_token_id": tok["eos"], "pad_token_id": tok["pad"], "flow_shift": 3.0,
        "drop_think": False, "sequence_template": "pretrain", "max_length": 512, "diff_infer_steps": 2,
        "diff_guidance_scale": 1.0}, indent=1))
    shapes = _transformer_shapes(tok["vocab_size"])
    torch_shapes, torch_norms = _torch_part_shapes(config)
    shapes.update(torch_shapes)
    tensors = _values(shapes, torch_norms)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return {"model": str(model), "tensors": len(tensors),
            "parameters": int(sum(t.numel() for t in tensors.values())),
            "model_bytes": sum(p.stat().st_size for p in model.rglob("*") if p.is_file())}


# -- deploy YAML --------------------------------------------------------------------------------------------------
def deploy_yaml(path, *, tp: int = 1, cfg: int = 1, ulysses: int = 1, ring: int = 1, ep: bool = False,
                seed: int = 42) -> Path:
    """Write a DiT-only deploy YAML (``pipeline: hunyuan_image3_dit``, one diffusion stage) for ``--deploy-config``,
    in vllm-omni 0.22.0's schema (``vllm_omni/deploy/hunyuan_image3_dit.yaml``): the stage's ``parallel_config``
    carries the parallel sizes and ``enable_expert_parallel`` (``--enable-expert-parallel`` is refused under
    ``--omni`` in 0.22). ``devices`` lists one "device" per rank (the CPU platform answers the count)."""
    world = tp * cfg * ulysses * ring
    lines = [
        "# omni-patches TEST SUPPORT: the tiny HunyuanImage3 served DiT-only (tests/support/serving_model_hy3.py)",
        "pipeline: hunyuan_image3_dit",
        "async_chunk: false",
        "stages:",
        "  - stage_id: 0",
        "    max_num_seqs: 1",
        "    enforce_eager: true",
        f'    devices: "{",".join(str(i) for i in range(world))}"',
        "    vae_use_slicing: false",
        "    vae_use_tiling: false",
        "    parallel_config:",
        "      pipeline_parallel_size: 1",
        "      data_parallel_size: 1",
        f"      tensor_parallel_size: {tp}",
        f"      enable_expert_parallel: {'true' if ep else 'false'}",
        f"      sequence_parallel_size: {ulysses * ring}",
        f"      ulysses_degree: {ulysses}",
        f"      ring_degree: {ring}",
        f"      cfg_parallel_size: {cfg}",
        "      vae_patch_parallel_size: 1",
        "      use_hsdp: false",
        "      hsdp_shard_size: -1",
        "      hsdp_replicate_size: 1",
        "    default_sampling_params:",
        f"      seed: {seed}",
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--deploy-yaml")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cfg", type=int, default=1)
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=1)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.deploy_yaml:
        print(deploy_yaml(args.deploy_yaml, tp=args.tp, cfg=args.cfg, ulysses=args.ulysses, ring=args.ring,
                          ep=args.ep, seed=args.seed))
        return 0
    if not args.out:
        ap.error("OUT_DIR or --deploy-yaml is needed")
    info = write_model(Path(args.out))
    print("SERVING_MODEL_HY3 " + json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

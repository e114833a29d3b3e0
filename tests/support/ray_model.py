"""Write a tiny random Llama and a tiny word-level tokenizer into a directory (no download).

Run with the stack interpreter: ``python ray_model.py DIR``. Two layers, hidden 256, 4 attention heads of 64
(a head size vLLM's CPU attention supports; 16 is refused) and 2 KV heads (both divisible by TP=2), float32;
the tokenizer is built with ``tokenizers`` and saved through
transformers' ``PreTrainedTokenizerFast``, so vLLM loads both the way it loads any local checkpoint.
"""
import sys

WORDS = ["hello", "world", "the", "patch", "is", "applied", "on", "every", "node", "ray", "worker", "shim"]


def write(directory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    vocab.update({f"w{i}": len(vocab) for i in range(64 - len(vocab))})  # 64 ids: a round vocabulary
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(directory)


if __name__ == "__main__":
    write(sys.argv[1])

"""Build a tiny random Llama (default: 2 layers, hidden 128, 2 heads of 64, vocab 1000) with an
offline WordLevel tokenizer (tokens ``w3`` .. ``w999``) into a folder: a real model for vLLM with
no hub access. Its chat template renders roles as words of the vocabulary (system ``w4``, user
``w5``, assistant ``w6``), so ``/v1/chat/completions`` works and every token is a real one.
Deterministic (seed 0). Run with the engine venv's Python (needs transformers, tokenizers, torch;
``--tokenizer-only`` needs no torch):

    python scripts/engines/make_tiny_llama.py OUT_DIR [--layers 8 --hidden 1024 --heads 8]

``--llama-3.2-1b`` takes Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV heads,
intermediate 8192, bfloat16; this small vocabulary, untied): random weights, real timings.
"""

from __future__ import annotations

import argparse
import os

VOCAB = 1000
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}"
    "{% if m['role'] == 'system' %}w4{% elif m['role'] == 'user' %}w5{% else %}w6{% endif %} "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w6{% endif %}")


def build_tokenizer(out: str) -> str:
    """Write only the tokenizer (and its chat template) to ``out``: needs no torch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def build(out: str, layers: int = 2, hidden: int = 128, heads: int = 2,
          kv_heads: int | None = None, intermediate: int | None = None,
          dtype: str = "float32", max_positions: int = 1024) -> str:
    """Write the model and tokenizer to ``out``; return ``out``. ``kv_heads``: default
    ``heads``; ``intermediate``: default ``2 * hidden``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden,
                      intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads or heads,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, torch_dtype=dtype)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return build_tokenizer(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="tiny-llama", help="folder to write")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2, help="attention heads")
    ap.add_argument("--kv-heads", type=int, help="KV heads (default: --heads)")
    ap.add_argument("--intermediate", type=int, help="MLP width (default: 2 x --hidden)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-positions", type=int, default=1024)
    ap.add_argument("--llama-3.2-1b", dest="llama_1b", action="store_true",
                    help="Llama-3.2-1B's shape (overrides the sizes above)")
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="write only the tokenizer and chat template (no torch needed)")
    a = ap.parse_args()
    if a.tokenizer_only:
        build_tokenizer(a.out)
    elif a.llama_1b:
        build(a.out, layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192,
              dtype="bfloat16", max_positions=8192)
    else:
        build(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.dtype,
              a.max_positions)
    print("tiny-llama:", os.path.abspath(a.out))

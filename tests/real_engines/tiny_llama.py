"""Write a tiny random-weight Llama (Hugging Face layout) with its own tokenizer, for vLLM.

Runs in the real-engine check's vLLM environment (`transformers`, `tokenizers`, `torch`),
not the product's: `python tiny_llama.py OUT_DIR`. No model hub: the byte-level BPE is
trained here on a few sentences, and the weights are random with a fixed seed, so every
build is the same model. vLLM's CPU attention needs a head size of at least 32: hidden
128 with 2 heads (head size 64), 2 layers, about 440k parameters.
"""

from __future__ import annotations

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; `continue_final_message` needs the final assistant turn left open, which vLLM
# does by cutting the rendered prompt after that turn's content.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "hello there, the router sends each request to an agent in front of an engine.",
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9.",
    "Agents join the router over libp2p, and the engine streams tokens back.",
    "Prefix caching keeps the keys and values of a prompt that was seen before.",
    "héllo wörld, ça va? naïve café — unicode text with accents and symbols: € £ ¥.",
]


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def main(out: str) -> None:
    torch.manual_seed(48)
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Random weights: scale the output layer up so greedy answers vary token to token
    # instead of repeating one token (and the end-of-text token stays unlikely).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[config.eos_token_id].fill_(0.0)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])

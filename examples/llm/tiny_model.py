"""A tiny generative model in Hugging Face format, built here: a Llama-shaped model from a
config (random weights, seeded) and a BPE tokenizer trained on a small corpus, with a chat
template, saved as any model folder is and loaded by the real loading path. No download.

Its text is nonsense (its weights are random): it shows the machinery, and the test suite
and the benchmark build it too. For real text, point the job's `model` at a real model's
folder (`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir model`)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "</s>", "<s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS = (  # noqa: SIM905 - words as a paragraph, not a column
    "the a of to and in is it that for on with as was by at from this be are or an not have "
    "model row shard worker master job output input token prompt answer text summary label "
    "river night cluster idle capacity batch stage engine cache memory window light stone quick "
    "brown fox jumps over lazy dog green blue red yellow small large early late again"
).split()


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def build_tiny_llm(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 600,
    context: int = 256,
    bos: bool = False,
) -> Path:
    """Build and save the model and tokenizer under `path` (made if missing): its path.

    `bos`: the tokenizer puts `<s>` before every text and the chat template writes it too, as
    Llama 3's do (a server that tokenizes the rendered chat again gets two). vLLM's CPU
    attention needs heads of 32 dimensions or more: `hidden` 128 and up."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Every byte in the alphabet, as real byte-level tokenizers have it: any text can be
    # written (structured output needs "{" and digits, which the corpus lacks).
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    if bos:
        bos_id = bpe.token_to_id("<s>")
        bpe.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # untyped upstream
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:],
    )
    tokenizer.chat_template = ("{{ bos_token }}" if bos else "") + CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path

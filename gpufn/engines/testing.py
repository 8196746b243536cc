"""A tiny Llama-family model with seeded weights and a tokenizer trained here, for tests,
benchmarks and examples: nothing is downloaded."""

from __future__ import annotations

from typing import Any

CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "The scheduler packs invocations onto devices through a shared memory pool.",
    "Models are loaded once and shared by every function that uses them.",
    "Requests wait in priority queues and join the running batch between steps.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago, never mind how long precisely.",
    "In the beginning the universe was created; this made many people angry.",
    "The rain in Spain stays mainly in the plain.",
    "Water boils at one hundred degrees at sea level.",
    "Please write a short poem about the sea, the sky and the stars.",
    "def add(a, b):\n    return a + b\n",
    "GPUs decode many sequences at once because decoding is bound by memory bandwidth.",
    "Continuous batching lets a short request finish without waiting for a long one.",
    "Le petit chat dort sur le canape. Der Hund spielt im Garten. El sol brilla.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 42 100 1000.",
)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer trained on `CORPUS` (any text encodes: unseen words fall
    back to bytes), wrapped as transformers' `PreTrainedTokenizerFast`, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, *, seed: int = 0, hidden: int = 384, layers: int = 6,
               heads: int = 6, kv_heads: int = 2, intermediate: int = 1280,
               max_positions: int = 2048, dtype: Any = None) -> Any:
    """A `LlamaForCausalLM` (about 11.8M parameters at the defaults)
    with weights drawn from `seed`, in eval mode, using SDPA attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    fork_devices: list[Any] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def tiny_model_and_tokenizer(seed: int = 0, **model_options: Any) -> tuple[Any, Any]:
    """The tokenizer and a seeded model sized to its vocabulary."""
    tokenizer = tiny_tokenizer()
    return tiny_llama(len(tokenizer), seed=seed, **model_options), tokenizer

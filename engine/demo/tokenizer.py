"""The demo tokenizer: byte-level, special tokens first, no merges, built in memory (nothing downloaded)."""

from __future__ import annotations

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Reserved, never emitted by the template. transformers 5 loads every qwen2 folder with
# Qwen2Tokenizer, whose unk token this is; were it missing, the tokenizer would append it
# with an id past the model's vocabulary.
ENDOFTEXT_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values(), ENDOFTEXT_TOKEN)

# Turns are "<|role|>\n{content}</s>\n"; the generation prompt opens an assistant turn, so
# a model that emits </s> ends its own turn. Unknown roles are refused, not guessed.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo chat template: unsupported role ' ~ message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def printable_token_ids() -> list[int]:
    """Ids of the byte tokens for printable ASCII and newline (see ``build_tokenizer``)."""
    return [len(SPECIAL_TOKENS) + b for b in [ord("\n"), *range(0x20, 0x7F)]]


def build_tokenizer(model_max_length: int = 512):
    """A byte-level tokenizer: special tokens, then one token per byte, no merges.

    Ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, role markers 3-5, ``<|endoftext|>`` 6, then
    byte ``b`` is ``7 + b`` (vocabulary 263). Nothing is downloaded or trained, every
    string round-trips (Unicode up to NFC where transformers swaps in Qwen2Tokenizer), and
    encoding prepends ``<s>`` the way Llama tokenizers do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte, char in sorted(_bytes_to_unicode().items()):
        vocab[char] = len(SPECIAL_TOKENS) + byte
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = vocab[BOS_TOKEN]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

"""Write byte-llama's tokenizer: token id = byte value, bos = 2 (STX), eos = 3 (ETX), as the model was trained.

The model reads raw UTF-8 bytes (``train_byte_llama.py``: each training file is ``[bos] + bytes + [eos]``), so
the tokenizer is the identity on bytes. It is built with Hugging Face ``tokenizers`` (which vLLM's server
already loads through ``transformers``): the byte-level pre-tokenizer maps each byte to one printable
character (GPT-2's table), a BPE model without merges maps that character to the byte's value, a template
puts bos in front, and the byte-level decoder turns ids back into bytes and UTF-8 text. bos and eos are
special tokens, so ``skip_special_tokens`` drops them from decoded text. The chat template writes a
conversation as the Python comments the model knows (``# user: ...`` lines, then ``# assistant:``), after bos;
it is a format for serving tests, not an instruction-tuned model's.

    python integration/vllm/models/make_byte_tokenizer.py            # writes into byte-llama/
    python integration/vllm/models/make_byte_tokenizer.py --out DIR

The files are committed; ``tests/test_byte_model.py`` checks they are what this script writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BOS_ID, EOS_ID = 2, 3  # byte values that do not occur in text (train_byte_llama.py)
# NOTE: bos comes from the template: vLLM's chat path tokenizes the rendered text without special tokens
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:{% endif %}")
MODEL_DIR = Path(__file__).resolve().parent / "byte-llama"


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ``pre_tokenizers.ByteLevel`` emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build():
    """The ``PreTrainedTokenizerFast`` of byte-llama."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = byte_to_char()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = chars[BOS_ID], chars[EOS_ID]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    tok.add_special_tokens([AddedToken(bos, special=True), AddedToken(eos, special=True)])
    assert tok.token_to_id(bos) == BOS_ID and tok.token_to_id(eos) == EOS_ID and tok.get_vocab_size() == 256
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, model_max_length=2048,
                                   clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [Path(p) for p in build().save_pretrained(str(out))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=MODEL_DIR, help="directory to write into (default: byte-llama/)")
    a = p.parse_args(argv)
    for path in write(a.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The probe checkpoint's tokenizer: one token per word the RULER generators use, per digit and per punctuation mark.

    python3 tools/probe_tokenizer.py OUT_DIR   # writes tokenizer.json + tokenizer_config.json

A WordLevel model over exactly the words of sparsekv/tasks/ruler (words.py and the generators' templates): the
committed probe checkpoint's tokenizer. Every haystack word and needle key is one token; a 7-digit value is 7
tokens and a variable name ("RJSUQ") 5, one per letter, so a model copies names over a 26-letter alphabet it sees
in every variable_tracking sample, where 400 one-token names would each be rare (with one token per name no
probe learned variable tracking: docs/decisions.md). Text splits at whitespace, around punctuation, between
digits and between the letters of a capital word ("VAR" stays one token); decoding joins tokens with spaces
("1 2 3", which score_output matches as "123"). Prompts start with <bos>; there is no chat template.
"""
from __future__ import annotations

import re
import string
import sys
from pathlib import Path

SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>")
DIGITS = tuple("0123456789")
LETTERS = tuple(string.ascii_uppercase)
# a letter of an all-capital word of two letters or more, except the keyword VAR
SPELLED = r"(?<![A-Z])VAR(?![A-Z])|[A-Z](?=[A-Z])|(?<=[A-Z])[A-Z]"


def probe_vocabulary() -> list[str]:
    """Specials, digits, punctuation, then the words and the capital letters, in a fixed order (the ids never
    depend on set order)."""
    from sparsekv.tasks.ruler import generators, words

    texts = [re.sub(r"\{[a-z0-9_]+\}", " ", template) for template in generators.TEMPLATES]
    found = {w for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    for group in (words.NOUNS, words.ADJECTIVES, words.VERBS, words.ADVERBS, words.KEYS, words.LIST_WORDS):
        found.update(group)
    found.update(LETTERS)
    punctuation = sorted({c for text in texts for c in text if not c.isalnum() and not c.isspace()} | set(".,:=?"))
    return [*SPECIAL, *DIGITS, *punctuation, *sorted(found)]


def build_probe_tokenizer(out_dir: str | Path | None = None):
    """The committed checkpoint's tokenizer, a transformers PreTrainedTokenizerFast; saved to out_dir (loadable by
    AutoTokenizer) when given."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(probe_vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(pattern=Regex(SPELLED), behavior="isolated")])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>", model_max_length=1 << 20,
                                        clean_up_tokenization_spaces=False)
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 tools/probe_tokenizer.py OUT_DIR")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    built = build_probe_tokenizer(sys.argv[1])
    print(f"{len(built)} tokens written to {sys.argv[1]}")

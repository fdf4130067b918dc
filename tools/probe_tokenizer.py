"""The probe checkpoint's tokenizer: one token per word the RULER generators use, per digit and per punctuation mark.

    python3 tools/probe_tokenizer.py OUT_DIR [--spell-names]   # writes tokenizer.json + tokenizer_config.json

A WordLevel model over exactly the words of sparsekv/tasks/ruler (words.py and the generators' templates), so a
7-digit value is 7 tokens and every haystack word and variable name ("RJSUQ") is one: the committed probe
checkpoint's tokenizer. With spell_names, variable names are spelled instead, one token per letter, as values
are one token per digit, so a model copies them over a 26-letter alphabet it sees in every variable_tracking
sample, where 400 one-token names would each be rare (a trial recipe, docs/probe.md). Text splits at whitespace,
around punctuation and between digits (with spell_names also between the letters of a capital word; "VAR" stays
one token); decoding joins tokens with spaces ("1 2 3", which score_output matches as "123"). Prompts start with
<bos>; there is no chat template.
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


def probe_vocabulary(spell_names: bool = False) -> list[str]:
    """Specials, digits, punctuation, then the words (and capital letters, or whole variable names without
    spell_names), in a fixed order (the ids never depend on set order)."""
    from sparsekv.tasks.ruler import generators, words

    texts = [re.sub(r"\{[a-z0-9_]+\}", " ", template) for template in generators.TEMPLATES]
    found = {w for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    for group in (words.NOUNS, words.ADJECTIVES, words.VERBS, words.ADVERBS, words.KEYS, words.LIST_WORDS):
        found.update(group)
    found.update(LETTERS if spell_names else words.VAR_NAMES)
    punctuation = sorted({c for text in texts for c in text if not c.isalnum() and not c.isspace()} | set(".,:?"))
    return [*SPECIAL, *DIGITS, *punctuation, *sorted(found)]


def build_probe_tokenizer(out_dir: str | Path | None = None, spell_names: bool = False):
    """A transformers PreTrainedTokenizerFast; saved to out_dir (loadable by AutoTokenizer) when given. The
    default is the committed checkpoint's tokenizer (one token per variable name); spell_names spells names."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(probe_vocabulary(spell_names))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    splits = [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated"),
              pre_tokenizers.Digits(individual_digits=True)]
    if spell_names:
        splits.append(pre_tokenizers.Split(pattern=Regex(SPELLED), behavior="isolated"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>", model_max_length=1 << 20,
                                        clean_up_tokenization_spaces=False)
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--spell-names"]):
        sys.exit("usage: python3 tools/probe_tokenizer.py OUT_DIR [--spell-names]")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    built = build_probe_tokenizer(sys.argv[1], spell_names=sys.argv[2:] == ["--spell-names"])
    print(f"{len(built)} tokens written to {sys.argv[1]}")

"""Sentence splitting for long inputs: the rules of LiveKit's basic sentence tokenizer
(livekit-agents `tokenize/_basic_sent.py`, Apache-2.0, itself after
https://stackoverflow.com/a/31505798), ported so that the engine does not import LiveKit.
tests/engine/test_package.py checks that both split the same texts the same way."""

from __future__ import annotations

import re

_ALPHABETS = r"([A-Za-z])"
_PREFIXES = r"(Mr|St|Mrs|Ms|Dr)[.]"
_SUFFIXES = r"(Inc|Ltd|Jr|Sr|Co)"
_STARTERS = (r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s"
             r"|However\s|That\s|This\s|Wherever)")  # fmt: skip
_ACRONYMS = r"([A-Z][.][A-Z][.](?:[A-Z][.])?)"
_WEBSITES = r"[.](com|net|org|io|gov|edu|me)"
_DIGITS = r"[0-9]"
_MULTIPLE_DOTS = r"\.{2,}"
_ENDS = r"[.!?。！？؟۔।॥]"  # also Arabic, Urdu and the Devanagari/Bengali dandas


def split_sentences(text: str, min_sentence_len: int = 20) -> list[str]:
    """Sentences of `text`; a sentence shorter than `min_sentence_len` joins the next one."""
    text = text.replace("\n", " ")
    text = re.sub(_PREFIXES, "\\1<prd>", text)
    text = re.sub(_WEBSITES, "<prd>\\1", text)
    text = re.sub(r"(?<=" + _DIGITS + r")\.(?=" + _DIGITS + ")", "<prd>", text)  # 1.2.3
    text = re.sub(_MULTIPLE_DOTS, lambda m: "<prd>" * len(m.group(0)), text)
    if "Ph.D" in text:
        text = text.replace("Ph.D.", "Ph<prd>D<prd>")
    text = re.sub(r"\s" + _ALPHABETS + "[.] ", " \\1<prd> ", text)
    text = re.sub(_ACRONYMS + " " + _STARTERS, "\\1<stop> \\2", text)
    text = re.sub(_ALPHABETS + "[.]" + _ALPHABETS + "[.]" + _ALPHABETS + "[.]",
                  "\\1<prd>\\2<prd>\\3<prd>", text)  # fmt: skip
    text = re.sub(_ALPHABETS + "[.]" + _ALPHABETS + "[.]", "\\1<prd>\\2<prd>", text)
    text = re.sub(r" " + _SUFFIXES + "[.] " + _STARTERS, " \\1<stop> \\2", text)
    text = re.sub(r" " + _SUFFIXES + "[.]", " \\1<prd>", text)
    text = re.sub(r" " + _ALPHABETS + "[.]", " \\1<prd>", text)
    text = re.sub("(" + _ENDS + r")([\"”])", "\\1\\2<stop>", text)
    text = re.sub("(" + _ENDS + r")(?![\"”])", "\\1<stop>", text)
    text = text.replace("<prd>", ".")

    sentences, buff = [], ""
    for part in text.split("<stop>"):
        part = part.strip()
        if not part:
            continue
        buff += " " + part
        if len(buff) > min_sentence_len:
            sentences.append(buff[1:])
            buff = ""
    if buff:
        sentences.append(buff[1:])
    return sentences


def split_input(text: str) -> list[str]:
    """The pieces a long input is synthesized in, one after another: its sentences (as LiveKit's
    basic tokenizer cuts them, short ones merged), stripped; the whole text when none is found."""
    parts = [s.strip() for s in split_sentences(text, min_sentence_len=20)]
    return [p for p in parts if p] or [text.strip()]

"""ROUGE-L between generated texts in any script: word tokens, and one token per character of unspaced scripts."""

from __future__ import annotations

import re
from typing import Sequence

# Scripts written without spaces between words (CJK ideographs, kana, Hangul syllables, Thai, ...): each character is
# one token, as ROUGE for Chinese is usually counted. Everything else: runs of letters and digits, lowercased.
_UNSPACED = ("\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf"
             "\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff")
_TOKEN = re.compile(rf"[{_UNSPACED}]|[^\W_{_UNSPACED}]+")


def rouge_tokens(text: str) -> list[str]:
    """`text`'s ROUGE tokens. On ASCII text the same as the usual ROUGE normalisation (lowercase, runs of a-z0-9);
    letters of other alphabets are kept (that normalisation drops them: Chinese, Cyrillic or Greek text has no
    tokens there, and two identical answers score 0)."""
    return _TOKEN.findall(text.lower())


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F-measure over (prediction, reference) pairs; a pair of two texts with no tokens (two empty
    answers) scores 1, one empty against one not 0."""
    if len(predictions) != len(references):
        raise ValueError(f"rouge_l: {len(predictions)} predictions against {len(references)} references")
    if not predictions:
        return 0.0
    total = 0.0
    for prediction, reference in zip(predictions, references):
        p, r = rouge_tokens(prediction), rouge_tokens(reference)
        if not p or not r:
            total += float(not p and not r)
            continue
        common = _lcs_length(p, r)
        if common:
            precision, recall = common / len(p), common / len(r)
            total += 2 * precision * recall / (precision + recall)
    return total / len(predictions)

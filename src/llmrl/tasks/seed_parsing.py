"""The course starter's answer parsing, rule for rule: format_copy's tag grading and math_hard's
`--math_reward seed` numbers (SPEC.md "Seed parity").

These rules are the definition of the seed's rewards, odd places included, so that llmrl's seed runs
score every completion as the published runs did:
- every comma is removed before a number is read (`1,2` is 12), and `$`, `\\$`, `\\left`, `\\right` too;
- a number is an integer or decimal (`.5` included), `a/b`, `\\frac{a}{b}` (also `\\dfrac`, `\\tfrac`,
  with a sign in front), a mixed number (`2 1/2`, `2\\frac{1}{2}`), inside at most one layer of braces
  and any number of `\\text{}`/`\\mathrm{}` wrappers; anything else is not a number;
- `<think>…</think>` blocks are removed first (a stray `</think>` too), then the text is stripped;
- the last `\\boxed{` whose braces close is the boxed answer (an unclosed last one falls back to the
  one before).
Better grading belongs to `--math_reward verify` (llmrl.grading), never here.
"""

from __future__ import annotations

import math
import re

from llmrl.grading import closing_brace

THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)  # first tag; content stripped after
ONLY_ONE_TAG = re.compile(r"\s*<answer>.*</answer>\s*", re.IGNORECASE | re.DOTALL)  # starts and ends with a tag
NUMBER_IN_TEXT = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?")  # what counts as "a number" when scanning text
BOXED = re.compile(r"\\boxed\s*\{")

_INT = r"\s*([-+]?\d+)\s*"
_FRAC = r"\\(?:d?frac|tfrac)\s*\{" + _INT + r"\}\s*\{" + _INT + r"\}"
WRAPPED = re.compile(r"\\(?:text|mathrm)\s*\{(.*)\}", re.DOTALL)
SIGNED_FRAC = re.compile(r"([+-]?)\s*" + _FRAC)  # -\frac{1}{2}
LATEX_MIXED = re.compile(r"([-+]?\d+)\s*" + _FRAC)  # 2\frac{1}{2}
SLASH_MIXED = re.compile(r"([-+]?\d+)\s+([-+]?\d+)\s*/\s*([-+]?\d+)")  # 2 1/2
SLASH = re.compile(r"([-+]?\d+)\s*/\s*([-+]?\d+)")  # 3/4
PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")  # 12, -0.5, .5
ZERO = 1e-12  # a denominator this small is no number
TOLERANCE = 1e-6  # |prediction − gold| below this is a match


def without_think(text: str) -> str:
    """The text the graders read: `<think>…</think>` blocks and stray `</think>` removed, stripped."""
    return THINK.sub("", text).replace("</think>", "").strip()


def _ratio(num: float, den: float) -> float | None:
    return None if abs(den) < ZERO else num / den


def _mixed(whole: float, num: float, den: float) -> float | None:
    """whole and a fraction, the fraction taking the sign of the whole part (−2 1/2 is −2.5)."""
    frac = _ratio(num, den)
    if frac is None:
        return None
    return whole - abs(frac) if whole < 0 else whole + abs(frac)


def parse_number(text: str) -> float | None:
    """A whole string read as one number, or None (see the module docstring for what counts)."""
    t = text.strip()
    if not t:
        return None
    for junk in ("\\$", "$", ","):
        t = t.replace(junk, "")
    t = t.replace("\\left", "").replace("\\right", "").strip()
    if len(t) >= 2 and t[0] == "{" and t[-1] == "}" and t[1:-1].strip():
        t = t[1:-1].strip()  # one layer of braces
    if m := WRAPPED.fullmatch(t):
        return parse_number(m.group(1))
    if m := SIGNED_FRAC.fullmatch(t):
        value = _ratio(float(m.group(2)), float(m.group(3)))
        return None if value is None else (-1.0 if m.group(1) == "-" else 1.0) * value
    if m := LATEX_MIXED.fullmatch(t) or SLASH_MIXED.fullmatch(t):
        return _mixed(float(m.group(1)), float(m.group(2)), float(m.group(3)))
    if m := SLASH.fullmatch(t):
        return _ratio(float(m.group(1)), float(m.group(2)))
    return float(t) if PLAIN.fullmatch(t) else None


def last_number(text: str) -> float | None:
    """The last number written anywhere in the text (think blocks removed), read by parse_number."""
    found = NUMBER_IN_TEXT.findall(without_think(text))
    return parse_number(found[-1]) if found else None


def answer_tag(text: str) -> str | None:
    """The stripped content of the first `<answer>…</answer>` (think blocks removed), or None."""
    m = ANSWER_TAG.search(without_think(text))
    return m.group(1).strip() if m else None


def is_only_answer_tag(text: str) -> bool:
    """The text (think blocks removed) starts with `<answer>` and ends with `</answer>`."""
    return ONLY_ONE_TAG.fullmatch(without_think(text)) is not None


def tag_number(text: str) -> float | None:
    """The number in the first answer tag: its whole content if that is a number, else its last number."""
    content = answer_tag(text)
    if content is None:
        return None
    value = parse_number(content)
    if value is not None:
        return value
    found = NUMBER_IN_TEXT.findall(content)
    return parse_number(found[-1]) if found else None


def last_boxed(text: str) -> str | None:
    """Stripped content of the last `\\boxed{…}` whose braces close (think blocks removed), or None."""
    cleaned = without_think(text)
    for m in reversed(list(BOXED.finditer(cleaned))):
        end = closing_brace(cleaned, m.end() - 1)
        if end is not None:
            return cleaned[m.end() : end].strip()
    return None


def boxed_number(text: str) -> float | None:
    """The last closed boxed answer read as a number, or None."""
    content = last_boxed(text)
    return None if content is None else parse_number(content)


def matches(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) < TOLERANCE


def solution_gold(solution: str) -> float | None:
    """A MATH solution's numeric gold: its last boxed answer, else the whole solution as a number;
    None if neither is a finite number (the row is then not used)."""
    gold = boxed_number(solution)
    if gold is None:
        gold = parse_number(solution)
    return gold if gold is not None and math.isfinite(gold) else None

"""Alias bombs ("billion laughs") as a ConfigMap could carry them (issue 21, item 4)."""

from __future__ import annotations

_LEVELS = "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh", strict=True)
)
_BASE = "version: v1\na: &a [x, x, x, x, x, x, x, x, x]\n" + _LEVELS

# 9**8 = 43 million leaves, used twice as a key: the duplicate-key check compared and printed it.
COMPLEX_KEY = _BASE + "? *h\n: 1\n? *h\n: 2\n"
# The same expansion as a plain value: nothing to compare, but building it takes gigabytes.
VALUE = _BASE + "z: *h\n"

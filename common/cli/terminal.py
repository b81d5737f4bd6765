"""What the commands print of a service's or the model's text: nothing a terminal would act on."""

from __future__ import annotations

import unicodedata

# Kept as they are: line breaks and tabs are layout, the joiners build emoji and scripts' ligatures.
_KEPT_CONTROLS = frozenset("\n\t\u200c\u200d")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def terminal_safe(text: str) -> str:
    """The model's text with what a terminal would act on written as escapes (`\\x1b`, `\\u202e`): a
    random or hostile answer must not clear the screen, move the cursor or reorder what follows."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _KEPT_CONTROLS or unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
            out.append(ch)
        else:
            out.append(ascii(ch)[1:-1])
    return "".join(out)

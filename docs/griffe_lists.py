"""A griffe extension (mkdocs.yml loads it): docstring lists render as lists.

Docstrings here write a list right under its heading, Equinox's way (`**Arguments:**` then
`- name: ...` on the next line). Markdown reads a list that follows a paragraph line with no
blank line between them as more of the paragraph, so the site showed the items run together;
this puts the blank line in, in the text the API pages render (the docstrings are unchanged).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_LIST_UNDER_HEADING = re.compile(r"^(\*\*[^*\n]+:\*\*[^\n]*)\n(?=- )", re.M)


def spaced(text: str) -> str:
    """`text` with a blank line between a bold heading line and the list right under it.

    **Example:** `spaced("**Arguments:**\\n- `x`: a tensor.")` is `"**Arguments:**\\n\\n- `x`: a tensor."`.
    """
    return _LIST_UNDER_HEADING.sub(r"\1\n\n", text)


class MarkdownLists(griffe.Extension):
    """Applies `spaced` to every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = spaced(obj.docstring.value)

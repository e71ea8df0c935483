"""URLs with their secrets left out, for logs and answers: an RPC URL may carry credentials
(user:password@, or an API key in its path or query), and logs go where others read them
(`docker compose logs`, a support ticket)."""
from __future__ import annotations

import re

# its userinfo (`user:pass@`) and what follows host and port (a path token such as Infura's
# /v3/<key>, a query's ?apikey=) may be credentials
URL = re.compile(r"(?P<origin>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^\s/?#'\"<>]*@)?"
                 r"(?P<host>[^\s/?#'\"<>@]*)(?P<rest>[/?#][^\s'\"<>]*)?", re.IGNORECASE)


def redacted(text: str, paths: bool = True) -> str:
    """`text` with each URL's userinfo, query and fragment as `***`, and its path too unless
    `paths` is False (a command's own error line, where the path tells the user which URL
    answered)."""
    def redact(url: re.Match) -> str:
        whole = url["rest"] or ""
        rest = whole.rstrip(":,;.)")  # what it strips is the sentence's, not the URL's
        punctuation = whole[len(rest):]
        kept = "" if paths else re.split(r"[?#]", rest, maxsplit=1)[0]
        hidden = rest[len(kept):]
        return (url["origin"] + ("***@" if url["userinfo"] else "") + url["host"] + kept
                + (hidden if hidden in ("", "/") else hidden[0] + "***") + punctuation)
    return URL.sub(redact, text)

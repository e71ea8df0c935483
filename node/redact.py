"""URLs with their secrets left out, for logs and answers: an RPC URL may carry credentials
(user:password@, or an API key in its path or query), and logs go where others read them
(`docker compose logs`, a support ticket)."""
from __future__ import annotations

import re

# its userinfo (`user:pass@`) and what follows host and port (a path token such as Infura's
# /v3/<key>, a query's ?apikey=) may be credentials
URL = re.compile(r"(?P<origin>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^\s/?#'\"<>]*@)?"
                 r"(?P<host>[^\s/?#'\"<>@]*)(?P<rest>[/?#][^\s'\"<>]*)?", re.IGNORECASE)


def redacted(text: str) -> str:
    """`text` with each URL's userinfo and path, query and fragment as `***`."""
    def redact(url: re.Match) -> str:
        rest = url["rest"] or ""
        return (url["origin"] + ("***@" if url["userinfo"] else "") + url["host"]
                + (rest if rest in ("", "/") else rest[0] + "***"))
    return URL.sub(redact, text)
